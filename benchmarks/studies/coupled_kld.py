"""Coupled (CQ) cache configs against today's recommendation at equal held bits, paired KLD
(issue #50, the ablation that decides; docs/lab-notes/coupled.md).

    python benchmarks/studies/coupled_kld.py CAPTURE.h5 --out DIR [--bits 2.0,2.5,3.0]
        [--settings c4b6,c2b4,c4b8,c2b5,c2b6] [--weighted-keys] [--samples 0,1]
        [--eval [--eval-tokens 4096] [--text PATH] [--model SPEC]]

Per budget ``B`` (``--bits``): today's default, ``recommend`` at ``B``
(``RecommendOptions(budget_bits=B)``, the library's defaults: one measurement of the capture,
then ``choose`` per budget), written to ``DIR/recommend-B.json``; and a coupled config
(``kvlens.recommend.coupled``): every layer's keys and values coded with one coupled setting,
beside recommend's default window (128 tokens, flushed 32 at a time) and 4 exact sinks, its
codebooks fitted on the capture's samples (``--samples``; default all: the capture's text only,
never the evaluation text), written to ``DIR/coupled-B.json``. The coupled setting of a budget is
the one of ``--settings`` with the most index bits per channel whose config holds at most ``B``
bits per element at ``--eval-tokens`` tokens of one sequence (``kvlens.cache.layout.config_bits``:
indices, codebooks, window and sinks all counted); keys ``+weighted`` with ``--weighted-keys``.

With ``--eval`` each pair is scored by ``kvlens.evaluation.evaluate_configs`` (what ``kvlens
generate --eval kld --compare recommend-B.json,coupled-B.json`` runs): mean KLD against the exact
model over ``--eval-tokens`` tokens of the held-out text (``--text`` for a fresh span), and the
coupled config's paired difference to the recommendation (``vs_first``: a 95% bootstrap
interval and its verdict). Results go to ``DIR/coupled_kld.json`` and a table. CPU cost: the
recommendation's measurement (minutes), the k-means fits (about a minute per setting on
SmolLM2's capture) and, with ``--eval``, two configs plus the exact model per budget; the
coupled read path is a research path (torch only, no Triton kernel).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

DEFAULT_SETTINGS = "c4b4,c4b6,c2b3,c2b4,c4b8,c2b5,c4b10,c2b6,c2b7"


def pick_setting(settings, budget: float, shape, tokens: int, weighted: bool):
    """``(key spec, value spec, bits)``: the setting of ``settings`` with the most index bits per
    channel whose config holds at most ``budget`` bits at ``tokens`` tokens, or None."""
    from kvlens.cache.layout import config_bits
    from kvlens.recommend.coupled import coupled_config

    best = None
    for spec in settings:
        key = replace(spec, weighted=True) if weighted else spec
        priced = coupled_config("priced", key, spec, None, shape.num_layers)
        bits = config_bits(priced, shape, tokens)
        if bits <= budget and (best is None or spec.bits_per_channel > best[0].bits_per_channel):
            best = (spec, key, bits)
    return None if best is None else (best[1], best[0], best[2])


def build(args, log) -> list[dict]:
    """The configs of every budget: ``[{budget, recommend, coupled, bits...}]``."""
    from kvlens.cache.layout import config_bits
    from kvlens.config import save_config
    from kvlens.quant.coupled import parse_coupled
    from kvlens.recommend import RecommendOptions, choose, measure
    from kvlens.recommend.coupled import capture_shape, coupled_config, fit_codebooks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = capture_shape(args.capture)
    settings = [parse_coupled(s) for s in args.settings.split(",") if s.strip()]
    samples = None if not args.samples else [int(s) for s in args.samples.split(",")]
    budgets = [float(b) for b in args.bits.split(",") if b.strip()]
    opts = RecommendOptions(budget_bits=max(budgets), model=args.model)
    log("measuring the capture (recommend's defaults)")
    measured = measure(args.capture, opts)
    fitted: dict = {}
    rows = []
    for b in budgets:
        rec = choose(measured, replace(opts, budget_bits=b))
        rec_cfg = replace(rec.config, name=f"recommend-{b:g}")
        save_config(rec_cfg, out / f"recommend-{b:g}.json")
        row = {"budget": b, "recommend": rec_cfg.name,
               "recommend_bits": config_bits(rec_cfg, shape, args.eval_tokens)}
        picked = pick_setting(settings, b, shape, args.eval_tokens, args.weighted_keys)
        if picked is None:
            log(f"{b:g}: no coupled setting of --settings fits; skipped")
            rows.append(row | {"coupled": None})
            continue
        key, value, _ = picked
        if (key, value) not in fitted:
            log(f"{b:g}: fitting {key.name} keys and {value.name} values on the capture")
            fitted[key, value] = fit_codebooks(args.capture, key, value, samples)
        cfg = coupled_config(f"coupled-{b:g}", key, value, fitted[key, value], shape.num_layers)
        save_config(cfg, out / f"coupled-{b:g}.json")
        rows.append(row | {"coupled": cfg.name, "key": key.name, "value": value.name,
                           "coupled_bits": config_bits(cfg, shape, args.eval_tokens)})
        log(f"{b:g}: recommend {row['recommend_bits']:.3f} bits, coupled {key.name}/"
            f"{value.name} {rows[-1]['coupled_bits']:.3f} bits")
    return rows


def evaluate(args, rows, log) -> None:
    """Score each budget's pair (``evaluate_configs``) into ``rows``."""
    from kvlens.capture.store import open_capture
    from kvlens.config import load_config
    from kvlens.evaluation import EvalOptions, evaluate_configs
    from kvlens.model.load import load_model
    from kvlens.recommend import model_spec_from_capture

    spec = args.model
    if spec is None:
        with open_capture(args.capture) as cap:
            spec = model_spec_from_capture(cap.meta)
    model, tok, _ = load_model(spec)
    out = Path(args.out)
    for row in rows:
        if row.get("coupled") is None:
            continue
        configs = [load_config(out / f"{row[n]}.json") for n in ("recommend", "coupled")]
        report = evaluate_configs(model, tok, configs,
                                  EvalOptions(evals=("kld",), eval_tokens=args.eval_tokens,
                                              text=args.text), progress=log)
        rec, ours = report["results"]
        row["recommend_kld"] = rec["kld"]["mean_kld"]
        row["coupled_kld"] = ours["kld"]["mean_kld"]
        row["paired"] = (ours["kld"].get("vs_first") or {}).get("mean_kld")


def table(rows) -> str:
    lines = ["| budget | recommend bits | KLD | coupled (K / V) | bits | KLD | coupled - "
             "recommend [95% CI] |", "|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        if r.get("coupled") is None:
            lines.append(f"| {r['budget']:g} | {r['recommend_bits']:.3f} | - | none fits | - "
                         "| - | - |")
            continue
        kld = {k: (f"{r[k]['value']:.4f}" if r.get(k) else "-")
               for k in ("recommend_kld", "coupled_kld")}
        p = r.get("paired")
        diff = "-" if not p else (f"{p['diff']:+.4f} [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] "
                                  f"{p['verdict']}")
        lines.append(f"| {r['budget']:g} | {r['recommend_bits']:.3f} | {kld['recommend_kld']} | "
                     f"{r['key']} / {r['value']} | {r['coupled_bits']:.3f} | "
                     f"{kld['coupled_kld']} | {diff} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--out", required=True, help="folder for the configs and coupled_kld.json")
    ap.add_argument("--bits", default="2.0,2.5,3.0", help="budgets (held bits), comma list")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help="coupled settings to choose from (kvlens.quant.coupled.parse_coupled)")
    ap.add_argument("--weighted-keys", action="store_true",
                    help="keys fitted and coded with the query-weighted distance")
    ap.add_argument("--samples", default="", help="capture samples the codebooks are fitted "
                                                  "on, comma list (default: all)")
    ap.add_argument("--model", default=None, help="default: the capture's model")
    ap.add_argument("--eval", action="store_true", help="score the pairs (paired KLD)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--text", default=None, help="evaluation text (default: the held-out text)")
    args = ap.parse_args(argv)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    rows = build(args, log)
    if args.eval:
        evaluate(args, rows, log)
    doc = {"capture": args.capture, "eval_tokens": args.eval_tokens, "text": args.text,
           "settings": args.settings, "weighted_keys": args.weighted_keys, "rows": rows}
    (Path(args.out) / "coupled_kld.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(rows))


if __name__ == "__main__":
    main()
