"""MiKV's importance set as the cache keeps it while decoding, simulated on captured q, k, v.

At every step ``i`` of ``kvlens.cache.layer.CompressedLayer`` with heavy hitters, query ``i``
reads the packed history (set tokens masked out), the set (at its ``set_bits`` codes,
``kvlens.research.sets``) and the window (exact); the attention each held position received is
added to its H2O accumulator; when the window flushes, the set is chosen again among the set and
the flushed block (the sinks always, then the largest accumulated attention), and a token that
leaves it cannot come back. ``set_membership`` replays that one epoch (the queries between two
flushes) at a time and returns which keys each query reads from the set (``Variant.in_set``);
``tests/test_heavy_hitters.py`` checks it step by step against the cache layer. Tensors are
``[B, H, T, D]``.
"""

from __future__ import annotations

import torch

from kvlens.analysis.attention import (
    num_kv_groups,
    sink_logits,
    sink_softmax,
    streaming_quantized_length,
)
from kvlens.cache.sets import set_policy
from kvlens.research.sets import dequantize_rows, quantize_rows


def set_reconstruction(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """What the set reads for ``x`` ``[B, Hkv, T, D]``: its ``bits`` per-token codes
    dequantized (``kvlens.research.sets``), or ``x`` itself for a set at full precision."""
    if bits is None:
        return x.float()

    return dequantize_rows(*quantize_rows(x, bits), bits, x.shape[-1])


def set_membership(q: torch.Tensor, k: torch.Tensor, k_read: torch.Tensor,
                   k_set: torch.Tensor, mikv, *, scaling: float, residual_tokens: int,
                   flush_tokens: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """Bool ``[B, Hkv, T, T]``: True where decoding query ``i`` reads key ``j`` from the set of
    a global layer with window ``residual_tokens``, flush block ``flush_tokens`` and settings
    ``mikv`` (a ``ProtectSettings``), fed the ``T`` tokens one at a time. ``k`` exact (the
    window), ``k_read`` the packed keys as the cache reads them (balancer folded back),
    ``k_set`` the set's (``set_reconstruction``): the accumulated attention uses these reads,
    and the attention-sink logits ``sinks`` ``[Hq]`` (``None`` or empty: none)."""

    b, hq, t, d = q.shape
    hkv = k.shape[1]
    policy = set_policy(mikv)
    g = num_kv_groups(hq, hkv)
    n_q = streaming_quantized_length(t, residual_tokens, flush_tokens).tolist()
    qg = (q.float() * scaling).reshape(b, hkv, g, t, d)
    sink = sink_logits(sinks, hq, q.device)
    sink = None if sink is None else sink.view(hkv, g, 1, 1)
    pos = torch.arange(t, device=q.device)
    member = torch.zeros(b, hkv, t, dtype=torch.bool, device=q.device)
    in_set = torch.zeros(b, hkv, t, t, dtype=torch.bool, device=q.device)
    acc = torch.zeros(b, hkv, t, device=q.device)
    i0 = 0
    while i0 < t:
        nq = n_q[i0]
        i1 = i0 + 1
        while i1 < t and n_q[i1] == nq:
            i1 += 1
        # queries [i0, i1) read the same cache: set, packed (up to nq), window (exact)
        keys = torch.where(member[:, :, :i1, None], k_set[:, :, :i1].float(),
                           k_read[:, :, :i1].float())
        keys[:, :, nq:i1] = k[:, :, nq:i1].float()
        s = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, i0:i1], keys)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        future = pos[None, :i1] > pos[i0:i1, None]
        p = sink_softmax(s.masked_fill(future, float("-inf")), sink)
        acc[:, :, :i1] += p.sum(dim=(2, 3))
        in_set[:, :, i0:i1] = member[:, :, None, :]
        if i1 < t and n_q[i1] > nq:  # the flush after query i1 - 1
            size = 0 if policy is None else policy.size(0, n_q[i1])
            member = _choose(member, acc, nq, n_q[i1], mikv, size)
        i0 = i1
    return in_set


def _choose(member: torch.Tensor, acc: torch.Tensor, t0: int, t1: int, mikv,
            size: int) -> torch.Tensor:
    """The set after flushing ``[t0, t1)``: among the current set and the block, the sinks and
    then the largest accumulated attention (``HeavyHitters.choose``)."""
    cand = member.clone()
    cand[:, :, t0:t1] = True
    keep = min(int(cand[0, 0].sum()), size)
    score = acc.masked_fill(~cand, float("-inf"))
    score[:, :, :mikv.sink_tokens] = torch.where(cand[:, :, :mikv.sink_tokens], float("inf"),
                                                 float("-inf"))
    idx = score.topk(keep, dim=-1).indices
    return torch.zeros_like(member).scatter_(-1, idx, True)
