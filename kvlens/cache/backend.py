"""Backend choice for the compressed cache's attention: ``select_backend`` is the one place that
chooses between the torch read path (``kvlens.cache.torch_read``) and the Triton decode kernel
(package ``kvlens_kernels``, glue in ``kvlens.cache.triton_glue``) for a run, and says why the
kernel is not used when it is not (no silent fallback: callers print the reason).
"""

from __future__ import annotations

import os

import torch

from kvlens.errors import BackendError, InputError

BACKENDS = ("auto", "torch", "triton")
TRITON_ENTRY = "decode_attention"


def _triton_import_problem() -> str | None:
    try:
        import kvlens_kernels
    except ImportError as exc:
        return (f"the Triton kernels package kvlens_kernels is not importable ({exc}); install "
                "it from kernels/ with `pip install -e kernels`")
    if not hasattr(kvlens_kernels, TRITON_ENTRY):
        return f"kvlens_kernels has no {TRITON_ENTRY}() entry point"
    return None


def select_backend(requested: str, device) -> tuple[str, str]:
    """``(backend, reason)`` for ``requested`` in ``auto|torch|triton`` on ``device``: ``auto``
    picks triton only for CUDA tensors; ``triton`` elsewhere needs ``TRITON_INTERPRET=1`` (slow,
    for tests) and otherwise, or without the kernels package, raises ``BackendError``."""
    if requested not in BACKENDS:
        raise InputError(f"Unknown backend {requested!r}; allowed: {', '.join(BACKENDS)}.")
    if requested == "torch":
        return "torch", "torch path requested"
    kind = torch.device(device).type
    if requested == "auto":
        if kind != "cuda":
            return "torch", (f"{kind.upper() if kind == 'cpu' else kind} tensors: torch path "
                             "(auto uses the Triton kernels only for CUDA tensors)")
        problem = _triton_import_problem()
        if problem:
            return "torch", f"Triton not used: {problem}"
        return "triton", ("CUDA tensors: Triton decode kernel for single-token decode steps, "
                          "torch path otherwise")
    if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendError(f"{{backend}} triton is unavailable: the Triton kernels need CUDA "
                           f"tensors (this run is on {kind}); to run them slowly on CPU for "
                           "testing, set TRITON_INTERPRET=1 in the environment before starting.")
    problem = _triton_import_problem()
    if problem:
        raise BackendError(f"{{backend}} triton is unavailable: {problem}.")
    where = "CUDA" if kind == "cuda" else f"{kind} under TRITON_INTERPRET=1 (slow, for testing)"
    return "triton", (f"Triton requested ({where}): decode kernel for single-token decode "
                      "steps, torch path otherwise")
