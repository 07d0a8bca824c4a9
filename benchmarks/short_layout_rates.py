"""Layout rates from shorter forwards: as good as recommend's, at what saving? (issue #35)

``recommend``'s layout stage (``kvlens.recommend.sensitivity.layout_factors``) runs one forward
of the capture's first ``--tokens`` (512 by default) tokens per layer and storage family, KL on
the last half; it is most of ``recommend``'s time. This script measures the same rates with
forwards of ``--short`` tokens (KL on the last half of those), compares them with the rates of a
full measurement (``kvlens.recommend.measure`` at ``kvlens recommend``'s defaults with the given
options; pickled to ``OUT/measurement.pkl`` and reused when present), allocates with each, scores
both configs with the full measurement's rates (the objective gap) and writes them for a paired
KLD run:

    python benchmarks/short_layout_rates.py run.h5 --window-dtype float8_e4m3fn --out short/
    kvlens generate --eval kld --json --compare short/measured-3.0.json,short/short-3.0.json

It prints the layout stage's wall time both ways (the same worker processes as ``recommend``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from fisher_rates import cached_measurement, compare, objective, rates_of
from recommend_ablation import cli_options

from kvlens.capture.store import open_capture
from kvlens.config import save_config
from kvlens.recommend import candidates, choose
from kvlens.recommend.parallel import resolve_workers
from kvlens.recommend.probe import load_model_for
from kvlens.recommend.sensitivity import layout_factors, weights_and_factors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--model", default=None)
    ap.add_argument("--window-dtype", default="float16")
    ap.add_argument("--short", type=int, default=256, help="tokens of the shorter forwards")
    ap.add_argument("--bits", default="3.0,2.5")
    ap.add_argument("--out", default="short")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = replace(cli_options(3.0, args.model), fp_dtype=args.window_dtype)

    m = cached_measurement(args.capture, opts, out)
    full_s = m.profile.stages.get("layout sensitivity", float("nan"))
    measured = rates_of(m.weights, m.factors)

    # one window (the largest): the multi-window scoring rule (tokens > 3 x the largest
    # window) is for the candidate errors; a layout forward quantizes every token
    largest = max(opts.windows or (opts.residual_tokens,))
    short_opts = replace(opts, tokens=args.short, windows=(largest,), residual_tokens=largest)
    with open_capture(args.capture) as cap:
        model, _ = load_model_for(cap, opts, [])
    cands = candidates(m.meta.head_dim, opts, m.meta.has_rope)
    workers = resolve_workers(opts.workers, float("inf"), m.meta.num_layers)
    start = time.perf_counter()
    weights, factors = layout_factors(args.capture, model, short_opts, cands, m.balancers, [],
                                      None, m.codebooks, workers)
    short_s = time.perf_counter() - start
    short = rates_of(weights, factors)

    summary = {"capture": args.capture, "short_tokens": args.short, "tokens": opts.tokens,
               "layout_seconds": {"full": full_s, "short": short_s},
               "rates": compare(measured, short), "gaps": {}}
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


if __name__ == "__main__":
    main()
