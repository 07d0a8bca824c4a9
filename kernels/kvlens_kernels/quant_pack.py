"""Quantize-and-pack: ``[B, H, T, D]`` float -> packed uint8 codes + scale/zero, in one pass.

Torch reference: ``kvlens.quant.quantize`` (asymmetric ``QuantSpec``) followed by
``kvlens.quant.pack_codes``; the output is exactly the layout of ``kvlens.cache.packed``. Codes
are bit-identical to the reference: everything is float32, ``scale = max((M - m) / L,
1e-8 * absmax, tiny)`` with an IEEE division (``tl.math.div_rn``), ``code = round((x - m) /
scale)`` with an IEEE division and round-half-to-even (``libdevice.rint`` when compiled; the
``+2^23 - 2^23`` trick under the interpreter), clamped to ``[0, L]`` (clamping before rounding is
identical because the bounds are integers). Scales are returned in float32 or rounded once to
float16 (the cache's ``scale_dtype``). Symmetric specs are not implemented here.

Two layouts (``c`` = container bits, ``P = 8 // c`` codes per byte, little-endian in a byte:
element ``e`` at bits ``[e*c, (e+1)*c)``):

``quantize_pack_keys`` -- per-channel groups of ``G`` tokens, packed along **tokens**
    codes ``[B, H, ceil(T / P), D]``, scale/zero ``[B, H, ceil(T / G), D]``; a partial last group
    (``T mod G`` tokens) has its own scale from its own tokens, the last byte is padded with
    zero codes. ``G`` must be a multiple of ``P``.
    Grid ``(B*H, ceil(T / G), ceil(D / BLOCK_D))``: one program owns one token group of
    ``BLOCK_D`` channels, held as ``[G/P, P, BLOCK_D]`` so the byte of each ``(row, channel)``
    is a sum over the middle axis of ``code << e*c``.
``quantize_pack_values`` -- per-token groups of ``G`` channels, packed along **channels**
    codes ``[B, H, T, ceil(D / P)]``, scale/zero ``[B, H, T, D / G]``. ``G`` must divide ``D``
    and be a multiple of ``P``.
    Grid ``(B*H, ceil(T / BLOCK_T))``: one program owns ``BLOCK_T`` whole tokens, held as
    ``[BLOCK_T, D/G, G/P, P]``.

Memory traffic: reads ``x`` once (``2 or 4`` bytes/element), writes ``b/8`` bytes/element of
codes (container bits) and ``2 * scale bytes`` per group; no intermediate tensor. ``out=``
lets the cache write straight into a slice of its preallocated buffers (any strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlens.errors import InputError
from kvlens_kernels._common import (
    check_int,
    check_shape,
    check_tensor,
    codes_per_byte,
    container_bits,
    next_pow2,
    round_half_even,
    use_libdevice,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float16, torch.float32)


@triton.jit
def _asym_scale(lo, hi, LEVELS: tl.constexpr):
    """Zero point and clamped scale of asymmetric groups from their min/max, exactly as
    ``kvlens.quant.reference`` (true division; clamp at 1e-8 * absmax and float32 tiny)."""
    lo = tl.where(hi >= lo, lo, 0.0)  # rows with no valid element (masked off by the caller)
    hi = tl.where(hi >= lo, hi, 0.0)
    absmax = tl.maximum(tl.abs(lo), tl.abs(hi))
    scale = tl.math.div_rn(hi - lo, tl.full(lo.shape, LEVELS, tl.float32))
    scale = tl.maximum(scale, absmax * 1e-8)
    return lo, tl.maximum(scale, 1.1754943508222875e-38)


@triton.jit
def _quant_pack_keys_kernel(
    x_ptr,  # [B, H, T, D] float input
    codes_ptr,  # [B, H, ceil(T/P), D] uint8 output
    scale_ptr,  # [B, H, ceil(T/G), D] output (fp16/fp32)
    zero_ptr,  # same shape as scale
    H, T, D,  # sizes
    sxb, sxh, sxt, sxd,  # x strides
    scb, sch, sct, scd,  # codes strides
    ssb, ssh, sst, ssd,  # scale strides
    szb, szh, szt, szd,  # zero strides
    LEVELS: tl.constexpr,  # 2^bits - 1
    CBITS: tl.constexpr,  # container bits
    P: tl.constexpr,  # codes per byte
    G: tl.constexpr,  # tokens per group
    ROWS: tl.constexpr,  # next_pow2(G // P): byte rows per group (padded)
    BLOCK_D: tl.constexpr,  # channels per program
    USE_LIBDEVICE: tl.constexpr,  # rint via libdevice (compiled) or the 2^23 trick
):
    pid_bh = tl.program_id(0)
    grp = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    row = tl.arange(0, ROWS)[:, None, None]
    e = tl.arange(0, P)[None, :, None]
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)[None, None, :]
    t_in = row * P + e  # token inside the group
    t = grp * G + t_in
    valid = (t_in < G) & (t < T) & (d < D)
    x = tl.load(x_ptr + b * sxb + h * sxh + t * sxt + d * sxd, mask=valid, other=0.0)
    x = x.to(tl.float32)
    lo = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=1), axis=0)  # [BLOCK_D]
    hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=1), axis=0)
    lo, scale = _asym_scale(lo, hi, LEVELS)
    v = tl.math.div_rn(x - lo[None, None, :], tl.broadcast_to(scale[None, None, :], x.shape))
    v = tl.minimum(tl.maximum(v, 0.0), LEVELS * 1.0)
    code = round_half_even(v, USE_LIBDEVICE).to(tl.int32)
    code = tl.where(valid, code, 0)
    byte = tl.sum(code << (e * CBITS), axis=1)  # [ROWS, BLOCK_D]; bit fields never overlap
    brow = tl.arange(0, ROWS)[:, None]
    d2 = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    byte_row = grp * (G // P) + brow
    bmask = (brow < G // P) & (byte_row * P < T) & (d2 < D)
    tl.store(codes_ptr + b * scb + h * sch + byte_row * sct + d2 * scd, byte.to(tl.uint8),
             mask=bmask)
    d1 = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d1 < D
    tl.store(scale_ptr + b * ssb + h * ssh + grp * sst + d1 * ssd,
             scale.to(scale_ptr.dtype.element_ty), mask=dmask)
    tl.store(zero_ptr + b * szb + h * szh + grp * szt + d1 * szd,
             lo.to(zero_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _quant_pack_values_kernel(
    x_ptr,  # [B, H, T, D] float input
    codes_ptr,  # [B, H, T, ceil(D/P)] uint8 output
    scale_ptr,  # [B, H, T, D/G] output
    zero_ptr,  # same shape as scale
    H, T,  # sizes
    sxb, sxh, sxt, sxd,
    scb, sch, sct, scd,
    ssb, ssh, sst, ssd,
    szb, szh, szt, szd,
    LEVELS: tl.constexpr,
    CBITS: tl.constexpr,
    P: tl.constexpr,
    G: tl.constexpr,  # channels per group
    NG: tl.constexpr,  # groups per token, D // G
    NG_PAD: tl.constexpr,  # next_pow2(NG)
    GB_PAD: tl.constexpr,  # next_pow2(G // P): bytes per group (padded)
    BLOCK_T: tl.constexpr,  # tokens per program
    USE_LIBDEVICE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None, None]
    j = tl.arange(0, NG_PAD)[None, :, None, None]
    k = tl.arange(0, GB_PAD)[None, None, :, None]
    e = tl.arange(0, P)[None, None, None, :]
    ch = j * G + k * P + e
    valid = (t < T) & (j < NG) & (k < G // P)
    x = tl.load(x_ptr + b * sxb + h * sxh + t * sxt + ch * sxd, mask=valid, other=0.0)
    x = x.to(tl.float32)
    lo = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=3), axis=2)  # [BLOCK_T, NG_PAD]
    hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=3), axis=2)
    lo, scale = _asym_scale(lo, hi, LEVELS)
    v = tl.math.div_rn(x - lo[:, :, None, None],
                       tl.broadcast_to(scale[:, :, None, None], x.shape))
    v = tl.minimum(tl.maximum(v, 0.0), LEVELS * 1.0)
    code = round_half_even(v, USE_LIBDEVICE).to(tl.int32)
    code = tl.where(valid, code, 0)
    byte = tl.sum(code << (e * CBITS), axis=3)  # [BLOCK_T, NG_PAD, GB_PAD]
    t3 = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    j3 = tl.arange(0, NG_PAD)[None, :, None]
    k3 = tl.arange(0, GB_PAD)[None, None, :]
    bmask = (t3 < T) & (j3 < NG) & (k3 < G // P)
    tl.store(codes_ptr + b * scb + h * sch + t3 * sct + (j3 * (G // P) + k3) * scd,
             byte.to(tl.uint8), mask=bmask)
    t2 = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    j2 = tl.arange(0, NG_PAD)[None, :]
    pmask = (t2 < T) & (j2 < NG)
    tl.store(scale_ptr + b * ssb + h * ssh + t2 * sst + j2 * ssd,
             scale.to(scale_ptr.dtype.element_ty), mask=pmask)
    tl.store(zero_ptr + b * szb + h * szh + t2 * szt + j2 * szd,
             lo.to(zero_ptr.dtype.element_ty), mask=pmask)


# -- launchers ------------------------------------------------------------------------------------

def _check_common(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                  symmetric: bool) -> tuple[int, int]:
    check_tensor("x", x, 4, FLOAT_DTYPES)
    if x.shape[2] < 1 or x.shape[3] < 1:
        raise InputError(f"Cannot quantize an empty tensor of shape {list(x.shape)}.")
    if symmetric:
        raise InputError("The Triton quantize-and-pack kernels implement asymmetric specs only "
                         "(allowed: symmetric=False); use kvlens.quant for symmetric ones.")
    cbits = container_bits(bits)
    check_int("group_size", group_size, 1)
    per = 8 // cbits
    if group_size % per:
        raise InputError(f"group_size {group_size} must be a multiple of {per} ({bits}-bit codes "
                         f"are packed {per} per byte, and a byte never straddles two groups).")
    if scale_dtype not in SCALE_DTYPES:
        raise InputError(f"scale_dtype {scale_dtype} not supported; allowed: float16, float32.")
    return cbits, per


def _outputs(out, shapes, device, scale_dtype):
    if out is None:
        return (torch.empty(shapes[0], dtype=torch.uint8, device=device),
                torch.empty(shapes[1], dtype=scale_dtype, device=device),
                torch.empty(shapes[1], dtype=scale_dtype, device=device))
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise InputError("out must be a tuple (codes, scale, zero) of preallocated tensors.")
    codes, scale, zero = out
    for name, t, shape, dtypes in (("out codes", codes, shapes[0], (torch.uint8,)),
                                   ("out scale", scale, shapes[1], SCALE_DTYPES),
                                   ("out zero", zero, shapes[1], SCALE_DTYPES)):
        check_tensor(name, t, 4, dtypes, device)
        check_shape(name, t, shape)
    return codes, scale, zero


def quantize_pack_keys(x: torch.Tensor, bits: int, group_size: int, *,
                       scale_dtype: torch.dtype = torch.float16, symmetric: bool = False,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel (groups of ``group_size`` tokens) quantization of ``x`` ``[B, H, T, D]``,
    packed along tokens -> ``(codes [B, H, ceil(T/P), D] uint8, scale, zero [B, H, ceil(T/G),
    D])``. Reference: ``kvlens.quant.quantize(x, QuantSpec(bits, "per-channel", group_size))``
    then ``pack_codes(codes, bits, dim=2)``. ``out`` writes into preallocated tensors."""
    cbits, per = _check_common(x, bits, group_size, scale_dtype, symmetric)
    b, h, t, d = x.shape
    shapes = ((b, h, -(-t // per), d), (b, h, -(-t // group_size), d))
    codes, scale, zero = _outputs(out, shapes, x.device, scale_dtype)
    block_d = min(next_pow2(d), max(16, 4096 // next_pow2(group_size)))
    grid = (b * h, -(-t // group_size), triton.cdiv(d, block_d))
    _quant_pack_keys_kernel[grid](
        x, codes, scale, zero, h, t, d, *x.stride(), *codes.stride(), *scale.stride(),
        *zero.stride(), LEVELS=(1 << bits) - 1, CBITS=cbits, P=per, G=group_size,
        ROWS=next_pow2(group_size // per), BLOCK_D=block_d, USE_LIBDEVICE=use_libdevice(x))
    return codes, scale, zero


def quantize_pack_values(x: torch.Tensor, bits: int, group_size: int | None, *,
                         scale_dtype: torch.dtype = torch.float16, symmetric: bool = False,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (groups of ``group_size`` channels, ``None`` = all ``D``) quantization of ``x``
    ``[B, H, T, D]``, packed along channels -> ``(codes [B, H, T, ceil(D/P)] uint8, scale, zero
    [B, H, T, D/G])``. Reference: ``kvlens.quant.quantize(x, QuantSpec(bits, "per-token",
    group_size))`` then ``pack_codes(codes, bits, dim=3)``."""
    if group_size is None and isinstance(x, torch.Tensor) and x.dim() == 4:
        group_size = int(x.shape[3])
    cbits, per = _check_common(x, bits, group_size, scale_dtype, symmetric)
    b, h, t, d = x.shape
    if d % group_size:
        allowed = ", ".join(str(g) for g in range(per, d + 1, per) if d % g == 0)
        raise InputError(f"group_size {group_size} does not divide head_dim {d}; allowed: "
                         f"{allowed}.")
    ng = d // group_size
    shapes = ((b, h, t, -(-d // per)), (b, h, t, ng))
    codes, scale, zero = _outputs(out, shapes, x.device, scale_dtype)
    block_t = max(1, min(64, 8192 // (next_pow2(ng) * next_pow2(group_size))))
    grid = (b * h, triton.cdiv(t, block_t))
    _quant_pack_values_kernel[grid](
        x, codes, scale, zero, h, t, *x.stride(), *codes.stride(), *scale.stride(),
        *zero.stride(), LEVELS=(1 << bits) - 1, CBITS=cbits, P=per, G=group_size, NG=ng,
        NG_PAD=next_pow2(ng), GB_PAD=next_pow2(group_size // per), BLOCK_T=block_t,
        USE_LIBDEVICE=use_libdevice(x))
    return codes, scale, zero


__all__ = ["codes_per_byte", "quantize_pack_keys", "quantize_pack_values"]
