"""The packed storage layout of one compressed KV tensor: the *bytes*, which the fused decode
kernel reads exactly (semantics: ``kvlens.quant.reference``; bit packing: ``kvlens.quant.packing``).

``B`` batch, ``H`` KV heads, ``D`` head_dim, ``b`` bits, ``(U, W) = pack_unit(b)``, ``F`` the
flush block (tokens quantized together), ``(bt, bd) = spec.block_shape(F, D)`` one scale group.
Block ``i`` holds positions ``[i*F, (i+1)*F)`` after the layer's ``q_start``, never
re-quantized; the buffers hold exactly ``length`` tokens (a flush reallocates them with one
copy; ``drop_front`` drops whole blocks):

``codes`` (uint8)
    per-channel: ``[B, H, length // U * W, D]``, packed along **tokens** (bytes ``u*W ..
    u*W+W-1`` of channel ``d`` hold tokens ``u*U .. u*U+U-1``; ``F`` a multiple of ``U``);
    per-token and per-tensor: ``[B, H, length, packed_length(D, b)]``, along **channels**.
``scale``, ``zero`` (``scale_dtype``: float16, float32, or ``"8bit"`` codes decoded by ``params``)
    ``[B, H, (length // F) * ceil(F / bt), D // bd]``: per-channel ``[B, H, length // G, D]``,
    per-token ``[B, H, length, D // G]``, per-tensor ``[B, H, length // F, 1]``; ``x_hat = code *
    scale + zero`` (symmetric specs store ``zero = -qmax * scale``).

``dequantize_range`` equals ``dequantize`` of the reference ``QTensor`` with its metadata
rounded to ``scale_dtype`` (with ``"8bit"``: of ``quantize_meta8``'s; tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError
from kvlens.layouts.protocol import check_layout, layout_of
from kvlens.quant import (
    QTensor,
    QuantSpec,
    dequantize,
    pack_codes,
    pack_unit,
    packed_length,
    quantize,
    unpack_codes,
)
from kvlens.quant.meta8 import decode_group_meta, quantize_meta8, zero_unit

META8 = "8bit"
#: how each group's scale and zero are stored (a config's ``scale_dtype``) and their bytes each
SCALE_BYTES = {"float16": 2, "float32": 4, META8: 1}
SCALE_DTYPES = tuple(SCALE_BYTES)


@dataclass
class PackedTensor:
    """Packed low-bit history of one tensor, ``[B, H, length, D]`` logically (layout above)."""

    spec: QuantSpec
    block: int  # F
    head_dim: int
    scale_dtype: torch.dtype  # of ``scale`` (uint8 for "8bit")
    meta8: bool = False  # scale/zero are meta8 codes (uint8 / int8)
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    length: int = 0

    @classmethod
    def create(cls, spec: QuantSpec, residual_tokens: int, head_dim: int,
               scale_dtype: str = "float16", flush_tokens: int = 0) -> PackedTensor:
        check_layout(spec, residual_tokens, head_dim, flush_tokens=flush_tokens)
        if scale_dtype not in SCALE_DTYPES:
            raise ConfigError(f"Unknown scale dtype {scale_dtype!r}; allowed: "
                              f"{', '.join(SCALE_DTYPES)}.")
        meta8 = scale_dtype == META8
        return cls(spec, layout_of(spec).flush_block(residual_tokens, flush_tokens), head_dim,
                   torch.uint8 if meta8 else getattr(torch, scale_dtype), meta8)

    # -- geometry -----------------------------------------------------------------------------
    @property
    def packs_tokens(self) -> bool:
        return self.spec.granularity == "per-channel"

    @property
    def group_rows(self) -> tuple[int, int]:
        """``(nT, nD)``: scale rows per block and scale columns."""
        bt, bd = self.spec.block_shape(self.block, self.head_dim)
        return -(-self.block // bt), self.head_dim // bd

    @property
    def capacity(self) -> int:
        if self.codes is None:
            return 0
        if not self.packs_tokens:
            return self.codes.shape[2]
        u, w = pack_unit(self.spec.bits)
        return self.codes.shape[2] // w * u

    def _allocate(self, b: int, h: int, cap: int, device, keep_from: int = 0) -> None:
        """New buffers for ``cap`` tokens holding the stored tokens ``[keep_from, length)``."""
        d = self.head_dim
        shape = (b, h, self.code_rows(cap), d) if self.packs_tokens else \
            (b, h, cap, packed_length(d, self.spec.bits))
        n_t, n_d = self.group_rows
        codes = torch.zeros(shape, dtype=torch.uint8, device=device)
        scale = torch.zeros((b, h, cap // self.block * n_t, n_d), dtype=self.scale_dtype,
                            device=device)
        zero = torch.zeros_like(scale, dtype=torch.int8 if self.meta8 else None)
        if self.codes is not None and self.length > keep_from:  # one copy of what stays
            c0, c1 = self.code_rows(keep_from), self.code_rows(self.length)
            codes[:, :, :c1 - c0] = self.codes[:, :, c0:c1]
            r0, r1 = keep_from // self.block * n_t, self.length // self.block * n_t
            scale[:, :, :r1 - r0] = self.scale[:, :, r0:r1]
            zero[:, :, :r1 - r0] = self.zero[:, :, r0:r1]
        self.codes, self.scale, self.zero = codes, scale, zero

    def code_rows(self, tokens: int) -> int:
        """Rows of ``codes`` holding the first ``tokens`` tokens (a multiple of ``U`` for a
        token-packed store)."""
        if not self.packs_tokens:
            return tokens
        u, w = pack_unit(self.spec.bits)
        return tokens // u * w

    # -- write --------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Quantize ``x`` ``[B, H, n*F, D]`` block by block (reference ``quantize``) and append
        (the buffers grow to exactly the new length)."""
        b, h, t, d = x.shape
        f = self.block
        if t % f:
            raise ValueError(f"append needs a multiple of {f} tokens, got {t}")
        if t == 0:
            return
        need = self.length + t
        if need > self.capacity:
            self._allocate(b, h, need, x.device)
        n = t // f
        # Each block is one "batch" row for the reference, so groups never cross blocks.
        blocks = x.reshape(b, h, n, f, d).transpose(1, 2).reshape(b * n, h, f, d)
        if self.meta8:
            q, e, z = quantize_meta8(blocks, self.spec)
        else:
            q = quantize(blocks, self.spec)
            e, z = q.scale.to(self.scale_dtype), q.zero.to(self.scale_dtype)
        pdim = 2 if self.packs_tokens else 3
        packed = pack_codes(q.codes, self.spec.bits, dim=pdim)
        packed = packed.reshape(b, n, h, *packed.shape[2:]).transpose(1, 2)
        packed = packed.reshape(b, h, -1, packed.shape[-1])
        r0, r1 = self.code_rows(self.length), self.code_rows(need)
        self.codes[:, :, r0:r1] = packed
        n_t, _ = self.group_rows
        s0 = self.length // f * n_t
        for src, dst in ((e, self.scale), (z, self.zero)):
            rows = src.reshape(b, n, h, n_t, -1).transpose(1, 2).reshape(b, h, n * n_t, -1)
            dst[:, :, s0:s0 + n * n_t] = rows
        self.length = need

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks; a sliding-window layer's expired
        history): the buffers shrink to what stays."""
        if n % self.block or n > self.length:
            raise ValueError(f"drop_front needs whole blocks of {self.block} tokens within the "
                             f"{self.length} stored, got {n}")
        if n == 0:
            return
        b, h = self.codes.shape[:2]
        self._allocate(b, h, self.length - n, self.codes.device, keep_from=n)
        self.length -= n

    # -- read ---------------------------------------------------------------------------------
    def code_bytes(self, t0: int, t1: int) -> torch.Tensor:
        """The stored code bytes of tokens ``[t0, t1)`` (whole packing units when packed along
        tokens), a view: ``[B, H, code_rows(t1) - code_rows(t0), ...]``."""
        return self.codes[:, :, self.code_rows(t0):self.code_rows(t1)]

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` (multiples of ``F``) as float32 ``[B, H, t1 - t0, D]``, through
        the reference ``dequantize`` (only this slice is materialised)."""
        f = self.block
        b, h = self.codes.shape[:2]
        n = (t1 - t0) // f
        d = self.head_dim
        n_t, _ = self.group_rows
        rows = self.code_bytes(t0, t1)
        rows = rows.reshape(b, h, n, -1, rows.shape[-1]).transpose(1, 2)
        rows = rows.reshape(b * n, h, *rows.shape[3:])
        pdim = 2 if self.packs_tokens else 3
        codes = unpack_codes(rows, self.spec.bits, f if self.packs_tokens else d, dim=pdim)

        def blocks(p: torch.Tensor) -> torch.Tensor:
            p = p.float()
            return p.reshape(b, h, n, n_t, -1).transpose(1, 2).reshape(b * n, h, n_t, -1)

        scale, zero = self.params(slice(t0 // f * n_t, t1 // f * n_t))
        q = QTensor(codes, blocks(scale), blocks(zero), self.spec, (b * n, h, f, d))
        out = dequantize(q)
        return out.reshape(b, n, h, f, d).transpose(1, 2).reshape(b, h, n * f, d)

    @property
    def zero_unit(self) -> float | None:
        """8-bit metadata: the zero codes' unit in quantization steps (what the Triton kernel
        takes to decode the stored bytes); None for float metadata."""
        return zero_unit(self.spec.bits) if self.meta8 else None

    def params(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero)`` of scale rows ``rows``: the stored tensors (float16/float32 views,
        no copy), or for ``"8bit"`` their float32 decoding (a transient copy of those rows; the
        Triton kernel reads the bytes instead)."""
        scale, zero = self.scale[:, :, rows], self.zero[:, :, rows]
        if self.meta8:
            return decode_group_meta(scale, zero, self.spec.bits)
        return scale, zero

    # -- accounting ---------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers by ``kvlens.cache.layout`` part name."""
        if self.codes is None:
            return {}
        return {"codes": self.codes, "scales": self.scale, "zeros": self.zero}

    def select_batch(self, index: torch.Tensor) -> None:
        if self.codes is not None:
            self.codes, self.scale, self.zero = (t[index] for t in
                                                 (self.codes, self.scale, self.zero))
