"""A codebook-coded K or V store and its torch read path (phase 1 of issue 36: standalone, not
yet a ``KVConfig`` layout).

``CodebookStore`` holds one tensor (keys or values) of one layer, ``[B, H, N, D]`` tokens, in the
layout of ``kvlens.quant.codebook``: per vector its codes in the rotated basis, densely packed
along ``D`` (``packed_length(D, bits)`` uint8 per token and head), one float16 norm, and the
layer's codebook (``2^bits`` float16 centroids when fitted; a Lloyd-Max codebook is recomputed
from ``bits`` and ``D`` and holds no bytes). ``held_bytes()`` counts the tensors the store really
holds; ``CodebookSpec.held_bytes`` predicts them (tested equal).

``codebook_attention(query, keys, values, scaling)`` attends ``query`` ``[B, Hq, Tq, D]`` to the
stores chunk by chunk (``chunk_tokens``) with an online softmax, without materialising the
dequantized history:

- the rotation folds into the query once, ``q R`` (``(q R) · (k R) = q · k``), and each vector's
  scale ``n / sqrt(D)`` (renormalised: ``n / ||c||``) multiplies its score instead of its codes:
  ``score_t = s_t * ((q R) · c[code_t])``;
- values: the scale folds into the softmax weights, ``o = (sum_t (p_t s_t) c[code_t]) Rᵀ``,
  un-rotated once per query instead of once per cached value.

One chunk's centroid lookup (``[B, H, C, D]`` float32) is the only chunk-sized float tensor.
Same math as dequantizing with ``kvlens.quant.codebook`` and attending, different rounding
(tested to 1e-5). GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``; the mask is causal,
bottom-right aligned (the last query sits at the last key).
"""

from __future__ import annotations

import math

import torch

from kvlens.errors import InputError
from kvlens.quant.codebook import (
    CENTROID_BYTES,
    Codebook,
    CodebookSpec,
    CodebookTensor,
    dequantize_codebook,
    quantize_codebook,
)
from kvlens.quant.packing import unpack_codes
from kvlens.quant.rotation import rotate, unrotate

CHUNK_TOKENS = 1024


class CodebookStore:
    """One tensor of one layer coded with ``spec`` and ``codebook`` (module docstring).

    packed: uint8 ``[B, H, N, packed_length(D, bits)]``; norms: float16 ``[B, H, N]``."""

    def __init__(self, spec: CodebookSpec, codebook: Codebook, head_dim: int):
        if codebook.bits != spec.bits:
            raise InputError(f"A {codebook.bits}-bit codebook cannot code a {spec.bits}-bit spec.")
        self.spec = spec
        self.head_dim = head_dim
        # stored as float16 when fitted (what is counted); the decode uses the same values
        self.centroids = codebook.centroids.half() if spec.fitted else codebook.centroids
        self.codebook = Codebook(self.centroids.float())
        self.packed: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.norms is None else self.norms.shape[2]

    def append(self, x: torch.Tensor) -> None:
        """Code ``x`` ``[B, H, t, D]`` (original basis) and append it along tokens."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise InputError(f"Expected [B, H, t, {self.head_dim}], got {tuple(x.shape)}.")
        qt = quantize_codebook(x, self.spec, self.codebook)
        packed = qt.packed()
        if self.packed is None:
            self.packed, self.norms = packed, qt.norms
        else:
            self.packed = torch.cat((self.packed, packed), dim=2)
            self.norms = torch.cat((self.norms, qt.norms), dim=2)

    def held_bytes(self) -> int:
        """Bytes of the tensors held: packed codes, norms and (fitted) float16 centroids."""
        if self.packed is None:
            return 0
        held = sum(t.numel() * t.element_size() for t in (self.packed, self.norms))
        return held + (self.centroids.numel() * CENTROID_BYTES if self.spec.fitted else 0)

    def reported_bytes(self) -> int:
        """``CodebookSpec.held_bytes`` for what the store holds (one codebook)."""
        if self.packed is None:
            return 0
        b, h, n, _ = self.packed.shape
        return self.spec.held_bytes(b * h * n, self.head_dim, codebooks=1)

    def dequantize(self) -> torch.Tensor:
        """The reference read (``kvlens.quant.codebook.dequantize_codebook``), ``[B, H, N, D]``."""
        qt = CodebookTensor.from_packed(self.packed, self.norms, self.codebook, self.spec,
                                        self.head_dim)
        return dequantize_codebook(qt)

    # -- folded reads --------------------------------------------------------------------------
    def chunk(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, s)`` for tokens ``[t0, t1)``: centroids of the codes ``[B, H, C, D]`` float32
        (rotated basis) and each vector's scale ``s`` ``[B, H, C]`` (``y_hat = s * c``)."""
        codes = unpack_codes(self.packed[:, :, t0:t1], self.spec.bits, self.head_dim, dim=-1)
        c = self.codebook.decode(codes)
        if self.spec.renormalize:
            inv = 1.0 / c.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        else:
            inv = torch.full(c.shape[:-1], 1.0 / math.sqrt(self.head_dim), device=c.device)
        return c, self.norms[:, :, t0:t1].float() * inv


def _rotation(store: CodebookStore, device) -> torch.Tensor | None:
    r = store.spec.rotation
    return None if r is None else r.matrix(store.head_dim, device)


def codebook_attention(query: torch.Tensor, keys: CodebookStore, values: CodebookStore,
                       scaling: float, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """``softmax(causal(q kᵀ * scaling)) v`` over the coded stores, ``[B, Hq, Tq, D]`` float32
    (module docstring). ``Tq <= N``; the queries are the last ``Tq`` positions."""
    b, hq, tq, d = query.shape
    n = keys.length
    if values.length != n or n == 0:
        raise InputError(f"Keys hold {n} tokens and values {values.length}; need the same, > 0.")
    hkv = keys.packed.shape[1]
    if hq % hkv or tq > n or d != keys.head_dim:
        raise InputError(f"Query {tuple(query.shape)} does not fit {hkv} KV heads, {n} tokens, "
                         f"head_dim {keys.head_dim}.")
    g = hq // hkv
    rk = _rotation(keys, query.device)
    q = query.float() if rk is None else rotate(query, rk)
    q = (q * scaling).reshape(b, hkv, g * tq, d)
    qpos = torch.arange(n - tq, n, device=query.device).repeat(g)  # [g*Tq], head-major
    run_max = torch.full((b, hkv, g * tq), float("-inf"), device=query.device)
    run_sum = torch.zeros_like(run_max)
    acc = torch.zeros(b, hkv, g * tq, d, device=query.device)
    for t0 in range(0, n, chunk_tokens):
        t1 = min(n, t0 + chunk_tokens)
        ck, sk = keys.chunk(t0, t1)
        scores = (q @ ck.transpose(-1, -2)) * sk[:, :, None, :]  # [B, Hkv, g*Tq, C]
        visible = torch.arange(t0, t1, device=query.device)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(dim=-1))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(scores - safe[..., None])
        fade = torch.exp(torch.where(torch.isinf(run_max), torch.full_like(run_max, -1e30),
                                     run_max - safe))
        cv, sv = values.chunk(t0, t1)
        acc = acc * fade[..., None] + (p * sv[:, :, None, :]) @ cv
        run_sum = run_sum * fade + p.sum(dim=-1)
        run_max = new_max
    out = acc / run_sum[..., None]
    rv = _rotation(values, query.device)
    out = out if rv is None else unrotate(out, rv)
    return out.reshape(b, hkv * g, tq, d)
