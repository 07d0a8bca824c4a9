"""MiKV's mixed precision: the importance set (heavy hitters and sinks) at a chosen bit width.

With ``mikv.set_bits`` = 4 or 8 the layer stores each set token's key and value as per-token
integer codes (reference quantizer, ``set_spec``: asymmetric, groups of 32 channels, or the
whole head when 32 does not divide ``head_dim``), packed along channels, with float16 scale and
zero per group; ``None`` keeps the set at the config's ``fp_dtype`` as before. Per-token codes
belong to one token each, so re-choosing the set at a flush only gathers rows: no token is
re-quantized, and the low-bit copies in the packed store stay as they are (masked at attention).

Bytes per set token and tensor: ``packed_length(D, bits)`` code bytes (``D * bits / 8`` for
the set widths 4 and 8) plus ``2 * 2 * D / G`` scale and zero bytes (``set_bytes_per_token``;
the parts ``sets`` in ``kvlens.cache.layout``).
"""

from __future__ import annotations

import torch

from kvlens.quant import (
    QTensor,
    QuantSpec,
    dequantize,
    pack_codes,
    packed_length,
    quantize,
    unpack_codes,
)

SET_GROUP = 32
SCALE_DTYPE = torch.float16


def set_spec(bits: int, head_dim: int) -> QuantSpec:
    """How a set token is quantized: per-token, groups of 32 channels (or the head)."""
    return QuantSpec(bits, "per-token", SET_GROUP if head_dim % SET_GROUP == 0 else None)


def set_bytes_per_token(bits: int, head_dim: int) -> int:
    """Bytes one token of one tensor (key or value) of the set holds at ``bits``."""
    spec = set_spec(bits, head_dim)
    groups = head_dim // (spec.group_size or head_dim)
    return packed_length(head_dim, bits) + 2 * groups * SCALE_DTYPE.itemsize


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[B, H, K, D]`` -> ``(codes uint8 [B, H, K, ceil(D/P)], scale, zero float16
    [B, H, K, D/G])``: each row quantized on its own (so rows can be gathered later)."""
    q = quantize(x.float(), set_spec(bits, x.shape[-1]))
    return pack_codes(q.codes, bits, dim=3), q.scale.to(SCALE_DTYPE), q.zero.to(SCALE_DTYPE)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    head_dim: int) -> torch.Tensor:
    """Inverse of ``quantize_rows`` -> float32 ``[B, H, K, D]`` (the set is small: at most
    ``heavy_fraction`` of the tokens plus the sinks)."""
    spec = set_spec(bits, head_dim)
    c = unpack_codes(codes, bits, head_dim, dim=3)
    shape = (*c.shape[:3], head_dim)
    return dequantize(QTensor(c, scale.float(), zero.float(), spec, shape))


def _gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, k]]``; float8 rows are gathered as their bytes (torch has no CPU
    gather for float8)."""
    index = idx[..., None].expand(*idx.shape, t.shape[-1])
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).gather(2, index).view(t.dtype)
    return t.gather(2, index)


class SetRows:
    """One tensor (keys or values) of the importance set: rows ``[B, H, K, *]`` at ``bits``
    (``None``: plain ``dtype`` rows)."""

    def __init__(self, bits: int | None, dtype: torch.dtype | None, head_dim: int):
        self.bits = bits
        self.dtype = dtype
        self.head_dim = head_dim
        self.parts: tuple[torch.Tensor, ...] = ()  # (rows,) or (codes, scale, zero)

    @property
    def empty(self) -> bool:
        return not self.parts

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New rows ``x`` ``[B, H, n, D]`` in the stored form."""
        if self.bits is None:
            return (x.to(self.dtype or x.dtype),)
        return quantize_rows(x, self.bits)

    def choose(self, candidates: tuple[torch.Tensor, ...], idx: torch.Tensor) -> None:
        """Keep rows ``idx`` ``[B, H, K]`` of ``candidates`` (stored form, ``[B, H, C, *]``)."""
        self.parts = tuple(_gather_rows(t, idx) for t in candidates)

    def candidates(self, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The current rows followed by ``new`` ``[B, H, n, D]``, stored form."""
        enc = self.encode(new)
        if self.empty:
            return enc
        return tuple(torch.cat((a, b.to(a.dtype)), dim=2) for a, b in zip(self.parts, enc))

    def read(self) -> torch.Tensor:
        """float32 ``[B, H, K, D]`` (a transient for attention)."""
        if self.bits is None:
            return self.parts[0].float()
        return dequantize_rows(*self.parts, self.bits, self.head_dim)

    def select_batch(self, index: torch.Tensor) -> None:
        self.parts = tuple(t[index] for t in self.parts)
