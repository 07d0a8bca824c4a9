"""Errors of attention under a quantized cache: ``attention_errors_many`` and its variants.

For every ``Variant`` (keys and/or values replaced, optionally a MiKV set read at its own
codes), the relative error of the pre-softmax scores, the weights and the attention output
against the exact attention, pooled per head (``kvlens.analysis.attention`` defines the
attention, the masks and the relative error).
``attention_errors_reference`` is the plain loop the batched forms are tested against.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvlens.analysis.attention import (
    DEFAULT_CHUNK,
    _ratio,
    _softcap,
    _visible_keys,
    causal_mask,
    num_kv_groups,
    per_head_rel_error,
    sink_logits,
    sink_softmax,
)
from kvlens.errors import InputError


@dataclass(frozen=True)
class AttentionErrors:
    """Per-head relative errors of one variant (float64 tensors).

    key_reconstruction / value_reconstruction: ``[Hkv]``, None when that tensor was not
    replaced. scores (causal entries only), weights: ``[Hq]``, None when keys were not
    replaced (they cannot change). output: ``[Hq]``.
    """

    key_reconstruction: torch.Tensor | None
    value_reconstruction: torch.Tensor | None
    scores: torch.Tensor | None
    weights: torch.Tensor | None
    output: torch.Tensor


@dataclass(frozen=True)
class Variant:
    """One approximation of the cache: ``k_hat`` and/or ``v_hat`` ``[B, Hkv, T, D]`` (None =
    that tensor is kept exact).

    A MiKV importance set (``kvlens.research.heavy_hitters``): where ``in_set`` (bool ``[B, Hkv, Tq,
    Tk]``) is True, query ``i`` reads key ``j`` as ``k_set`` and value ``j`` as ``v_set``
    (``[B, Hkv, Tk, D]``; None = that tensor of the set is read exact). The set changes with
    the query (it is re-chosen while decoding), hence a mask per query."""

    k_hat: torch.Tensor | None = None
    v_hat: torch.Tensor | None = None
    in_set: torch.Tensor | None = None
    k_set: torch.Tensor | None = None
    v_set: torch.Tensor | None = None

    @property
    def keyed(self) -> bool:
        """Whether some key is read other than exact (scores and weights can change)."""
        return self.k_hat is not None or (self.in_set is not None and self.k_set is not None)


class _Sums:
    """Per-head float64 sums of squared error and squared reference for one metric."""

    def __init__(self, heads: int):
        self.err = torch.zeros(heads, dtype=torch.float64)
        self.ref = torch.zeros(heads, dtype=torch.float64)

    def add(self, ref: torch.Tensor, approx: torch.Tensor, ref_sq: torch.Tensor | None = None,
            keep: torch.Tensor | None = None) -> None:
        diff = ref - approx  # [Hq, rows, cols]; pooled in float64 across chunks and samples
        if keep is not None:
            diff = torch.where(keep, diff, 0.0)
        self.err += _row_sq(diff).cpu()
        self.ref += (_row_sq(ref) if ref_sq is None else ref_sq).cpu()

    def ratio(self) -> torch.Tensor:
        return _ratio(self.err, self.ref)


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    """Per-row norms in float32 (one fused pass, no temporaries of the squares), squared and
    summed in float64 over the rows (dim -2)."""
    return torch.linalg.vector_norm(x, dim=-1).double().square().sum(-1)


def attention_errors_many(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          variants: Sequence[Variant], *, scaling: float,
                          sliding_window: int = 0, softcap: float = 0.0,
                          chunk_size: int = DEFAULT_CHUNK, exact: torch.Tensor | None = None,
                          reconstruction: bool = True, sinks=None) -> list[AttentionErrors]:
    """Errors of attention for several variants of the cache, sharing the reference pass.

    q ``[B, Hq, T, D]``, k/v and every ``k_hat``/``v_hat`` ``[B, Hkv, T, D]``. Scores are
    compared on causal (visible) entries only; weights and output everywhere. Works
    ``chunk_size`` query rows at a time, visiting only the keys those rows can see, with the
    variants of one kind (which tensors they replace) stacked into one batched pass; samples
    and variants are grouped so that one group's float32 working block stays within
    ``BLOCK_BYTES``.

    ``exact`` (bool ``[Tq, Tk]``, optional): where True, query ``i`` reads key/value ``j``
    exact in every variant, as a streaming cache does for its full-precision window and sink
    tokens (``streaming_exact_mask``); it takes precedence over a variant's ``in_set``.
    Reconstruction errors still cover every token; ``reconstruction=False`` skips them (None),
    for callers that compute them once elsewhere. ``sinks``: the attention-sink logits ``[Hq]``
    (``kvlens.analysis.attention``; ``None`` or empty = none).

    Each error is computed from the difference the variant makes (``q (k - k_hat)ᵀ``,
    ``w (v - v_hat)``, ``w_ref - w_hat``), so a lossless variant gives exactly 0; the results
    equal ``attention_errors_reference`` (one variant at a time) to float32 rounding."""
    return attention_errors_streams(q, k, v, variants, [exact], scaling=scaling,
                                    sliding_window=sliding_window, softcap=softcap,
                                    chunk_size=chunk_size, reconstruction=reconstruction,
                                    sinks=sinks)[0]


def attention_errors_streams(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             variants: Sequence[Variant], exacts: Sequence[torch.Tensor | None],
                             *, scaling: float, sliding_window: int = 0, softcap: float = 0.0,
                             chunk_size: int = DEFAULT_CHUNK, reconstruction: bool = True,
                             select: Sequence[Sequence[int]] | None = None,
                             sinks=None) -> list[list[AttentionErrors | None]]:
    """``attention_errors_many`` for each of several ``exacts`` masks (one per way a cache's
    window moves), sharing what does not depend on the mask: the reference pass and each
    keyed variant's change to the logits (``q (k - k_hat)ᵀ``), each value variant's
    difference. ``out[m][n]`` is variant ``n`` read with mask ``m``, equal to
    ``attention_errors_many(..., exact=exacts[m])[n]``; ``select[m]`` (optional) lists the
    variants measured with mask ``m`` (the others are None)."""
    for exact in exacts:
        _check_inputs(q, k, v, variants, chunk_size, exact)
    if select is None:
        select = [range(len(variants))] * len(exacts)
    if len(select) != len(exacts):
        raise InputError(f"select has {len(select)} lists for {len(exacts)} masks.")
    wanted = [sorted(set(sel)) for sel in select]
    ratios = _batched_ratios(q, k, v, variants, scaling=scaling, sliding_window=sliding_window,
                             softcap=softcap, chunk_size=chunk_size, exacts=exacts,
                             select=wanted, sinks=sink_logits(sinks, q.shape[1], q.device))
    return [[_errors(k, v, variants[n], per[n], reconstruction) if n in per else None
             for n in range(len(variants))] for per in ratios]


# Budget of one group's float32 working block: [samples, variants, Hq, chunk, keys] for keyed
# and set variants, [samples, Hq, chunk, variants * D] for value-only ones. Small because
# the elementwise passes over it (mask, softmax, difference, norm) run from cache on CPU;
# larger blocks were slower there, smaller ones pay more per-call overhead.
BLOCK_BYTES = 8 * 2**20
_METRICS = ("scores", "weights", "output")


@dataclass(frozen=True)
class _Kind:
    """Which tensors a group of variants replaces: variants of one kind share a code path."""

    k_hat: bool
    v_hat: bool
    k_set: bool  # in_set with k_set
    v_set: bool  # in_set with v_set

    @classmethod
    def of(cls, var: Variant) -> _Kind:
        has_set = var.in_set is not None
        return cls(var.k_hat is not None, var.v_hat is not None,
                   has_set and var.k_set is not None, has_set and var.v_set is not None)

    @property
    def keyed(self) -> bool:
        return self.k_hat or self.k_set


@dataclass
class _Chunk:
    """The reference pass over one group of samples and one chunk of query rows, in the GQA
    layout ``[b, Hkv, g, c, ...]`` (query head ``h`` = KV head ``h // g``, member ``h % g``):
    the keys and values it can see, the masks and the reference scores and weights.

    Masks are float 0/1 (and an additive 0/-inf bias): multiplying by them is exact and,
    on CPU, far faster than ``masked_fill``/``where`` with a broadcast bool mask."""

    samples: slice
    rows_at: slice  # query rows of the chunk
    keys: slice  # keys some row of the chunk can see
    rows: torch.Tensor  # [b, Hkv, g * c, D], times scaling
    k: torch.Tensor  # [b, Hkv, n, D]
    v: torch.Tensor  # [b, Hkv, n, D]
    raw: torch.Tensor  # scaled logits before the softcap [b, Hkv, g, c, n]
    s_ref: torch.Tensor  # [b, Hkv, g, c, n]
    s_masked: torch.Tensor  # s_ref, -inf where hidden
    w_ref: torch.Tensor  # [b, Hkv, g, c, n]
    keep: torch.Tensor  # bool [c, n]: causal (sliding) entries
    counted: torch.Tensor  # float [c, n]: 1 where visible and not read exact
    fresh: torch.Tensor | None  # float [c, n]: 1 where not read exact (None: no exact mask)
    sink: torch.Tensor | None = None  # attention-sink logits [Hkv, g, 1, 1] (None: none)


def _pooled(x: torch.Tensor) -> torch.Tensor:
    """``[b, Hkv, (N,) g, c, L]`` -> float64 per-head sums of squares ``[(N,) Hq]``
    (``_row_sq``), pooled over samples."""
    sq = _row_sq(x).sum(0)
    return sq.reshape(-1) if sq.dim() == 2 else sq.transpose(0, 1).reshape(sq.shape[1], -1)


def _as_float(mask: torch.Tensor) -> torch.Tensor:
    # bool -> uint8 -> float32: the direct bool cast is several times slower on CPU
    return mask.view(torch.uint8).to(torch.float32)


def _batched_ratios(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    variants: Sequence[Variant], *, scaling: float, sliding_window: int,
                    softcap: float, chunk_size: int, exacts: Sequence[torch.Tensor | None],
                    select: Sequence[Sequence[int]],
                    sinks: torch.Tensor | None = None) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Per mask, ``{variant: {metric: per-head relative error}}`` of the selected variants
    (``attention_errors_streams``)."""
    b, hq, tq, _ = q.shape
    tk = k.shape[2]
    kinds: dict[_Kind, list[int]] = {}
    for n, var in enumerate(variants):
        kinds.setdefault(_Kind.of(var), []).append(n)
    rows_max = min(chunk_size, tq)
    keys_max = min(tk, sliding_window + rows_max - 1) if sliding_window > 0 else tk
    groups, per_batch = [], b
    for kind, idx in kinds.items():
        if kind.keyed or kind.v_set:  # a weight block per variant
            unit = hq * rows_max * keys_max
        else:  # each variant's value differences and output rows
            unit = (hq * rows_max + k.shape[1] * keys_max) * q.shape[-1]
        units = max(1, BLOCK_BYTES // (4 * unit))
        size = min(units, len(idx))  # (samples x variants) per block
        groups += [(kind, idx[i:i + size]) for i in range(0, len(idx), size)]
        per_batch = min(per_batch, max(1, units // size))
    batches = [slice(s, min(s + per_batch, b)) for s in range(0, b, per_batch)]
    chunks = [slice(s, min(s + chunk_size, tq)) for s in range(0, tq, chunk_size)]
    # One slot per (samples, chunk) piece, NaN until written: a piece a group skipped shows
    # in the result instead of silently counting as no error.
    pieces = len(batches) * len(chunks)
    nan, f64 = float("nan"), torch.float64
    err = [{m: torch.full((pieces, len(variants), hq), nan, dtype=f64, device=q.device)
            for m in _METRICS} for _ in exacts]
    ref = {m: torch.full((pieces, hq), nan, dtype=f64, device=q.device) for m in _METRICS}
    full_mask = causal_mask(tq, tk, sliding_window, q.device)
    chosen = [set(sel) for sel in select]
    for piece, (samples, rows_at) in enumerate(itertools.product(batches, chunks)):
        keys = slice(*_visible_keys(rows_at.start, rows_at.stop, tq, tk, sliding_window))
        base = _reference_chunk(q, k, v, samples, rows_at, keys, full_mask[rows_at, keys],
                                scaling, softcap, sinks)
        ref["scores"][piece] = _pooled(base.s_ref * _as_float(base.keep))
        ref["weights"][piece] = _pooled(base.w_ref)
        ref["output"][piece] = _pooled(base.w_ref @ base.v.unsqueeze(2))
        masked = [base if exact is None else _with_exact(base, exact[rows_at, keys])
                  for exact in exacts]
        for kind, idx in groups:
            shared: dict = {}  # what the group's variants change, whatever the mask
            for m, ch in enumerate(masked):
                at = [i for i, n in enumerate(idx) if n in chosen[m]]
                if not at:
                    continue
                group = [variants[idx[i]] for i in at]
                sums = _group_sums(ch, kind, group, softcap, shared,
                                   None if len(at) == len(idx) else at)
                for metric, e in sums.items():
                    err[m][metric][piece, [idx[i] for i in at]] = e
    refs = {m: ref[m].sum(0).cpu() for m in _METRICS}
    sums = [{metric: e.sum(0).cpu() for metric, e in per_mask.items()} for per_mask in err]
    return [{n: {metric: _ratio(sums[m][metric][n], refs[metric]) for metric in _METRICS}
             for n in sel} for m, sel in enumerate(select)]


def _with_exact(ch: _Chunk, same: torch.Tensor) -> _Chunk:
    """``ch`` with query ``i`` reading key/value ``j`` exact where ``same`` (``[c, n]``)."""
    same = same.to(ch.keep.device)
    return replace(ch, counted=_as_float(ch.keep & ~same), fresh=_as_float(~same))


def _reference_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, samples: slice,
                     rows_at: slice, keys: slice, keep: torch.Tensor, scaling: float,
                     softcap: float, sinks: torch.Tensor | None = None) -> _Chunk:
    kc, vc = k[samples, :, keys].float(), v[samples, :, keys].float()
    b, hkv, n, d = kc.shape
    rows = q[samples, :, rows_at].float()
    g, c = rows.shape[1] // hkv, rows.shape[2]
    rows = rows.reshape(b, hkv, g * c, d)
    raw = ((rows @ kc.transpose(-1, -2)) * scaling).view(b, hkv, g, c, n)
    s_ref = _softcap(raw, softcap)
    bias = torch.zeros(keep.shape, device=keep.device).masked_fill_(~keep, float("-inf"))
    s_masked = s_ref + bias
    sink = None if sinks is None else sinks.view(hkv, g, 1, 1)
    w_ref = sink_softmax(s_masked, sink)
    return _Chunk(samples, rows_at, keys, rows * scaling, kc, vc, raw, s_ref, s_masked, w_ref,
                  keep, _as_float(keep), None, sink)


def _group_sums(ch: _Chunk, kind: _Kind, group: Sequence[Variant], softcap: float,
                shared: dict, subset: Sequence[int] | None) -> dict[str, torch.Tensor]:
    """Per-variant float64 ``[N, Hq]`` sums of squared error of one chunk for ``N`` variants
    of one kind, stacked on dim 2: ``[b, Hkv, N, g, c, ...]``. ``shared``: what the group's
    variants change whatever the mask, kept for its next mask when every member is here
    (``subset`` None, else the members here).

    ``o_ref - o_hat = (w_ref - w_hat) v + (w_hat * ~exact) (v - v_hat)
    + (w_hat * set) (v_hat - v_set)``: each term is a difference the variant makes, so
    value-only variants (``w_hat = w_ref``) need one matmul of ``w_ref`` against the stacked
    value differences, and keyed variants one matmul of the rows against the stacked key
    differences."""
    b, hkv, g, c, n = ch.s_ref.shape
    big = len(group)

    def stack(xs: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:  # [b, Hkv, N, n, D]
        return torch.stack([x[ch.samples, :, ch.keys] for x in xs], dim=dim).float()

    member = None
    if kind.k_set or kind.v_set:  # float [b, Hkv, N, 1, c, n]: visible entries read from the set
        member = torch.stack([var.in_set[ch.samples, :, ch.rows_at, ch.keys] for var in group],
                             dim=2).to(ch.rows.device)
        member = _as_float(member & (ch.counted > 0)).unsqueeze(3)
    sums: dict[str, torch.Tensor] = {}
    if kind.keyed:
        w_hat = _keyed_weights(ch, kind, group, member, stack, softcap, sums, shared, subset)
        if kind.v_hat or kind.v_set:
            w_diff = ch.w_ref.unsqueeze(2) - w_hat
        else:  # w_hat - w_ref in place: only norms are taken, the sign does not matter
            w_diff = w_hat.sub_(ch.w_ref.unsqueeze(2))
        sums["weights"] = _pooled(w_diff)
        o_diff = (w_diff.view(b, hkv, -1, n) @ ch.v).view(b, hkv, big, g, c, -1)
    else:
        w_hat = ch.w_ref.unsqueeze(2)  # [b, Hkv, 1, g, c, n]: keys are exact
        o_diff = None
    if kind.v_hat:
        reads = w_hat if ch.fresh is None else w_hat * ch.fresh  # entries that read v_hat
        if kind.keyed:  # a weight block per variant
            v_diff = stack([var.v_hat for var in group]).neg_().add_(ch.v.unsqueeze(2))
            term = (reads.view(b, hkv, big, g * c, n) @ v_diff).view(b, hkv, big, g, c, -1)
        else:  # one matmul of the shared weights against every variant's value difference
            if "v_diff" in shared:
                v_diff = shared["v_diff"]
                if subset is not None:
                    v_diff = v_diff[:, :, :, list(subset)]
            else:
                v_diff = stack([var.v_hat for var in group], dim=3).neg_().add_(
                    ch.v.unsqueeze(3))
                if subset is None:
                    shared["v_diff"] = v_diff
            term = reads.view(b, hkv, g * c, n) @ v_diff.reshape(b, hkv, n, -1)
            term = term.view(b, hkv, g, c, big, -1).permute(0, 1, 4, 2, 3, 5)
        o_diff = term if o_diff is None else o_diff + term
    if kind.v_set:
        v_read = stack([var.v_hat for var in group]) if kind.v_hat else ch.v.unsqueeze(2)
        v_diff = v_read - stack([var.v_set for var in group])
        term = ((w_hat * member).view(b, hkv, big, g * c, n) @ v_diff).view(
            b, hkv, big, g, c, -1)
        o_diff = term if o_diff is None else o_diff + term
    sums["output"] = _pooled(o_diff)
    return sums


def _keyed_weights(ch: _Chunk, kind: _Kind, group: Sequence[Variant],
                   member: torch.Tensor | None,
                   stack: Callable[[Sequence[torch.Tensor]], torch.Tensor], softcap: float,
                   sums: dict[str, torch.Tensor], shared: dict,
                   subset: Sequence[int] | None) -> torch.Tensor:
    """Weights ``[b, Hkv, N, g, c, n]`` of keyed variants, from the change each variant's
    keys make to the logits (0 where hidden or read exact); writes the score sums into
    ``sums``."""
    b, hkv, g, c, n = ch.s_ref.shape
    big = len(group)
    rows = ch.rows.unsqueeze(2)  # [b, Hkv, 1, g * c, D], times scaling

    def logit_change(xs: Sequence[torch.Tensor]) -> torch.Tensor:  # raw_hat - raw_ref
        k_diff = stack(xs).sub_(ch.k.unsqueeze(2))
        return (rows @ k_diff.transpose(-1, -2)).view(b, hkv, big, g, c, n)

    # the logit change is the same for every mask: kept for the group's next mask (not when
    # only some members are here, nor beside a set, whose change is masked per query)
    if kind.k_hat and not kind.k_set and subset is None and "k_change" not in shared:
        shared["k_change"] = logit_change([var.k_hat for var in group])
    if kind.k_hat and "k_change" in shared:
        raw = shared["k_change"]
        if subset is not None:
            raw = raw[:, :, list(subset)]
        change = torch.mul(raw, ch.counted)
    elif kind.k_hat:
        change = logit_change([var.k_hat for var in group]).mul_(ch.counted)
    else:
        change = ch.raw.new_zeros(b, hkv, big, g, c, n)
    if kind.k_set:  # exact selection: x * 0 and x + 0 round to nothing
        change.mul_(1 - member).add_(logit_change([var.k_set for var in group]).mul_(member))
    if softcap > 0:
        # tanh(a + x) - tanh(a) = tanh(x) (1 - tanh(a + x) tanh(a)): exact 0 where x is 0
        a = ch.raw.unsqueeze(2) / softcap
        t_hat = torch.tanh(a + change / softcap)
        change = torch.tanh(change / softcap).mul_(1 - t_hat * torch.tanh(a)).mul_(softcap)
    sums["scores"] = _pooled(change)
    # s_hat = s_ref + change, -inf where hidden (change is 0 there), in place
    sink = None if ch.sink is None else ch.sink.unsqueeze(1)  # [Hkv, 1, g, 1, 1]
    return sink_softmax(change.add_(ch.s_masked.unsqueeze(2)), sink)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  variants: Sequence[Variant], chunk_size: int,
                  exact: torch.Tensor | None) -> None:
    num_kv_groups(q.shape[1], k.shape[1])
    for n, var in enumerate(variants):
        has_set = var.in_set is not None and (var.k_set is not None or var.v_set is not None)
        if var.k_hat is None and var.v_hat is None and not has_set:
            raise InputError(f"Variant {n} replaces neither keys nor values: give k_hat, "
                             "v_hat or both (or a set); there is no variant to compare.")
        for name, ref, t in (("k_hat", k, var.k_hat), ("v_hat", v, var.v_hat),
                             ("k_set", k, var.k_set), ("v_set", v, var.v_set)):
            if t is not None and t.shape != ref.shape:
                raise InputError(f"Variant {n}: {name} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(ref.shape)}.")
        want = (*k.shape[:2], q.shape[2], k.shape[2])
        if var.in_set is not None and tuple(var.in_set.shape) != want:
            raise InputError(f"Variant {n}: in_set has shape {tuple(var.in_set.shape)}, "
                             f"expected {want}.")
    if chunk_size < 1:
        raise InputError(f"chunk_size must be positive, got {chunk_size}.")
    tq, tk = q.shape[2], k.shape[2]
    if exact is not None and tuple(exact.shape) != (tq, tk):
        raise InputError(f"exact mask has shape {tuple(exact.shape)}, expected {(tq, tk)}.")


def attention_errors_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               variants: Sequence[Variant], *, scaling: float,
                               sliding_window: int = 0, softcap: float = 0.0,
                               chunk_size: int = DEFAULT_CHUNK, exact: torch.Tensor | None = None,
                               reconstruction: bool = True, sinks=None) -> list[AttentionErrors]:
    """The loop ``attention_errors_many`` is tested against: one sample, one chunk of query
    rows and one variant at a time (same arguments, same results to float32 rounding)."""
    b, hq, tq, _ = q.shape
    tk = k.shape[2]
    groups = num_kv_groups(hq, k.shape[1])
    _check_inputs(q, k, v, variants, chunk_size, exact)
    sink = sink_logits(sinks, hq, q.device)
    sink = None if sink is None else sink.view(hq, 1, 1)
    sums = [{m: _Sums(hq) for m in _METRICS} for _ in variants]
    full_mask = causal_mask(tq, tk, sliding_window, q.device)

    def heads(x: torch.Tensor, i: int) -> torch.Tensor:
        return x[i].float().repeat_interleave(groups, dim=0)

    def maybe(x: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if x is None else heads(x, i)

    for i in range(b):
        k_ref, v_ref = heads(k, i), heads(v, i)
        k_alts = [maybe(var.k_hat, i) for var in variants]
        v_alts = [v_ref if var.v_hat is None else heads(var.v_hat, i) for var in variants]
        sets = [(None if var.in_set is None else
                 var.in_set[i].to(q.device).repeat_interleave(groups, dim=0),
                 maybe(var.k_set, i), maybe(var.v_set, i)) for var in variants]
        for start in range(0, tq, chunk_size):
            end = min(start + chunk_size, tq)
            # Only keys some query of this chunk can see: skips the masked future (and, with a
            # sliding window, the distant past); masked entries count for nothing anyway.
            keys = slice(*_visible_keys(start, end, tq, tk, sliding_window))
            rows = q[i, :, start:end].float()
            keep = full_mask[start:end, keys]
            hide = ~keep
            same = None if exact is None else exact[start:end, keys].to(q.device)
            s_ref = _softcap((rows @ k_ref[:, keys].transpose(-1, -2)) * scaling, softcap)
            s_ref_sq = _row_sq(torch.where(keep, s_ref, 0.0))
            w_ref = sink_softmax(s_ref.masked_fill(hide, float("-inf")), sink)
            o_ref = w_ref @ v_ref[:, keys]
            for acc, var, k_alt, v_alt, (in_set, k_set, v_set) in zip(
                    sums, variants, k_alts, v_alts, sets, strict=True):
                member = None if in_set is None else in_set[:, start:end, keys]
                if member is not None and same is not None:
                    member = member & ~same
                w_alt = w_ref
                if var.keyed:
                    s_alt = s_ref.clone() if k_alt is None else _softcap(
                        (rows @ k_alt[:, keys].transpose(-1, -2)) * scaling, softcap)
                    if same is not None and k_alt is not None:
                        s_alt = torch.where(same, s_ref, s_alt)
                    if member is not None and k_set is not None:
                        s_set = _softcap((rows @ k_set[:, keys].transpose(-1, -2)) * scaling,
                                         softcap)
                        s_alt = torch.where(member, s_set, s_alt)
                    acc["scores"].add(s_ref, s_alt, s_ref_sq, keep)
                    w_alt = sink_softmax(s_alt.masked_fill_(hide, float("-inf")), sink)
                    acc["weights"].add(w_ref, w_alt)
                o_alt = w_alt @ v_alt[:, keys]
                if same is not None and v_alt is not v_ref:
                    # exact entries read v, not v_hat: add back w * (v - v_hat) there
                    o_alt += (w_alt * same) @ (v_ref[:, keys] - v_alt[:, keys])
                if member is not None and v_set is not None:
                    # set entries read v_set: add w * (v_set - v_hat) there
                    o_alt += (w_alt * member) @ (v_set[:, keys] - v_alt[:, keys])
                acc["output"].add(o_ref, o_alt)
    return [_errors(k, v, var, {m: s.ratio() for m, s in acc.items()}, reconstruction)
            for var, acc in zip(variants, sums, strict=True)]


def _errors(k: torch.Tensor, v: torch.Tensor, var: Variant, ratios: dict[str, torch.Tensor],
            recon: bool = True) -> AttentionErrors:
    def rel(x: torch.Tensor, x_hat: torch.Tensor | None) -> torch.Tensor | None:
        return per_head_rel_error(x, x_hat) if x_hat is not None and recon else None

    keyed = var.keyed
    return AttentionErrors(rel(k, var.k_hat), rel(v, var.v_hat),
                           ratios["scores"] if keyed else None,
                           ratios["weights"] if keyed else None, ratios["output"])
