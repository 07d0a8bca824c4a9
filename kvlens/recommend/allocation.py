"""Allocation: one (key, value, window) option per layer under the budget, and the
``Recommendation`` assembled from it: minimise ``sum_l w_l (e_K + e_V)`` with the mean cost at
most the budget, a multiple-choice knapsack (``allocate``) over each layer's Pareto front,
solved exactly on costs rounded up to ``1/COST_RESOLUTION`` bit. Config-wide choices (rotated
candidates or not, each research twin setting) are solved separately and the best objective
kept (``assemble``). ``prefer_fast`` offers only pairs the fused decode kernel reads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import cache

import numpy as np

from kvlens.cache.layout import config_bits, config_part_bytes
from kvlens.cache.triton_glue import kernel_layout_problem
from kvlens.errors import ConfigError, InputError
from kvlens.recommend.build import build_config
from kvlens.recommend.catalog import candidates, family
from kvlens.recommend.options import Candidate, RecommendOptions, Stream, listed
from kvlens.recommend.pricing import decode_costs, option_bytes, tensor_fp16_bytes
from kvlens.recommend.result import Choice, Recommendation

COST_RESOLUTION = 64  # DP cost units per bit


def allocate(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
             budget_total: float) -> list[int]:
    """Multiple-choice knapsack: one option per group, ``sum cost <= budget_total``, minimal
    ``sum error``. Exact on costs rounded *up* to ``1/COST_RESOLUTION`` (never over budget).
    Raises ``InputError`` when even the cheapest options exceed the budget."""

    units = [np.ceil(np.asarray(c, dtype=float) * COST_RESOLUTION - 1e-9).astype(int)
             for c in costs]
    cap = int(math.floor(budget_total * COST_RESOLUTION + 1e-9))
    minimum = sum(int(u.min()) for u in units)
    if minimum > cap:
        raise InputError(
            f"The budget is too small: the cheapest candidates need "
            f"{minimum / COST_RESOLUTION / len(costs):.3f} bits per element on average, "
            f"more than the {budget_total / len(costs):.3f} asked for.")
    inf = float("inf")
    best = np.full(cap + 1, inf)
    best[0] = 0.0
    picks = []
    for u, e in zip(units, errors):
        new = np.full(cap + 1, inf)
        arg = np.full(cap + 1, -1, dtype=int)
        for i, (cu, ce) in enumerate(zip(u, e)):
            if cu > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[cu:] = best[:cap + 1 - cu] + ce
            better = cand < new
            new[better] = cand[better]
            arg[better] = i
        best = new
        picks.append(arg)
    end = int(np.argmin(best))
    chosen = []
    for u, arg in zip(reversed(units), reversed(picks)):
        i = int(arg[end])
        chosen.append(i)
        end -= int(u[i])
    return chosen[::-1]


def _layer_options(table, opts: RecommendOptions, cost, weight: float, head_dim: int = 0,
                   factors: dict | None = None):
    """The Pareto front of (key, value, window) choices for one layer: ``[(cost, error, key,
    value, stream)]`` with ``cost(kc, vc, stream)`` the layer's held bytes in budget units and
    ``error`` the weighted sum of both tensors' errors with the layer's window and flush block
    (``stream``); a pair that cannot be stored with a window is not offered with it.
    ``factors``: ``{family(c): f}`` multiplying each tensor's error (1 where absent)."""
    factors = factors or {}
    keys, values = (sorted({c for c, _ in table if c.tensor == t}, key=lambda c: c.label)
                    for t in ("key", "value"))
    pairs = []
    for r, kc, vc in itertools.product(opts.window_sizes, keys, values):
        s = Stream(r, opts.layer_flush(kc, vc, residual=r))
        # a twin is a layer's choice: both tensors or neither
        if kc.twin != vc.twin or (opts.prefer_fast and not _fused(kc, vc, s, head_dim)):
            continue
        if (kc, s) in table and (vc, s) in table:
            err = weight * (factors.get(family(kc), 1.0) * table[kc, s][0] +
                            factors.get(family(vc), 1.0) * table[vc, s][0])
            pairs.append((cost(kc, vc, s), err, kc, vc, s))
    pairs.sort(key=lambda p: (p[0], p[1]))
    front, best = [], math.inf
    for p in pairs:  # cheapest first: keep only options that lower the error
        if p[1] < best:
            front.append(p)
            best = p[1]
    return front


def _fused(kc: Candidate, vc: Candidate, stream: Stream, head_dim: int) -> bool:
    """Whether the fused decode kernel reads a layer storing ``kc`` / ``vc`` (``--prefer-fast``;
    the rule is the dispatch's own, ``kvlens.cache.triton_glue.kernel_layout_problem``)."""

    return kernel_layout_problem(stream.setting(kc, vc), head_dim) is None


class _Pricing:
    """Each layer's Pareto front of options in budget units (bits per element of the whole
    cache, times the number of layers) and what the cheapest of them need."""

    def __init__(self, meta, opts: RecommendOptions, weights, factors=()):
        self.meta, self.opts, self.weights, self.shape = meta, opts, weights, meta.shape
        self.factors = factors
        self.fp16_total = meta.shape.fp16_bytes(opts.context)
        self.option = cache(self._option)  # one cache per pricing

    def _option(self, kc, vc, s, window):
        """``option_bytes`` of a layer with sliding ``window`` storing ``kc``/``vc``."""
        shape = self.shape
        layer = next(i for i in shape.attention_layers if shape.window(i) == window)
        return option_bytes(kc, vc, s.flush, self.opts, shape, layer, residual=s.residual)

    def fronts(self, tables, rotation: bool, twin) -> list[list]:
        """Per layer ``_layer_options`` with or without rotated candidates, with research
        twins at the config-wide ``twin`` setting (None: no twin)."""
        n, out = len(tables), []
        # weights and factors are per captured layer, in the order of meta.layers (model
        # indices: a hybrid model's layers with a KV cache)
        for j, (layer, table) in enumerate(zip(self.meta.layers, tables)):
            w = self.shape.window(layer)
            table = {cf: e for cf, e in table.items() if (rotation or not cf[0].rotate)
                     and cf[0].twin in (None, twin)}
            out.append(_layer_options(
                table, self.opts,
                lambda kc, vc, s, w=w: 16 * n * self.option(kc, vc, s, w)[0] / self.fp16_total,
                self.weights[j], self.shape.head_dim,
                self.factors[j] if self.factors else None))
        return out

    def reserve(self, fronts) -> float:
        """Budget bits of the one ``[D, D]`` float32 rotation matrix every rotating layer
        shares (0 when no option rotates)."""
        rotates = any(p[2].rotate or p[3].rotate for front in fronts for p in front)
        return 16 * self.shape.head_dim ** 2 * 4 / self.fp16_total if rotates else 0.0

    def need(self, fronts) -> float:
        """Bits per element the cheapest option of every layer needs (costs rounded up per
        layer, as ``allocate`` rounds them), the shared rotation matrix included."""
        units = sum(math.ceil(min(p[0] for p in front) * COST_RESOLUTION - 1e-9)
                    for front in fronts)
        return units / COST_RESOLUTION / len(fronts) + self.reserve(fronts)

    def variants(self) -> list[tuple[bool, tuple | None]]:
        """The config-wide choices solved for separately: with and without rotated
        candidates, no twin and each config-wide twin setting."""
        return [(rot, m) for rot in ((True, False) if self.opts.rotation else (False,))
                for m in (None, *self.opts.twin_settings())]


def _twin_notes(opts: RecommendOptions, solved, best: float) -> list[str]:
    """Each extension's note on its settings (``CandidateExtension.note``), beside the best
    objective without a twin."""
    plain = min((s[0] for m, s, _ in solved if s is not None and m is None), default=math.inf)
    return [ext.note([t.setting for t in opts.twin_settings() if t.extension == ext.name],
                     best, plain)
            for ext in opts.extensions if ext.settings(opts)]


def _too_small(need: float, opts: RecommendOptions) -> InputError:
    return InputError(
        f"The budget is too small: the cheapest candidates need {need:.3f} bits per element at "
        f"{opts.context} tokens (windows of {listed(opts.window_sizes, '/')} tokens and "
        f"{opts.sink_tokens} sink tokens included), more than the {opts.budget_bits} asked "
        "for. Raise --budget-bits or --context, or offer smaller --windows.")


def cheapest_bits(meta, opts: RecommendOptions) -> float:
    """Bits per element the cheapest candidates ``opts`` offers need on the captured model
    (every config-wide variant tried; prices need no measurement); inf: none stores a layer."""
    cands = candidates(meta.shape.head_dim, opts, meta.shape.has_rope)
    table = {(c, s): (0.0, 0.0, 0.0) for c in cands for s in opts.streams()}
    tables = [table] * len(meta.layers)
    pricing = _Pricing(meta, opts, [1.0] * len(meta.layers))
    needs = [math.inf]
    for rot, m in pricing.variants():
        fronts = pricing.fronts(tables, rot, m)
        if all(fronts):
            needs.append(pricing.need(fronts))
    return min(needs)


def check_budget(meta, opts: RecommendOptions) -> None:
    """Refuse, before anything is measured, a budget that even the cheapest candidates
    ``opts`` offers on the captured model exceed."""
    need = cheapest_bits(meta, opts)
    if math.isfinite(need) and need > opts.budget_bits:
        raise _too_small(need, opts)


def assemble(meta, opts, tables, balancers, weights, notes, factors=()) -> Recommendation:
    """The ``Recommendation`` for ``opts.budget_bits`` from per-layer error ``tables``, layer
    ``weights`` (and per-layout ``factors``) on the captured model: the best allocation over
    the config-wide choices, its ``Choice`` s, config, bytes and decode costs."""
    n, shape = len(tables), meta.shape
    pricing = _Pricing(meta, opts, weights, factors)
    option = pricing.option

    def solve(rotation: bool, twin):
        """``((objective, fronts, picks), None)`` of the best allocation with or without
        rotated candidates, with twins at the config-wide ``twin`` setting (None: no twin),
        or ``(None, bits the cheapest options need)`` when nothing fits."""
        fronts = pricing.fronts(tables, rotation, twin)
        if not all(fronts):  # a layer with nothing to store it (e.g. only rotated layouts)
            return None, math.inf
        costs = [[p[0] for p in front] for front in fronts]
        errors = [[p[1] for p in front] for front in fronts]
        try:
            picks = allocate(costs, errors, n * (opts.budget_bits - pricing.reserve(fronts)))
        except InputError:  # what the allocation needs: its costs are rounded up per layer
            return None, pricing.need(fronts)
        return (sum(e[p] for e, p in zip(errors, picks)), fronts, picks), None

    # the shared rotation matrix is a fixed cost the knapsack cannot split over layers, and a
    # twin's setting is config-wide: solve for each (with and without rotated candidates; no
    # twin or each setting) and keep the best allocation
    solved = [(m, *solve(rot, m)) for rot, m in pricing.variants()]
    best = min((s for _, s, _ in solved if s is not None), key=lambda s: s[0], default=None)
    if best is None:
        raise _too_small(min(need for _, _, need in solved), opts)
    _, fronts, picks = best
    notes = notes + _twin_notes(opts, solved, best[0])
    choices, chosen = [], {}
    for layer, front, pick, table in zip(meta.layers, fronts, picks, tables):
        _, _, kc, vc, s = front[pick]
        chosen[layer] = (kc, vc, s)
        w = shape.window(layer)
        fp16 = tensor_fp16_bytes(shape, layer, opts.context)
        shares = dict(zip(("key", "value"), option(kc, vc, s, w)[1:]))
        for c in (kc, vc):
            out, score, recon = table[c, s]
            # the cheapest same-tensor candidate with a lower error (it did not fit the budget)
            better = []
            for o in (o for o, g in table if g == s and o.tensor == c.tensor
                      and o.twin == c.twin):
                pair = (o, vc) if c.tensor == "key" else (kc, o)
                if table[o, s][0] < out and opts.layer_flush(*pair, residual=s.residual) == \
                        s.flush:
                    share = option(*pair, s, w)[1 if c.tensor == "key" else 2]
                    better.append((16 * share / fp16, o.label))
            choices.append(Choice(layer, c.tensor, c, 16 * shares[c.tensor] / fp16, out, score,
                                  recon, min(better)[1] if better else "", s.flush,
                                  s.residual))
    expected = sum(ch.output_error for ch in choices) / len(choices)
    config = build_config(meta, opts, chosen, balancers)
    mean_bits = config_bits(config, shape, opts.context)
    rec = Recommendation(config, choices, opts.budget_bits, mean_bits, expected, opts.context,
                         weights=tuple(weights), notes=notes,
                         residual_tokens=config.default.residual_tokens,
                         sink_tokens=opts.sink_tokens, windows=opts.window_sizes)
    for ctx in (1024, 4096, 32768, 131072):
        rec.kv_bytes[ctx] = sum(config_part_bytes(config, shape, ctx).values())
        rec.kv_bytes_fp16[ctx] = shape.fp16_bytes(ctx)
    rec.decode_cost = decode_costs(config, shape, opts.context)
    if opts.prefer_fast and not rec.decode_cost[0][1].fused:
        raise ConfigError(f"internal: {{prefer_fast}}=on chose layouts without a fused path: "
                          f"{rec.decode_cost[0][1].unfused}")
    return rec
