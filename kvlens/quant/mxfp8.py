"""OCP MXFP8 (OCP Microscaling Formats v1.0, 2023, sections 5.3 and 6.3): E4M3 elements with one
E8M0 power-of-two scale per block of ``BLOCK = 32`` consecutive channels, in plain torch; SGLang's
``--kv-cache-dtype mxfp8`` stores each token's ``[D]`` vector of one KV head this way (one UE8M0
byte per 32 channels beside the E4M3 elements).

A block stores ``X = 2^e`` as the byte ``e + 127`` and 32 E4M3 elements (``float8_e4m3fn``: 4
exponent bits, bias 7, 3 mantissa bits, largest finite 448, no infinities). By the
specification's conversion: ``e = floor(log2(max_i |V_i|)) - emax`` with ``emax = 8`` (E4M3's
largest normal exponent), clamped to the E8M0 range ``[-127, 127]`` (an all-zero block takes
``-127``); each ``V_i / X`` is rounded to the nearest E4M3 value, ties to even, and values beyond
448 saturate to +-448 (``V / X`` lies in ``[2^8, 2^9)`` for the largest element, so it can exceed
448: the specification leaves the choice to the implementation, and saturating is the choice
that never stores NaN). ``x_hat = X * P_i``. torchao's ``to_mx`` (``ScaleCalculationMode.FLOOR``)
gives the same bytes (``tests/test_layout_mxfp8.py``).
"""

from __future__ import annotations

import torch

from kvlens.quant.fp4 import E4M3_MAX, E8M0_BIAS

BLOCK = 32  # channels sharing one E8M0 scale (the MX block size K)
E4M3_EMAX = 8  # exponent of E4M3's largest normal value, 1.75 * 2^8 = 448


def mx_exponents(x: torch.Tensor) -> torch.Tensor:
    """The shared exponent ``e`` per block of ``BLOCK`` channels: ``[..., D]`` float32 ->
    ``[..., D / BLOCK]`` int32."""
    amax = x.unflatten(-1, (-1, BLOCK)).abs().amax(-1)
    _, exponent = torch.frexp(amax)  # amax = m 2^E, m in [0.5, 1): floor(log2 amax) = E - 1
    e = torch.where(amax > 0, exponent - 1 - E4M3_EMAX, -E8M0_BIAS)  # a zero block: -127
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(elements, scale bytes)`` of ``x`` ``[..., D]``: E4M3 bytes ``[..., D]`` (uint8) and
    E8M0 bytes ``[..., D / BLOCK]`` (uint8)."""
    x = x.float()
    e = mx_exponents(x)
    scaled = x.unflatten(-1, (-1, BLOCK)) * torch.exp2(-e.float())[..., None]
    p = scaled.clamp(-E4M3_MAX, E4M3_MAX).flatten(-2).to(torch.float8_e4m3fn)
    return p.view(torch.uint8), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``X * P`` from the stored bytes (``quantize_mxfp8``'s)."""
    p = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, BLOCK))
    x = torch.exp2(scales.float() - E8M0_BIAS)[..., None]
    return (p * x).flatten(-2)
