"""Shared helpers of the Triton kernels: packing geometry, rounding and input checks.

Kernels take tensors and ints only. Errors raised here are ``kvlens.errors.InputError`` (a user
cause, rendered by the CLI) with the allowed values in the message.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvlens.errors import ConfigError, InputError
from kvlens.quant import packing

#: ``2^23``: adding and subtracting it rounds a float32 in ``[0, 2^22]`` to the nearest integer,
#: ties to even (IEEE round-to-nearest), i.e. ``torch.round``; used under the interpreter, where
#: ``libdevice.rint`` is unavailable.
ROUND_MAGIC = 8388608.0
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny
SCALE_FLOOR_REL = 1e-8  # kvlens.quant.reference.SCALE_FLOOR_REL


def pack_unit(bits: int) -> tuple[int, int]:
    """``kvlens.quant.packing.pack_unit`` (``U`` codes fill ``W`` bytes), its error as the
    kernels' ``InputError``."""
    try:
        return packing.pack_unit(bits)
    except ConfigError as e:
        raise InputError(str(e)) from None


def container_bits(bits: int) -> int:
    """The byte-aligned widths the quantize-and-pack kernels write (1, 2, 4, 8); other widths
    are packed densely across bytes, which those kernels do not write (``InputError``)."""
    u, w = pack_unit(bits)
    if w != 1:
        raise InputError(f"The Triton quantize-and-pack kernels write 1-, 2-, 4- and 8-bit codes; "
                         f"{bits}-bit codes are packed {u} per {w} bytes, which they do not "
                         f"write: use kvlens.quant.quantize + pack_codes for them.")
    return bits


def codes_per_byte(bits: int) -> int:
    return 8 // container_bits(bits)


def use_libdevice(t: torch.Tensor) -> bool:
    """Compiled CUDA kernels use ``libdevice.rint``; the interpreter uses the ``2^23`` trick."""
    return t.device.type == "cuda"


def check_tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...], device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != ndim:
        raise InputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InputError(f"{name} has dtype {t.dtype}; allowed: {allowed}.")
    if device is not None and t.device != device:
        raise InputError(f"{name} is on {t.device} but the query/input is on {device}; put all "
                         f"kernel inputs on one device.")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """``expected`` entries of ``None`` are not checked."""
    if len(t.shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(t.shape, expected, strict=False)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise InputError(f"{name} has shape {list(t.shape)}; expected {want}.")


def check_int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(f"{name} must be an integer >= {lo}, got {v!r}.")
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
