#!/usr/bin/env bash
# The prepared GPU run (never in CI, needs a CUDA GPU): a thin wrapper over
# benchmarks/gpu_acceptance.py (the whole pipeline on the default model with the Triton backend,
# the decode-kernel benchmark against fp16 SDPA at 8k-32k tokens, one JSON summary) that also
# runs the kernel tests compiled on the GPU (--kernel-tests, outside the 8-minute budget).
# docs/internals/gpu-acceptance.md says what each step checks.
# Usage (repository root or anywhere; kvlens + kvlens_kernels installed):
#   bash benchmarks/gpu_check.sh [gpu_acceptance.py options, e.g. --summary out-gpu/summary.json]
# $PYTHON picks the interpreter (default: python). Exit status: 0 only when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_acceptance.py --kernel-tests "$@"
