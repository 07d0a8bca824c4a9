"""Shared helpers of the Triton kernels: packing geometry, rounding and input checks.

Kernels take tensors and ints only and import nothing of kvlens (the package stands alone).
Errors raised here are ``KernelInputError`` (a ``ValueError``) with the allowed values in the
message. The packing geometry and the 8-bit metadata constants restate kvlens' layout
(``kvlens.quant.packing``, ``kvlens.quant.meta8``); ``tests/test_kernels_decode.py`` checks that
they agree, so the two cannot drift.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: ``2^23``: adding and subtracting it rounds a float32 in ``[0, 2^22]`` to the nearest integer,
#: ties to even (IEEE round-to-nearest), i.e. ``torch.round``; used under the interpreter, where
#: ``libdevice.rint`` is unavailable.
ROUND_MAGIC = 8388608.0
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny
SCALE_FLOOR_REL = 1e-8  # kvlens.quant.reference.SCALE_FLOOR_REL


class KernelInputError(ValueError):
    """A kernel argument of the wrong type, shape, dtype, device or value."""


#: 8-bit group metadata: ``scale = 2 ** ((e - META8_SCALE_BIAS) / META8_SCALE_STEPS)``.
META8_SCALE_BIAS, META8_SCALE_STEPS = 128, 8


def pack_unit(bits: int) -> tuple[int, int]:
    """``(U, W)``: ``U`` codes of ``bits`` bits fill ``W`` whole bytes (dense packing)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise KernelInputError(f"bits must be an integer in 1..8, got {bits!r}.")
    w = bits // math.gcd(bits, 8)
    return 8 * w // bits, w


def use_libdevice(t: torch.Tensor) -> bool:
    """Compiled CUDA kernels use ``libdevice.rint``; the interpreter uses the ``2^23`` trick."""
    return t.device.type == "cuda"


def check_tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...], device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelInputError(f"{name} has dtype {t.dtype}; allowed: {allowed}.")
    if device is not None and t.device != device:
        raise KernelInputError(f"{name} is on {t.device} but the query/input is on {device}; put all "
                         f"kernel inputs on one device.")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """``expected`` entries of ``None`` are not checked."""
    if len(t.shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(t.shape, expected, strict=False)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise KernelInputError(f"{name} has shape {list(t.shape)}; expected {want}.")


def check_int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise KernelInputError(f"{name} must be an integer >= {lo}, got {v!r}.")
    return v


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@triton.jit
def round_half_even(v, USE_LIBDEVICE: tl.constexpr):
    """``torch.round`` of a non-negative float32 below ``2^22`` (ties to even)."""
    if USE_LIBDEVICE:
        r = libdevice.rint(v)
    else:
        r = (v + 8388608.0) - 8388608.0
    return r
