"""llama.cpp's KV-cache types (``-ctk/-ctv``): ggml blocks of 32 consecutive channels of one
token, the one place their quantize/dequantize semantics and byte layout live (plain torch;
tensors ``[B, H, T, D]``; each type's block layout: docs/engine-formats.md).

Quantization reproduces the ``gguf`` package's numpy quantizers (``gguf.quants``) bit for bit,
and iq4_nl llama.cpp's CUDA ``set_rows`` (``quantize_ggml``). ``GGMLBlocks.to_bytes`` writes
the ggml bytes: ``[d f16]``; ``[m f16]`` for the ``_1`` types; ``[qh 4 B]`` for 5 bits (bit 4 of
the 32 codes, little-endian, bit ``j`` = element ``j``); then the codes (q8_0: int8 bytes;
nibbles: the low one element ``j``, the high one ``j + 16``). Values: q8_0 ``q d``, q4_0/q5_0
``(q - 2^(b-1)) d``, q4_1/q5_1 ``q d + m``, iq4_nl ``IQ4_NL_VALUES[q] d``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError
from kvlens.quant.reference import check_tensor

GGML_BLOCK_SIZE = 32
# the iq4_nl code book (ggml-common.h kvalues_iq4nl; gguf.quants.IQ4_NL.kvalues)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class GGMLBlockFormat:
    """A llama.cpp cache type: ``block_size`` consecutive channels of one token share an fp16
    scale ``d`` (and, ``has_min``: an fp16 minimum ``m``, codes ``0..2^b-1``, ``x = q d + m``;
    otherwise zero-centred codes). nonlinear: iq4_nl's table ``IQ4_NL_VALUES``."""

    name: str
    code_bits: int
    has_min: bool = False
    nonlinear: bool = False
    block_size: int = GGML_BLOCK_SIZE

    family = "ggml"

    @property
    def block_bytes(self) -> int:
        return 2 + (2 if self.has_min else 0) + self.block_size * self.code_bits // 8

    @property
    def shares_scale(self) -> str:
        return f"{self.block_size} consecutive channels of one token (fp16 d" + (
            ", fp16 m)" if self.has_min else ")"
        )

    def bits_per_element(self, shape: Sequence[int] | None = None) -> float:
        """Storage bits per cached element from the block layout (independent of ``shape``)."""
        return self.block_bytes * 8 / self.block_size

    def check_fits(self, shape: Sequence[int]) -> None:
        d = int(shape[-1])
        if d % self.block_size:
            raise ConfigError(
                f"{self.name} needs head_dim divisible by its block size {self.block_size}, got "
                f"head_dim {d}; llama.cpp refuses such a quantized cache (allowed head_dim: "
                f"multiples of {self.block_size})."
            )


GGML_FORMATS = {
    "q8_0": GGMLBlockFormat("q8_0", 8),
    "q4_0": GGMLBlockFormat("q4_0", 4),
    "q4_1": GGMLBlockFormat("q4_1", 4, has_min=True),
    "q5_0": GGMLBlockFormat("q5_0", 5),
    "q5_1": GGMLBlockFormat("q5_1", 5, has_min=True),
    "iq4_nl": GGMLBlockFormat("iq4_nl", 4, nonlinear=True),
}


@dataclass(frozen=True)
class GGMLBlocks:
    """A ``[B, H, T, D]`` tensor in ggml blocks.

    codes: uint8 ``[B, H, T, D // 32, 32]``, one code per element as ggml stores it unpacked
        (q8_0: the int8 code's two's-complement byte; q4_0/q5_0: ``q`` with the offset 8/16
        added; iq4_nl: the table index).
    d: float16 ``[B, H, T, D // 32]``. m: float16 like ``d`` for q4_1/q5_1, else None."""

    format: GGMLBlockFormat
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def to_bytes(self) -> torch.Tensor:
        """uint8 ``[B, H, T, D // 32 * block_bytes]``: the exact ggml block bytes per token
        (what ``gguf.quants.quantize`` returns for rows of length ``D``)."""
        fmt, q = self.format, self.codes
        parts = [_f16_bytes(self.d)]
        if fmt.has_min:
            parts.append(_f16_bytes(self.m))
        if fmt.code_bits == 8:
            parts.append(q)
        else:
            half = fmt.block_size // 2
            if fmt.code_bits == 5:
                bit4 = ((q >> 4) & 1).to(torch.int64)
                weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
                qh = (bit4.reshape(*q.shape[:-1], 4, 8) * weights).sum(-1).to(torch.uint8)
                parts.append(qh)
            parts.append((q[..., :half] & 0x0F) | ((q[..., half:] & 0x0F) << 4))
        blocks = torch.cat(parts, dim=-1)
        return blocks.reshape(*blocks.shape[:-2], -1)

    @classmethod
    def from_bytes(cls, data: torch.Tensor, fmt: GGMLBlockFormat, head_dim: int) -> GGMLBlocks:
        """Inverse of ``to_bytes`` for uint8 ``[..., D // 32 * block_bytes]``."""
        nb = head_dim // fmt.block_size
        blocks = data.reshape(*data.shape[:-1], nb, fmt.block_bytes)
        d = _f16_from_bytes(blocks[..., 0:2])
        pos = 2
        m = None
        if fmt.has_min:
            m = _f16_from_bytes(blocks[..., 2:4])
            pos = 4
        if fmt.code_bits == 8:
            codes = blocks[..., pos:].clone()
        else:
            qh = None
            if fmt.code_bits == 5:
                qh = blocks[..., pos : pos + 4]
                pos += 4
            qs = blocks[..., pos:]
            codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
            if qh is not None:
                shifts = torch.arange(8, dtype=torch.uint8)
                bits = ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], 32)
                codes = codes | (bits << 4)
        return cls(fmt, codes, d, m)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 ``[...]`` -> uint8 ``[..., 2]`` little-endian."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _f16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def _blocks(x: torch.Tensor, fmt: GGMLBlockFormat) -> torch.Tensor:
    check_tensor(x)
    fmt.check_fits(x.shape)
    b, h, t, d = x.shape
    return x.detach().float().reshape(b, h, t, d // fmt.block_size, fmt.block_size)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``where(d == 0, 0, 1 / d)`` in float32, as ggml and gguf compute ``id``."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / safe)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``, written as ``gguf.quants.np_roundf`` does (exact in float32)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude per block, with its sign (first one on ties)."""
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(blocks, -1, idx)


def quantize_ggml(x: torch.Tensor, fmt: GGMLBlockFormat) -> GGMLBlocks:
    """Quantize ``x`` ``[B, H, T, D]`` into ggml blocks of 32 channels per token.

    q8_0 ... q5_1 follow ``gguf.quants`` (float32 arithmetic in its order, its rounding, fp16
    scales), byte for byte. iq4_nl follows llama.cpp's CUDA writer ``quantize_f32_iq4_nl_block``:
    nearest table entry at ``d0 = signed_absmax / -127``, then ``d = sum(w q x) / sum(w q^2)``,
    ``w = x^2`` (``d0`` when the sum is 0); the CPU writer searches more scales."""
    blocks = _blocks(x, fmt)
    m = None
    if fmt.name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(d))
        codes = q.to(torch.int8).view(torch.uint8)
    elif fmt.nonlinear:
        return _quantize_iq4_nl(blocks, fmt)
    elif not fmt.has_min:
        offset = 1 << (fmt.code_bits - 1)  # 8 (q4_0) or 16 (q5_0)
        d = _signed_absmax(blocks) / -offset
        v = torch.trunc(blocks * _inverse(d) + (offset + 0.5))
        codes = v.clamp(0, 2 * offset - 1).to(torch.uint8)
    else:
        levels = (1 << fmt.code_bits) - 1
        hi = blocks.amax(dim=-1, keepdim=True)
        lo = blocks.amin(dim=-1, keepdim=True)
        d = (hi - lo) / levels
        v = torch.trunc((blocks - lo) * _inverse(d) + 0.5)
        codes = v.clamp(0, levels).to(torch.uint8)
        m = lo[..., 0].to(torch.float16)
    return GGMLBlocks(fmt, codes, d[..., 0].to(torch.float16), m)


def _iq4_nearest(al: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml ``best_index_int8``: the nearest table entry, the upper one on an exact tie."""
    mu = torch.searchsorted(values, al.contiguous(), right=True).clamp(1, len(values) - 1)
    lower = values[mu - 1]
    upper = values[mu]
    return torch.where(al - lower < upper - al, mu - 1, mu)


def _quantize_iq4_nl(blocks: torch.Tensor, fmt: GGMLBlockFormat) -> GGMLBlocks:
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    d0 = _signed_absmax(blocks) / IQ4_NL_VALUES[0]
    idx = _iq4_nearest(blocks * _inverse(d0), values)
    q = values[idx].double()
    x = blocks.double()
    w = x * x
    sumqx = (w * q * x).sum(-1, keepdim=True)
    sumq2 = (w * q * q).sum(-1, keepdim=True)
    refit = (sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2))).float()
    d = torch.where(sumq2 > 0, refit, d0)
    return GGMLBlocks(fmt, idx.to(torch.uint8), d[..., 0].to(torch.float16), None)


def dequantize_ggml(blocks: GGMLBlocks) -> torch.Tensor:
    """ggml blocks -> float32 ``[B, H, T, D]`` (as ``gguf.quants.dequantize`` computes:
    ``d * q`` or ``d * q + m`` in float32 with the fp16 ``d``, ``m``)."""
    fmt, c = blocks.format, blocks.codes
    d = blocks.d.float()[..., None]
    if fmt.name == "q8_0":
        q = c.view(torch.int8).float()
    elif fmt.nonlinear:
        q = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[c.long()]
    elif fmt.has_min:
        out = d * c.float() + blocks.m.float()[..., None]
        return out.reshape(*out.shape[:-2], -1)
    else:
        q = c.float() - (1 << (fmt.code_bits - 1))
    out = d * q
    return out.reshape(*out.shape[:-2], -1)
