"""A codebook-coded K or V store and its torch read path.

``CodebookStore`` holds one tensor (keys or values) of one layer, ``[B, H, N, D]`` tokens, in the
layout of ``kvlens.quant.codebook``: per vector its codes in the rotated basis, densely packed
along ``D`` (``packed_length(D, bits)`` uint8 per token and head), one float16 norm, and the
layer's codebook (``2^bits`` float16 centroids when fitted; a Lloyd-Max codebook is recomputed
from ``bits`` and ``D`` and holds no bytes). ``held_bytes()`` counts the tensors the store really
holds; ``CodebookSpec.held_bytes`` predicts them (tested equal).

In the compressed cache (``kvlens.cache.layer``, a ``KVConfig`` key or value spec) the store is
the layer's key or value history: it has the ``PackedTensor`` interface the layer streams through
(``block``, ``append``, ``drop_front``, ``dequantize_range``, ``named_tensors`` by
``kvlens.cache.layout`` part: ``codes``, ``norms``, ``codebooks``) and ``value_out`` for the
torch read path (``kvlens.cache.torch_read``), which merges it with the exact window and sinks
by the same online softmax as every layout, and ``key_scores`` for keys. There the layer rotates
(the codebook's rotation is the layer's value or key rotation: window, sets and store all hold
``v R`` / ``k R``; the output is un-rotated once, the query rotated once), so the store codes
the already rotated vectors with ``rotation=None`` (``for_cache``). Centred keys
(``LayerKV.center_keys``) reach the store already centred, ``k R - mu R``: the store codes their
direction and norm like any vector, and the layer adds ``q · mu`` to ``key_scores``
(``CompressedLayer.key_score_shift``), as for uniform keys.

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
from dataclasses import replace

import torch

from kvlens.errors import InputError
from kvlens.quant.codebook import (
    CENTROID_BYTES,
    Codebook,
    CodebookSpec,
    CodebookTensor,
    computed_codebook,
    dequantize_codebook,
    quantize_codebook,
)
from kvlens.quant.packing import unpack_codes
from kvlens.quant.rotation import rotate, unrotate

CHUNK_TOKENS = 1024


class CodebookStore:
    """One tensor of one layer coded with ``spec`` and ``codebook`` (module docstring).

    packed: uint8 ``[B, H, N, packed_length(D, bits)]``; norms: float16 ``[B, H, N]``;
    centroids: float16 ``[2^bits]`` when fitted (a Lloyd-Max codebook holds nothing: it is
    recomputed, cached per process, from ``bits`` and ``D``). ``block``: tokens the cache
    flushes together (``drop_front`` drops whole blocks)."""

    def __init__(self, spec: CodebookSpec, codebook: Codebook, head_dim: int, block: int = 1):
        if codebook.bits != spec.bits:
            raise InputError(f"A {codebook.bits}-bit codebook cannot code a {spec.bits}-bit spec.")
        self.spec = spec
        self.head_dim = head_dim
        self.block = block
        # stored as float16 when fitted (what is counted); the decode uses the same values
        self.centroids = codebook.centroids.half() if spec.fitted else None
        self._computed = None if spec.fitted else codebook  # Lloyd-Max: computed, not held
        self.packed: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None

    @classmethod
    def for_cache(cls, spec: CodebookSpec, centroids, head_dim: int, block: int,
                  device=None) -> CodebookStore:
        """The key or value store of a cache layer: codes the layer's (already rotated) vectors with
        ``spec`` less its rotation; ``centroids`` (fitted: the config's ``codebooks`` entry)
        or the computed codebook for ``head_dim`` (``computed_codebook``)."""
        if spec.fitted:
            if centroids is None:
                raise InputError(f"A fitted {spec.bits}-bit codebook needs its centroids.")
            book = Codebook(torch.as_tensor(centroids, dtype=torch.float32, device=device))
        else:
            book = computed_codebook(spec, head_dim)
        return cls(replace(spec, rotation=None), book, head_dim, block)

    @property
    def codebook(self) -> Codebook:
        """The codebook codes are decoded with (from the stored float16 centroids)."""
        if self._computed is not None:
            return self._computed
        return Codebook(self.centroids.float())

    @property
    def length(self) -> int:
        return 0 if self.norms is None else self.norms.shape[2]

    def append(self, x: torch.Tensor) -> None:
        """Code ``x`` ``[B, H, t, D]`` (original basis) and append it along tokens."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise InputError(f"Expected [B, H, t, {self.head_dim}], got {tuple(x.shape)}.")
        if x.shape[2] == 0:
            return
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

    # -- the cache's store interface (kvlens.cache.layer) --------------------------------------
    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks; a sliding layer's expired history):
        the buffers shrink to what stays (one copy)."""
        if n % self.block or n > self.length:
            raise ValueError(f"drop_front needs whole blocks of {self.block} tokens within the "
                             f"{self.length} stored, got {n}")
        if n == 0:
            return
        self.packed = self.packed[:, :, n:].clone()
        self.norms = self.norms[:, :, n:].clone()

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` as float32 ``[B, H, t1 - t0, D]`` in the coded basis (the
        reference decode; only this slice is materialised)."""
        qt = CodebookTensor.from_packed(self.packed[:, :, t0:t1], self.norms[:, :, t0:t1],
                                        self.codebook, self.spec, self.head_dim)
        return dequantize_codebook(qt)

    def value_out(self, p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Softmax weights ``p`` ``[B, H, M, t1 - t0]`` times the coded values ``[t0, t1)``:
        ``sum_t (p_t s_t) c[code_t]`` ``[B, H, M, D]`` in the coded (rotated) basis, the
        vector scales folded into the weights (no dequantized value is materialised)."""
        c, sv = self.chunk(t0, t1)
        return torch.matmul(p * sv[:, :, None, :], c)

    def key_scores(self, q: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Queries ``q`` ``[B, H, M, D]`` (in the coded, rotated basis, scaling folded in) against
        the coded keys ``[t0, t1)``: ``s_t * (q . c[code_t])`` ``[B, H, M, t1 - t0]``, each
        vector's scale applied to its score (no dequantized key is materialised)."""
        c, sk = self.chunk(t0, t1)
        return torch.matmul(q, c.transpose(-1, -2)).mul_(sk[:, :, None, :])

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers by ``kvlens.cache.layout`` part name (the fitted centroids are held from
        the start, the codes and norms once something is stored)."""
        out = {} if self.packed is None else {"codes": self.packed, "norms": self.norms}
        return out | ({"codebooks": self.centroids} if self.centroids is not None else {})

    def select_batch(self, index: torch.Tensor) -> None:
        if self.packed is not None:
            self.packed, self.norms = self.packed[index], self.norms[index]

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
