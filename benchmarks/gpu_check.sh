#!/usr/bin/env bash
# One prepared GPU run (issue #13, item 4; never in CI, needs a CUDA GPU):
#   1. the decode-kernel tests *compiled* on the GPU (KVLENS_KERNEL_TEST_DEVICE=cuda moves every
#      kernel input to CUDA; TRITON_INTERPRET=0 overrides the interpreter tests/conftest.py sets),
#      uniform and codebook layouts;
#   2. bench_kernels.py's GPU correctness checks for every layout, then decode timings at 4k, 32k
#      and 128k tokens: fp16 SDPA vs kivi-2 and the new layouts (per-token keys + per-channel
#      values, per-tensor, 3-bit, codebook keys or values), 2 and 4 bits, G64, MHA and GQA layers.
# Usage (repository root, kvlens + kernels importable):  bash benchmarks/gpu_check.sh [out.json]
set -euo pipefail
out="${1:-bench_kernels_gpu.json}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
TRITON_INTERPRET=0 KVLENS_KERNEL_TEST_DEVICE=cuda python -m pytest -q -x \
    tests/test_kernels_decode.py tests/test_kernels_codebook.py
python benchmarks/bench_kernels.py --contexts 4096 32768 131072 --bits 2 4 --groups 64 \
    --layouts kivi tokch tensor tok3 kivi8 cbk cbv --out "$out"
