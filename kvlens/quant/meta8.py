"""8-bit group metadata: one byte of scale and one of zero per group (``scale_dtype = "8bit"``;
why: docs/recommend.md#8-bit-group-metadata)::

    scale  s = 2 ** ((e - 128) / 8)     e: uint8, 0..255 (s from 2^-16 to 2^15.875, 9% steps)
    zero   z = n * u * s                n: int8, -128..127; u = 2 ** (max(bits, 3) - 5)

Dequantization is unchanged, ``x_hat = code * s + z``. ``quantize_meta8`` tries the stored pairs
near the reference's fitted ``(scale, zero)`` (``E_OFFSETS`` scale steps, ``N_OFFSETS`` zero
units; the scale raised first so that ``|zero| <= 127 u s``), codes each against its own grid,
and stores the pair with the least squared error: the codes are always those of the stored grid
(``tests/test_meta8.py`` bounds the error against the float32 grid's). ``fake_quantize`` reads a
tensor back as a cache storing its group metadata in 8 bits or as floats gives it (analysis,
recommend, the transforms and the uniform layout's reference call this one function).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvlens.quant.reference import (
    QTensor,
    _grouped,
    at_groups,
    dequantize,
    expand_params,
    member_weight,
    quantize,
)
from kvlens.quant.spec import QuantSpec

SCALE_BIAS, SCALE_STEPS = 128, 8  # s = 2 ** ((e - SCALE_BIAS) / SCALE_STEPS)
E_OFFSETS = (-1, 0, 1, 2)  # stored scales tried, in 9% steps from the fitted one rounded up
N_OFFSETS = (-1, 0, 1)  # stored zeros tried, in zero units from the nearest


def zero_unit(bits: int) -> float:
    """``u``: the zero's unit, in quantization steps, for ``bits``-bit codes."""
    return 2.0 ** (max(bits, 3) - 5)


def code_levels(spec: QuantSpec) -> int:
    """``L``: the largest stored code (asymmetric ``2^b - 1``, symmetric ``2 qmax``)."""
    return 2 * ((1 << (spec.bits - 1)) - 1) if spec.symmetric else spec.levels


def decode_scale(e: torch.Tensor) -> torch.Tensor:
    """The float32 scale of uint8 exponent codes ``e``."""
    return torch.exp2((e.float() - SCALE_BIAS) / SCALE_STEPS)


def decode_group_meta(e: torch.Tensor, n: torch.Tensor, bits: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` float32 of stored bytes ``e`` (uint8) and ``n`` (int8)."""
    s = decode_scale(e)
    return s, n.float() * (zero_unit(bits) * s)


def _search(groups: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, n)`` per group: the stored pair near the fitted ``(scale, zero)`` with the least
    squared error over the group's elements (module docstring)."""
    levels, u = code_levels(spec), zero_unit(spec.bits)
    start = torch.maximum(scale, zero.abs() / (127 * u))  # |zero| within 127 zero units
    e0 = torch.ceil(torch.log2(start) * SCALE_STEPS) + SCALE_BIAS
    at = at_groups
    # weight is 1 everywhere unless a partial last token group was padded: skip it then
    weight = None if bool((weight == 1).all()) else weight
    work = torch.empty_like(groups)  # one buffer for every pair, the arithmetic in place
    best_err = best_e = best_n = None
    for de in E_OFFSETS:
        e = (e0 + de).clamp(0, 255)
        s = decode_scale(e)
        n_mid = torch.round(zero / (u * s))
        for dn in N_OFFSETS:
            n = (n_mid + dn).clamp(-128, 127)
            z = n * (u * s)
            # codes = clip(round((x - z) / s)); error = (codes * s + z - x)^2, op for op
            torch.sub(groups, at(z), out=work)
            work.div_(at(s)).round_().clamp_(0, levels)
            work.mul_(at(s)).add_(at(z)).sub_(groups).square_()
            if weight is not None:
                work.mul_(weight)
            err = work.sum(dim=(3, 5))
            if best_err is None:
                best_err, best_e, best_n = err, e, n
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_e, best_n = torch.where(better, e, best_e), torch.where(better, n, best_n)
    return best_e.to(torch.uint8), best_n.to(torch.int8)


def quantize_meta8(x: torch.Tensor, spec: QuantSpec
                   ) -> tuple[QTensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[B, H, T, D]`` with 8-bit group metadata: ``(q, e, n)`` where ``q`` holds
    the codes against the stored grid and its decoded float32 ``scale``/``zero`` (so
    ``kvlens.quant.dequantize(q)`` is what a cache storing ``(codes, e, n)`` gives back), and
    ``e``/``n`` are the stored bytes, shaped like ``q.scale``."""
    q = quantize(x, spec)
    xf = x.detach().float()
    groups = _grouped(xf, *spec.block_shape(q.shape[2], q.shape[3]))
    e, n = _search(groups, member_weight(groups, q.shape[2]), q.scale, q.zero, spec)
    scale, zero = decode_group_meta(e, n, spec.bits)
    codes = torch.round((xf - expand_params(zero, spec, q.shape))
                        / expand_params(scale, spec, q.shape)).clamp_(0, code_levels(spec))
    return QTensor(codes.to(torch.uint8), scale, zero, spec, q.shape), e, n


def fake_quantize_meta8(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """What a cache with 8-bit group metadata gives back for ``x``, in ``x``'s dtype."""
    return dequantize(quantize_meta8(x, spec)[0], dtype=x.dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, scale_dtype: str = "float32"
                  ) -> torch.Tensor:
    """``dequantize(quantize(x, spec))`` in ``x``'s dtype, each group's scale and zero as a cache
    stores them: 8-bit group metadata (``scale_dtype="8bit"``), else rounded to ``scale_dtype``
    (``"float16"``, ``"float32"``: the reference's own)."""
    if scale_dtype == "8bit":
        return fake_quantize_meta8(x, spec)
    q = quantize(x, spec)
    dt = getattr(torch, scale_dtype)
    q = replace(q, scale=q.scale.to(dt).float(), zero=q.zero.to(dt).float())
    return dequantize(q, dtype=x.dtype)
