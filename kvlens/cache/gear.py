"""GEAR in the cache: the sparse outlier part and the low-rank part beside a packed store.

GEAR (arXiv 2403.05527) stores ``X ~ D_hat + S + L``. Here, for every flushed block of ``F``
tokens (the layer's flush block: GEAR's streaming buffer ``n_b``) of one quantized tensor:

1. **S, chosen first**: the ``k = ceil(s * n)`` largest-magnitude entries of every quantization
   vector of the block (``kvlens.quant.transforms.split_outliers``; the vectors run along what
   the quantizer groups: per-channel keys -> each channel's ``F`` tokens, ``n = F``; per-token
   values -> each token's ``D`` channels, ``n = D``) are set to zero before quantizing, so they
   do not stretch the ranges;
2. **D_hat**: the block is quantized into the packed store (``kvlens.layouts.packed``), unchanged;
3. **S, stored**: at each outlier position the correction ``x - D_hat`` (``D_hat`` as the cache
   reads it, float16 scales), so ``D_hat + S`` is exact there (up to ``fp_dtype`` rounding);
4. **L**: a rank-``r`` approximation of the block's remaining residual ``x - D_hat - S`` per
   (batch row, KV head) by ``power_iters`` power iterations
   (``kvlens.quant.transforms.lowrank_residual``, seeded), stored as ``left [F, r]`` and
   ``right [r, D]``.

Why factors per block and not per head: the cache never keeps the full-precision history, so a
per-head factorisation over all tokens could not be updated without refitting on data already
dropped; per-block factors are computed once from the block being flushed (GEAR's own streaming
scheme), are immutable like the block's codes, and their bytes are a function of the token count.
The price is ``r * (F + D)`` values per block and head: at ``F = D = 64``, ``r = 4`` that is 2
bits per element at float16, as much as the 2-bit codes.

Storage (exactly what ``kvlens.cache.layout`` predicts; ``fp`` = the config's ``fp_dtype``):

- ``out_val`` (fp) and ``out_idx`` (``uint8`` when a vector has at most 256 entries, else
  ``int16``): per-channel scope ``[B, H, nb * k, D]`` (row ``b * k + j``: the ``j``-th outlier of
  each channel in block ``b``; the index is the token offset inside the block); per-token scope
  ``[B, H, T, k]`` (the index is the channel). The vector an entry belongs to is implicit (``k``
  per vector), so one entry costs ``fp + 1`` bytes: 3 bytes at float16.
- ``left`` (fp) ``[B, H, T, r]`` (token rows, block by block) and ``right`` (fp)
  ``[B, H, nb, r, D]``.

Attention reads the terms without a dense ``L`` or ``S``: keys add ``(q right^T) left^T`` and the
outlier products scattered to their tokens (``key_terms``); values add ``(p left) right`` and
the weighted outliers scattered to their channels (``value_terms``). ``dense_range`` builds
``S + L`` for tests and references only.
"""

from __future__ import annotations

import torch

from kvlens.quant import QuantSpec
from kvlens.quant.transforms import (
    default_outlier_scope,
    lowrank_residual,
    outlier_count,
    split_outliers,
)

LOWRANK_SEED = 0  # the power iterations' Gaussian start (deterministic)


def index_bytes(vector_length: int) -> int:
    """Bytes of one stored outlier index within a vector of ``vector_length`` entries."""
    return 1 if vector_length <= 256 else 2


def _index_dtype(vector_length: int) -> torch.dtype:
    return torch.uint8 if vector_length <= 256 else torch.int16


def vector_length(spec: QuantSpec, block: int, head_dim: int) -> int:
    """Entries of one outlier vector: ``F`` tokens (per-channel scope) or ``D`` channels."""
    return block if default_outlier_scope(spec) == "per-channel" else head_dim


def part_bytes(spec: QuantSpec, gear, tokens: int, block: int, head_dim: int, fp_bytes: int
               ) -> tuple[int, int]:
    """``(outliers, lowrank)`` bytes of ``tokens`` (a multiple of ``block``) packed tokens of one
    (batch row, KV head) of a tensor stored with ``gear`` (``kvlens.config.GearSettings``)."""
    nb = tokens // block
    n = vector_length(spec, block, head_dim)
    k = outlier_count(n, gear.outlier_fraction)
    per_channel = default_outlier_scope(spec) == "per-channel"
    vectors = nb * head_dim if per_channel else tokens  # D per block, or one per token
    outliers = vectors * k * (fp_bytes + index_bytes(n))
    lowrank = gear.rank * (tokens + nb * head_dim) * fp_bytes
    return outliers, lowrank


class GearTensor:
    """The sparse and low-rank parts of one tensor's packed history (module docstring), aligned
    with its ``PackedTensor``: tokens ``[0, length)`` of both are the same positions."""

    def __init__(self, spec: QuantSpec, gear, block: int, head_dim: int,
                 fp_dtype: torch.dtype | None):
        self.spec = spec
        self.gear = gear
        self.block = block
        self.head_dim = head_dim
        self.fp_dtype = fp_dtype  # None: the dtype of the tensor compressed first
        self.per_channel = default_outlier_scope(spec) == "per-channel"
        self.vector = vector_length(spec, block, head_dim)
        self.k = outlier_count(self.vector, gear.outlier_fraction)
        self.out_val: torch.Tensor | None = None
        self.out_idx: torch.Tensor | None = None
        self.left: torch.Tensor | None = None
        self.right: torch.Tensor | None = None
        self.length = 0

    # -- write --------------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, store) -> None:
        """Store ``x`` ``[B, H, n*F, D]`` (float, the stored basis): outliers out, the rest
        into ``store`` (the tensor's ``PackedTensor``), then the corrections and the low-rank
        factors of what the store misses."""
        b, h, n, d = x.shape
        f = self.block
        nb = n // f
        dtype = self.fp_dtype or x.dtype
        x = x.float()
        if self.per_channel:  # each channel's F tokens of a block
            dense, out = split_outliers(x.view(b, h, nb, f, d), self.gear.outlier_fraction, -2)
            dense = dense.view(b, h, n, d)
        else:  # each token's D channels
            dense, out = split_outliers(x, self.gear.outlier_fraction, -1)
        t0 = store.length
        store.append(dense)
        d_hat = store.dequantize_range(t0, t0 + n)
        if self.per_channel:
            d_blk = d_hat.view(b, h, nb, f, d)
            corr = (out.values - d_blk.gather(-2, out.indices)).to(dtype)
            approx = d_blk.scatter_add(-2, out.indices, corr.float()).view(b, h, n, d)
            idx, val = out.indices.reshape(b, h, nb * self.k, d), corr.reshape(b, h, -1, d)
        else:
            corr = (out.values - d_hat.gather(-1, out.indices)).to(dtype)
            approx = d_hat.scatter_add(-1, out.indices, corr.float())
            idx, val = out.indices, corr
        self.out_idx = _cat(self.out_idx, idx.to(_index_dtype(self.vector)))
        self.out_val = _cat(self.out_val, val)
        if self.gear.rank:
            resid = (x - approx).view(b, h, nb, f, d).transpose(1, 2).reshape(b * nb, h, f, d)
            lr = lowrank_residual(resid, self.gear.rank, self.gear.power_iters, LOWRANK_SEED)
            r = self.gear.rank
            left = lr.left.reshape(b, nb, h, f, r).transpose(1, 2).reshape(b, h, n, r)
            right = lr.right.reshape(b, nb, h, r, d).transpose(1, 2)
            self.left = _cat(self.left, left.to(dtype))
            self.right = _cat(self.right, right.to(dtype))
        self.length += n

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` tokens (whole blocks, with the packed store's)."""
        if n == 0:
            return
        nb = n // self.block
        rows = nb * self.k if self.per_channel else n
        self.out_idx = self.out_idx[:, :, rows:].clone()
        self.out_val = self.out_val[:, :, rows:].clone()
        if self.left is not None:
            self.left = self.left[:, :, n:].clone()
            self.right = self.right[:, :, nb:].clone()
        self.length -= n

    # -- read ---------------------------------------------------------------------------------
    def _rows(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Outlier ``(indices int64, values float32)`` of the blocks in ``[t0, t1)``; per-channel
        scope: indices are made absolute within the range (``block * F + offset``)."""
        if self.per_channel:
            f, k = self.block, self.k
            idx = self.out_idx[:, :, t0 // f * k:t1 // f * k].long()
            b, h, rows, d = idx.shape
            base = torch.arange(rows // k, device=idx.device).repeat_interleave(k) * f
            return idx + base[:, None], self.out_val[:, :, t0 // f * k:t1 // f * k].float()
        return self.out_idx[:, :, t0:t1].long(), self.out_val[:, :, t0:t1].float()

    def _factors(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``left [B, H, nb, F, r]``, ``right [B, H, nb, r, D]`` of the blocks in ``[t0, t1)``."""
        f = self.block
        b, h = self.left.shape[:2]
        left = self.left[:, :, t0:t1].float().view(b, h, (t1 - t0) // f, f, -1)
        return left, self.right[:, :, t0 // f:t1 // f].float()

    def key_terms(self, q: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """``q (S + L)^T`` for tokens ``[t0, t1)``: q ``[B, H, M, D]`` -> ``[B, H, M, n]``."""
        b, h, m, d = q.shape
        n = t1 - t0
        if self.gear.rank:
            left, right = self._factors(t0, t1)
            s = torch.matmul(torch.matmul(q.unsqueeze(2), right.transpose(-1, -2)),
                             left.transpose(-1, -2))  # [B, H, nb, M, F]
            s = s.permute(0, 1, 3, 2, 4).reshape(b, h, m, n)
        else:
            s = q.new_zeros(b, h, m, n)
        idx, val = self._rows(t0, t1)
        if self.per_channel:  # entry (row, d) adds q_d * val to its token idx
            contrib = q.unsqueeze(3) * val.unsqueeze(2)  # [B, H, M, rows, D]
            s.scatter_add_(-1, idx.flatten(2).unsqueeze(2).expand(b, h, m, -1),
                           contrib.flatten(3))
        else:  # token t adds sum_j q_{idx_tj} * val_tj
            qg = q.gather(-1, idx.flatten(2).unsqueeze(2).expand(b, h, m, -1))
            s += (qg.view(b, h, m, n, self.k) * val.unsqueeze(2)).sum(-1)
        return s

    def value_terms(self, p: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """``p (S + L)`` for tokens ``[t0, t1)``: p ``[B, H, M, n]`` -> ``[B, H, M, D]``."""
        b, h, m, n = p.shape
        d = self.head_dim
        if self.gear.rank:
            left, right = self._factors(t0, t1)
            pb = p.view(b, h, m, n // self.block, self.block).transpose(2, 3)  # [B,H,nb,M,F]
            out = torch.matmul(torch.matmul(pb, left), right).sum(2)
        else:
            out = p.new_zeros(b, h, m, d)
        idx, val = self._rows(t0, t1)
        if self.per_channel:  # channel d adds sum_rows p_{idx_rd} * val_rd
            pg = p.gather(-1, idx.flatten(2).unsqueeze(2).expand(b, h, m, -1))
            out += (pg.view(b, h, m, -1, d) * val.unsqueeze(2)).sum(3)
        else:  # token t adds p_t * val_tj to channel idx_tj
            w = p.unsqueeze(-1) * val.unsqueeze(2)  # [B, H, M, n, k]
            out.scatter_add_(-1, idx.flatten(2).unsqueeze(2).expand(b, h, m, -1), w.flatten(3))
        return out

    def dense_range(self, t0: int, t1: int) -> torch.Tensor:
        """``S + L`` of tokens ``[t0, t1)`` as float32 ``[B, H, n, D]`` (tests, references)."""
        b, h = self.out_val.shape[:2]
        n, d = t1 - t0, self.head_dim
        out = torch.zeros(b, h, n, d, device=self.out_val.device)
        if self.gear.rank:
            left, right = self._factors(t0, t1)
            out += torch.matmul(left, right).reshape(b, h, n, d)
        idx, val = self._rows(t0, t1)
        return out.scatter_add_(-2 if self.per_channel else -1, idx, val)

    # -- accounting ---------------------------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(kvlens.cache.layout part, tensor)`` of every buffer."""
        out = [("outliers", t) for t in (self.out_idx, self.out_val) if t is not None]
        return out + [("lowrank", t) for t in (self.left, self.right) if t is not None]

    def select_batch(self, index: torch.Tensor) -> None:
        for name in ("out_idx", "out_val", "left", "right"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[index])


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``old`` with ``new`` appended along tokens (dim 2), in a buffer of exactly that size."""
    return new.contiguous() if old is None else torch.cat((old, new), dim=2)
