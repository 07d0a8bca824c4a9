"""A codebook-coded key store and its torch read path (vLLM TurboQuant's keys).

``CodebookStore`` holds one layer's keys as ``kvlens.quant.codebook`` codes them. In the cache
the layer rotates (window and store hold ``k R``, the query is rotated once), so the store
codes with ``rotation=None`` (``Codebooked.new_store``), and ``key_scores`` applies each vector's
scale ``n / sqrt(D)`` (renormalised: ``n / ||c||``) to its score: ``s_t * ((q R) · c[code_t])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvlens.errors import InputError
from kvlens.layouts.protocol import SpecLayout, TensorStore, register
from kvlens.quant.codebook import (
    NORM_BYTES,
    Codebook,
    CodebookSpec,
    CodebookTensor,
    computed_codebook,
    dequantize_codebook,
    fake_quantize_codebook,
    quantize_codebook,
)
from kvlens.quant.packing import packed_length, unpack_codes


class CodebookStore(TensorStore):
    """One tensor of one layer coded with ``spec`` and ``codebook``: packed uint8 ``[B, H, N,
    packed_length(D, bits)]``, norms float16 ``[B, H, N]``; ``block``: tokens flushed together."""

    BUFFERS = {"packed": "codes", "norms": "norms"}

    def __init__(self, spec: CodebookSpec, codebook: Codebook, head_dim: int, block: int = 1):
        if codebook.bits != spec.bits:
            raise InputError(f"A {codebook.bits}-bit codebook cannot code a {spec.bits}-bit spec.")
        self.spec = spec
        self.head_dim = head_dim
        self.block = block
        self.codebook = codebook  # computed, not held
        self.packed: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        """Code ``x`` ``[B, H, t, D]`` (original basis) and append it along tokens."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise InputError(f"Expected [B, H, t, {self.head_dim}], got {tuple(x.shape)}.")
        if x.shape[2] == 0:
            return
        qt = quantize_codebook(x, self.spec, self.codebook)
        self.extend(qt.packed(), qt.norms)

    # -- the cache's store interface (kvlens.cache.layer) --------------------------------------
    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks; a sliding layer's expired history)."""
        if n % self.block or n > self.length:
            raise ValueError(f"drop_front needs whole blocks of {self.block} tokens within the "
                             f"{self.length} stored, got {n}")
        super().drop_front(n)

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` as float32 ``[B, H, t1 - t0, D]`` in the coded basis (the
        reference decode; only this slice is materialised)."""
        qt = CodebookTensor.from_packed(self.packed[:, :, t0:t1], self.norms[:, :, t0:t1],
                                        self.codebook, self.spec, self.head_dim)
        return dequantize_codebook(qt)

    def key_scores(self, q: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Queries ``q`` ``[B, H, M, D]`` (rotated basis, scaling folded in) against the coded keys
        ``[t0, t1)``: ``s_t * (q . c[code_t])`` ``[B, H, M, t1 - t0]``, no dequantized key
        (``c``: the centroids of the codes ``[B, H, C, D]``, ``s`` each vector's scale)."""
        codes = unpack_codes(self.packed[:, :, t0:t1], self.spec.bits, self.head_dim, dim=-1)
        c = self.codebook.decode(codes)
        if self.spec.renormalize:
            inv = 1.0 / c.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        else:
            inv = torch.full(c.shape[:-1], 1.0 / math.sqrt(self.head_dim), device=c.device)
        sk = self.norms[:, :, t0:t1].float() * inv
        return torch.matmul(q, c.transpose(-1, -2)).mul_(sk[:, :, None, :])


@dataclass(frozen=True)
class Codebooked(SpecLayout):
    """``CodebookSpec`` ``spec`` as a ``kvlens.layouts.Layout``: each vector on its own, so it
    streams as a per-token spec and fits any window; its reference includes the spec's rotation."""

    spec: CodebookSpec
    kind = "codebook"

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        return flush_tokens or residual_tokens or 1

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        """Any window and head fit (its rotation is checked with the layer's, by
        ``kvlens.config.model_check``)."""

    def reconstruct(self, x, block: int, scale_dtype: str = "float16"):
        return fake_quantize_codebook(x, self.spec)

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16"):
        """Codes the layer's (already rotated) vectors: the spec less its rotation."""
        return CodebookStore(replace(self.spec, rotation=None),
                             computed_codebook(self.spec, head_dim), head_dim, block)

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        """Codes packed along channels and a float16 norm per vector (the codebook is computed,
        not held)."""
        return {"codes": tokens * packed_length(head_dim, self.spec.bits),
                "norms": tokens * NORM_BYTES}


register(CodebookSpec, Codebooked.kind, CodebookSpec.from_dict, Codebooked)
