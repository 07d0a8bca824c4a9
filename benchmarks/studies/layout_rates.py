"""Cheaper estimates of ``recommend``'s layout rates, against the measured ones (issue #35).

``recommend --sensitivity layout`` (what ``auto`` measures when the model loads) measures, per
layer and storage family, the model's KL when one layer's keys or values are replaced by a
probe's reconstruction, per unit of the probe's attention-output error: one perturbed forward per
layer and family (``kvlens.recommend.sensitivity.layout_factors``), most of ``recommend``'s time.
Both modes start from a full measurement (``kvlens.recommend.measure`` at the library's defaults,
``RecommendOptions(budget_bits=...)``, with the given options; pickled to ``OUT/measurement.pkl``
and reused when present), estimate the rates another way, allocate with each, score every
chosen config with the measured rates (the objective gap) and write the configs for a paired
KLD run (``OUT/measured-B.json`` beside ``OUT/fisher-B.json`` or ``OUT/short-B.json``).

``fisher``: gradient (Fisher) estimates from a few backward passes.

- with labels ``y`` sampled from the exact model at the last ``keep`` positions, ``g`` the
  gradient of ``sum_t log p(y_t)`` with respect to a layer's attention output (the input of
  its output projection), and ``d`` a probe's change of that output (computed from the
  capture's queries, keys and values), ``KL ≈ E[(g · d)²] / (2 keep)`` (Fisher information:
  the score's cross terms between predicted positions vanish in expectation). Estimator A
  sums ``(g_t · d_t)²`` over the attention-output positions ``t`` (drops the cross terms
  between them); estimator B squares the full sum ``(Σ_t g_t · d_t)²`` (unbiased, noisier);
- the rates (KL over the probe's output error, as ``layout_factors`` measures them) are
  normalised the same way (``kvlens.recommend.sensitivity.weights_and_factors``);
- the allocation runs with the measured rates, with estimator A's, and with a hybrid (each
  layer's anchor rates measured, the other families' ratios to them from A). The Fisher passes
  run on one thread; their wall time is printed beside the measured layout stage's.

``short``: the same perturbed forwards, of ``--short`` tokens (KL on the last half of those)
instead of ``--tokens``; prints the layout stage's wall time both ways (the same worker
processes as ``recommend``).

    python benchmarks/studies/layout_rates.py fisher run.h5 --window-dtype float8_e4m3fn --out fis/
    python benchmarks/studies/layout_rates.py fisher gemma.h5 --model gemma-3-270m-q4_k_m.gguf \\
        --window-dtype float8_e4m3fn --out fis-gemma/
    python benchmarks/studies/layout_rates.py short run.h5 --window-dtype float8_e4m3fn --out short/
    kvlens generate --eval kld --json --compare fis/measured-3.0.json,fis/fisher-3.0.json
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import time
from dataclasses import replace
from pathlib import Path
from statistics import correlation

import torch
from scipy.stats import spearmanr

from kvlens.analysis.attention import attention_output
from kvlens.analysis.metrics import attention_errors_many
from kvlens.capture.store import open_capture
from kvlens.config import save_config
from kvlens.model.architecture import attention_modules
from kvlens.recommend import RecommendOptions, candidates, choose, family, family_probes, measure
from kvlens.recommend.layer_errors import layer_variants
from kvlens.recommend.parallel import resolve_workers
from kvlens.recommend.probe import load_model_for
from kvlens.recommend.sensitivity import anchor_probes, layout_factors, weights_and_factors


def fisher_grads(model, ids, keep: int, samples: int, seed: int):
    """Per sample, per layer: the gradient ``[T, Hq * D]`` of ``sum log p(y)`` (``y`` sampled
    from the exact model at the last ``keep`` positions) with respect to the layer's
    attention output."""
    attns = attention_modules(model)
    hidden = attns[0].o_proj.in_features
    zs = [torch.zeros(1, ids.shape[1], hidden, requires_grad=True) for _ in attns]
    handles = [a.o_proj.register_forward_pre_hook(
        lambda mod, args, z=z: (args[0] + z.to(args[0].dtype),) + tuple(args[1:]))
        for a, z in zip(attns, zs)]
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    try:
        out = model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        logp = torch.log_softmax(out.logits[0, -keep:].float(), -1)
        probs = logp.detach().exp()
        grads = []
        for s in range(samples):
            y = torch.multinomial(probs, 1, generator=gen)[:, 0]
            total = logp.gather(-1, y[:, None]).sum()
            g = torch.autograd.grad(total, zs, retain_graph=s < samples - 1)
            grads.append([t[0].detach().float() for t in g])
    finally:
        for h in handles:
            h.remove()
    return grads


def fisher_rows(path, m, opts, probes, grads, n: int, keep: int):
    """Per layer ``{family: (rate A, rate B)}`` for every storage family probe in ``probes``."""
    one = replace(opts, samples=1, tokens=n)
    rows = []
    with open_capture(path) as cap:
        for layer in (cap.layer(i) for i in m.meta.layers):
            q, k, v, variants, _, _ = layer_variants(
                layer, m.meta, probes, one, m.balancers.get(layer.index))
            got = [c for c in probes if variants.get(c) is not None]
            la = layer.attrs
            kw = dict(scaling=la.scaling, sliding_window=la.sliding_window,
                      softcap=la.logit_softcap)
            errs = attention_errors_many(q[:, :, n - keep:], k, v, [variants[c] for c in got],
                                         reconstruction=False, **kw)
            exact = attention_output(q, k, v, **kw)
            row = {}
            for c, e in zip(got, errs):
                var, err = variants[c], float(e.output.mean())
                k_hat = var.k_hat if c.tensor == "key" else k
                v_hat = var.v_hat if c.tensor == "value" else v
                d = (attention_output(q, k_hat, v_hat, **kw) - exact)[0]  # [Hq, T, D]
                d = d.transpose(0, 1).reshape(d.shape[1], -1)  # [T, Hq * D], o_proj's input
                dots = torch.stack([(g[layer.index] * d).sum(-1) for g in grads])  # [S, T]
                a = float((dots ** 2).sum(-1).mean()) / (2 * keep)
                b = float((dots.sum(-1) ** 2).mean()) / (2 * keep)
                if err > 0:
                    row[family(c)] = (a / err, b / err)
            rows.append(row)
    return rows


def cached_measurement(capture, opts, out: Path):
    """``measure(capture, opts)``, pickled to ``out/measurement.pkl`` and read from there when
    present."""
    cached = out / "measurement.pkl"
    if cached.exists():
        return pickle.loads(cached.read_bytes())
    m = measure(capture, opts)
    cached.write_bytes(pickle.dumps(m))
    return m


def rates_of(weights, factors) -> list[dict]:
    """Per-layer ``{family: rate}`` from layer weights and per-family factors (weight x factor;
    the inverse of ``weights_and_factors`` up to its normalisation)."""
    return [{f: w * x for f, x in fac.items()} for w, fac in zip(weights, factors)]


def objective(rec, weights, factors) -> float:
    """``rec``'s allocation objective scored with ``weights`` and ``factors``."""
    return sum(weights[ch.layer] * factors[ch.layer].get(family(ch.candidate), 1.0)
               * ch.output_error for ch in rec.choices)


def compare(measured: list[dict], estimated: list[dict]) -> dict:
    """Log-rate correlation over every (layer, family), the mean within-layer rank
    correlation, and the correlation of the layer weights."""
    pairs = [(row_m[f], row_e[f]) for row_m, row_e in zip(measured, estimated)
             for f in row_m if f in row_e and row_m[f] > 0 and row_e[f] > 0]
    within = [float(spearmanr([rm[f] for f in common], [re[f] for f in common])[0])
              for rm, re in zip(measured, estimated)
              for common in [[f for f in rm if f in re]] if len(common) > 2]
    wm, _ = weights_and_factors(measured)
    we, _ = weights_and_factors(estimated)
    return {"log_rate_corr": correlation([math.log(a) for a, _ in pairs],
                                      [math.log(b) for _, b in pairs]),
            "within_layer_rank_corr": sum(within) / len(within) if within else float("nan"),
            "layer_weight_corr": correlation(wm, we), "pairs": len(pairs)}


def hybrid(measured: list[dict], estimated: list[dict], anchors: list[tuple]) -> list[dict]:
    """Each layer's anchor rates (``anchors``: the anchor families) measured; every other
    family's rate is its anchor's times the family's ratio to that anchor in ``estimated``."""
    out = []
    for row_m, row_e in zip(measured, estimated):
        row = {}
        for f in row_m:
            a = next((x for x in anchors if x[0] == f[0]), None)
            if a in row_m and a in row_e and f in row_e and row_e[a] > 0:
                row[f] = row_m[a] * row_e[f] / row_e[a]
            else:
                row[f] = row_m[f]
        out.append(row)
    return out


def measured_options(args) -> RecommendOptions:
    """What ``kvlens recommend CAPTURE -b 3.0`` measures with the given options (the budget is
    the allocation's only: ``measure`` does not read it)."""
    return RecommendOptions(budget_bits=3.0, model=args.model, fp_dtype=args.window_dtype)


def fisher(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = measured_options(args)
    m = cached_measurement(args.capture, opts, out)
    layout_s = m.profile.stages.get("layout sensitivity", float("nan"))
    measured = rates_of(m.weights, m.factors)

    with open_capture(args.capture) as cap:
        n = cap.meta.num_tokens if opts.tokens is None else min(opts.tokens,
                                                                  cap.meta.num_tokens)
        keep = n // 2
        ids = cap.tokens()[:1, :n]
        model, _ = load_model_for(cap, opts, [])
    torch.set_num_threads(1)
    probes = family_probes(candidates(m.meta.shape.head_dim, opts, m.meta.shape.has_rope))
    start = time.perf_counter()
    grads = fisher_grads(model, ids, keep, args.samples, args.seed)
    rows = fisher_rows(args.capture, m, opts, probes, grads, n, keep)
    fisher_s = time.perf_counter() - start
    est_a = [{f: r[0] for f, r in row.items()} for row in rows]
    est_b = [{f: r[1] for f, r in row.items()} for row in rows]
    mixed = hybrid(measured, est_a, [family(c) for c in anchor_probes(probes)])

    summary = {"capture": args.capture, "samples": args.samples, "tokens": n, "keep": keep,
               "fisher_seconds_one_thread": fisher_s, "measured_layout_stage_seconds": layout_s,
               "A": compare(measured, est_a), "B": compare(measured, est_b), "gaps": {}}
    print(f"Fisher rates: {args.samples} samples, {n} tokens (KL on the last {keep}); "
          f"{fisher_s:.1f} s on one thread (measured layout stage: {layout_s:.1f} s)")
    print("| estimator | log-rate corr. | within-layer rank corr. | layer-weight corr. |")
    print("|---|---:|---:|---:|")
    for name in ("A", "B"):
        c = summary[name]
        print(f"| {name} | {c['log_rate_corr']:.3f} | {c['within_layer_rank_corr']:.3f} | "
              f"{c['layer_weight_corr']:.3f} |")
    wm, fm = weights_and_factors(measured)
    print("\n| bits | objective gap, A rates | objective gap, hybrid |")
    print("|---:|---:|---:|")
    for b in (float(x) for x in args.bits.split(",")):
        ob = replace(opts, budget_bits=b)
        rec_m = choose(m, ob)
        base = objective(rec_m, wm, fm)
        gaps = {}
        for name, rates in (("fisher", est_a), ("hybrid", mixed)):
            w, f = weights_and_factors(rates)
            rec = choose(replace(m, weights=tuple(w), factors=tuple(f)), ob)
            gaps[name] = objective(rec, wm, fm) / base - 1
            if name == "fisher":
                save_config(rec.config, out / f"fisher-{b}.json")
        save_config(rec_m.config, out / f"measured-{b}.json")
        summary["gaps"][str(b)] = gaps
        print(f"| {b} | {gaps['fisher']:+.1%} | {gaps['hybrid']:+.1%} |")
    (out / "fisher_rates.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nconfigs and fisher_rates.json written to {out}/")


def short(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = measured_options(args)
    m = cached_measurement(args.capture, opts, out)
    full_s = m.profile.stages.get("layout sensitivity", float("nan"))
    measured = rates_of(m.weights, m.factors)

    # one window (the largest): the multi-window scoring rule (tokens > 3 x the largest
    # window) is for the candidate errors; a layout forward quantizes every token
    largest = max(opts.window_sizes)
    short_opts = replace(opts, tokens=args.short, windows=(largest,))
    with open_capture(args.capture) as cap:
        model, _ = load_model_for(cap, opts, [])
    cands = candidates(m.meta.shape.head_dim, opts, m.meta.shape.has_rope)
    workers = resolve_workers(opts.workers, float("inf"), m.meta.shape.num_layers)
    start = time.perf_counter()
    weights, factors = layout_factors(args.capture, model, short_opts, cands, m.balancers, [],
                                      None, workers)
    short_s = time.perf_counter() - start
    short_rates = rates_of(weights, factors)

    summary = {"capture": args.capture, "short_tokens": args.short, "tokens": opts.tokens,
               "layout_seconds": {"full": full_s, "short": short_s},
               "rates": compare(measured, short_rates), "gaps": {}}
    c = summary["rates"]
    print(f"layout stage: {full_s:.1f} s at {opts.tokens} tokens (the measurement), "
          f"{short_s:.1f} s at {args.short} tokens ({workers} worker processes)")
    print(f"rates at {args.short} against {opts.tokens} tokens: log-rate corr. "
          f"{c['log_rate_corr']:.3f}, within-layer rank corr. {c['within_layer_rank_corr']:.3f}, "
          f"layer-weight corr. {c['layer_weight_corr']:.3f} ({c['pairs']} rates)")
    wm, fm = weights_and_factors(measured)
    print("\n| bits | objective gap, short rates |\n|---:|---:|")
    for b in (float(x) for x in args.bits.split(",")):
        ob = replace(opts, budget_bits=b)
        rec_m = choose(m, ob)
        rec_s = choose(replace(m, weights=tuple(weights), factors=tuple(factors)), ob)
        gap = objective(rec_s, wm, fm) / objective(rec_m, wm, fm) - 1
        summary["gaps"][str(b)] = gap
        save_config(rec_m.config, out / f"measured-{b}.json")
        save_config(rec_s.config, out / f"short-{b}.json")
        same = sum(a == s for a, s in zip(rec_m.choices, rec_s.choices))
        print(f"| {b} | {gap:+.1%} | ({same} of {len(rec_m.choices)} choices the same)")
    (out / "short_layout_rates.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nconfigs and short_layout_rates.json written to {out}/")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("capture")
    common.add_argument("--model", default=None)
    common.add_argument("--window-dtype", default="float16")
    common.add_argument("--bits", default="3.0,2.5", help="budgets to allocate, comma list")
    f = sub.add_parser("fisher", parents=[common], help="gradient (Fisher) estimates")
    f.add_argument("--samples", type=int, default=8)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", default="fisher")
    s = sub.add_parser("short", parents=[common], help="forwards of fewer tokens")
    s.add_argument("--short", type=int, default=256, help="tokens of the shorter forwards")
    s.add_argument("--out", default="short")
    args = ap.parse_args(argv)
    fisher(args) if args.mode == "fisher" else short(args)


if __name__ == "__main__":
    main()
