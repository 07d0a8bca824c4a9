"""Layer weights (and per-layout factors) for the allocation's objective.

With ``sensitivity="model"`` each layer gets a weight ``w_l`` = KL damage of the real model's
predictions per unit of attention-output error, measured by probe-quantizing that layer alone
(``kvlens.analysis.sensitivity``; ``sensitivity_weights``, probes from ``probe_candidates``);
``layout`` (and ``auto`` when the model loads) measures a rate per layer and storage family
(``layout_factors``); ``uniform`` sets ``w_l = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvlens.analysis.compare import torch_threads
from kvlens.analysis.metrics import attention_errors_many
from kvlens.analysis.sensitivity import (
    PROBE_BITS,
    PROBE_GROUP,
    layer_kl,
    perturbed_kl,
    weights_from,
)
from kvlens.capture.store import open_capture
from kvlens.model.placement import input_device
from kvlens.recommend.catalog import family, family_probes
from kvlens.recommend.layer_errors import layer_variants
from kvlens.recommend.options import Candidate
from kvlens.recommend.parallel import can_fork, map_layers
from kvlens.recommend.profile import perturbed_work
from kvlens.text.selection import format_index_spec


def probe_candidates(head_dim: int) -> tuple[Candidate, Candidate]:
    """The (key, value) candidates that ``kvlens.analysis.sensitivity`` probe-quantizes a layer
    with: ``PROBE_BITS`` per-token at ``PROBE_GROUP`` (the whole head when it does not divide
    ``head_dim``)."""
    g = PROBE_GROUP if head_dim % PROBE_GROUP == 0 else head_dim
    return (Candidate("key", PROBE_BITS, "per-token", g),
            Candidate("value", PROBE_BITS, "per-token", g))


def sensitivity_weights(cap, model, opts, tables, probes, notes, progress
                        ) -> tuple[float, ...]:
    """Per-layer weights for ``--set sensitivity=model``: the model's KL when ``probes`` quantize
    one layer, per unit of their attention-output error in ``tables`` (every token quantized);
    all 1 for the other settings or without a model."""
    meta = cap.meta
    if opts.sensitivity in ("uniform", "layout", "auto") or model is None:
        return (1.0,) * len(meta.layers)
    n = meta.num_tokens if opts.tokens is None else min(opts.tokens, meta.num_tokens)
    ids = cap.tokens()[:1, :n].to(input_device(model))
    kl = layer_kl(model, ids, list(meta.layers), progress, group_size=probes[0].group_size)
    # the probe quantizes every token of the layer, so its error is measured that way too
    probe_err = [t[probes[0], None][0] + t[probes[1], None][0] for t in tables]
    weights = weights_from(kl, probe_err)
    notes.append("layer weights from measured sensitivity (KL per unit output error): "
                 f"min {min(weights):.2f}, max {max(weights):.2f} "
                 f"(layer {weights.index(max(weights))})")
    return tuple(weights)


def layout_factors(path, model, opts, cands, balancers, notes, progress, workers: int = 1):
    """``(layer weights, per-layer {family: factor})`` for ``--set sensitivity=layout``.

    A rate is the model's KL when one layer's keys (or values) are replaced by a family probe's
    reconstruction, per unit of the probe's attention-output error (the first sample cut to
    ``layout_tokens``, scored on its last half). Every layer measures two anchor families
    (``anchor_probes``); ``opts.layout_layers`` spread layers (``spread_layers``; None: all)
    measure every family, and elsewhere a family's rate is its anchor's times their ratio there.
    Rates are normalised to mean 1; a layer's weight is its mean rate, a family's factor its
    rate over that mean (docs/lab-notes/vs-llamacpp.md, layout sensitivity). Layers run on
    ``workers`` processes (``kvlens.recommend.parallel``); no capture may be open here."""

    with open_capture(path) as cap:
        meta = cap.meta
        n = layout_tokens(opts, meta.num_tokens)
        ids = cap.tokens()[:1, :n].to(input_device(model))
    keep = n // 2
    probes = family_probes(cands)
    anchors = anchor_probes(probes)
    every = set(spread_layers(meta.layers, opts.layout_layers))
    # the reconstructions of those n tokens (every token quantized: one window is as good
    # as several here, and lets n be shorter than --tokens)
    one = replace(opts, samples=1, tokens=n, windows=(max(opts.window_sizes),))
    workers = workers if can_fork() else 1
    work = _perturbed_work(model, meta, [len(probes if i in every else anchors)
                                         for i in meta.layers], n, keep)
    with perturbed_kl(model, ids, keep) as kl:
        _run["kl"] = kl  # read by the forked workers (a closure cannot be pickled)
        try:
            rates = map_layers(_layout_row, path, meta.layers,
                               (probes, anchors, every, one, keep, balancers),
                               workers, progress, label="layout sensitivity layer",
                               threads=torch.get_num_threads(), work=work)
        finally:
            _run.clear()
    rates = _shared_rates(rates, [family(c) for c in probes], [family(c) for c in anchors])
    weights, factors = weights_and_factors(rates)
    spread = [max(f.values()) / min(f.values()) for f in factors
              if f and min(f.values()) > 0]
    where = "every layer" if len(every) == len(meta.layers) else \
        f"layers {format_index_spec(sorted(every))} (the {len(anchors)} anchor families on the others)"
    notes.append(f"layer weights and per-layout factors from measured KL ({len(probes)} storage "
                 f"families on {where}; KL on the last {keep} of {n} capture tokens): weights "
                 f"{min(weights):.2f}-{max(weights):.2f}, largest factor ratio within a layer "
                 f"{max(spread, default=1.0):.1f}")
    return tuple(weights), tuple(factors)


def layout_tokens(opts, capture_tokens: int) -> int:
    """Tokens of the layout sensitivity's forwards: ``opts.layout_tokens`` (else
    ``opts.tokens``, else the whole sample), at most the capture's."""
    want = opts.layout_tokens or opts.tokens
    return capture_tokens if want is None else min(want, capture_tokens)


def weights_and_factors(rates: Sequence[dict]) -> tuple[list[float], list[dict]]:
    """Per-layer ``{family: rate}`` -> ``(layer weights, per-layer {family: factor})``: the rates
    normalised to mean 1 over all layers and families, a layer's weight its mean rate, a
    family's factor its rate over that mean (weight x factor is the normalised rate)."""
    known = [r for row in rates for r in row.values()]
    mean = sum(known) / len(known) if known and sum(known) > 0 else 1.0
    weights, factors = [], []
    for row in rates:
        w = sum(row.values()) / len(row) / mean if row else 1.0
        weights.append(w)
        factors.append({f: r / mean / w if w > 0 else 1.0 for f, r in row.items()})
    return weights, factors


_run: dict = {}


def _perturbed_work(model, meta, runs: Sequence[int], tokens: int, keep: int
                    ) -> list[float] | None:
    """``kvlens.recommend.profile.perturbed_work`` for ``model``: a decoder layer's FLOPs over
    ``tokens``, the LM head's over the ``keep`` scored ones (None, equal work, without a head
    to count)."""
    if model.get_output_embeddings() is None:
        return None
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - head.numel() - \
        (0 if emb is head else emb.numel())
    layers = meta.shape.num_layers
    return perturbed_work(meta.layers, runs, layers, 2 * body / layers * tokens,
                          2 * head.numel() * keep)


def _layout_row(layer, meta, probes, anchors, every, opts, keep, balancers) -> dict:
    """One layer's ``{family: KL rate}`` (``layout_factors``' work on ``map_layers``)."""
    kl = _run["kl"]
    n = opts.tokens
    measured = probes if layer.index in every else anchors
    with torch_threads(1):  # small attention passes: one thread (see measure)
        q, k, v, variants, _, _ = layer_variants(layer, meta, measured, opts,
                                                 balancers.get(layer.index))
        got = [c for c in measured if variants.get(c) is not None]
        la = layer.attrs
        errs = attention_errors_many(q[:, :, n - keep:], k, v, [variants[c] for c in got],
                                     scaling=la.scaling, sliding_window=la.sliding_window,
                                     softcap=la.logit_softcap, sinks=la.sinks,
                                     reconstruction=False)
    row = {}
    for c, e in zip(got, errs):
        var, err = variants[c], float(e.output.mean())
        damage = kl(layer.index, key=var.k_hat - k) if c.tensor == "key" else \
            kl(layer.index, value=var.v_hat - v)
        if err > 0:
            row[family(c)] = damage / err
    return row


def anchor_probes(probes: Sequence[Candidate]) -> list[Candidate]:
    """The probes every layer measures (``layout_factors``): KIVI's layouts where offered,
    plain post-RoPE min/max per-channel keys and per-token values, else the first key and
    value family probes."""
    def plain(c: Candidate, granularity: str) -> bool:
        return (c.granularity == granularity and c.stage == "post" and not c.balancer
                and not c.rotate and c.fit == "minmax")

    out = []
    for tensor, granularity in (("key", "per-channel"), ("value", "per-token")):
        mine = [c for c in probes if c.tensor == tensor]
        out += [c for c in mine if plain(c, granularity)][:1] or mine[:1]
    return out


def spread_layers(layers: Sequence[int], count: int | None) -> list[int]:
    """``count`` layers spread evenly over ``layers`` (the first and the last included); every
    layer when ``count`` is None or not smaller."""
    layers = list(layers)
    if count is None or count >= len(layers):
        return layers
    if count == 1:
        return [layers[len(layers) // 2]]
    return sorted({layers[round(i * (len(layers) - 1) / (count - 1))] for i in range(count)})


def _shared_rates(rates: list[dict], families: Sequence[tuple], anchors: Sequence[tuple]
                  ) -> list[dict]:
    """Fill each layer's missing family rates: its anchor's rate there times the family's
    ratio to the anchor, summed over the layers that measured both (so the layers where the
    model is most sensitive count most, and a rate of 0 is a rate like any other)."""
    anchor = {f: next((a for a in anchors if a[0] == f[0]), None) for f in families}
    ratio = {}
    for f, a in anchor.items():
        both = [row for row in rates if f in row and a in row]
        below = sum(row[a] for row in both)
        if below > 0:
            ratio[f] = sum(row[f] for row in both) / below
    return [row | {f: row[anchor[f]] * r for f, r in ratio.items()
                   if f not in row and anchor[f] in row} for row in rates]
