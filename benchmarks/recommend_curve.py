"""Budget/quality curve: recommendations at several bit budgets vs the presets, on SmolLM2.

Measures the capture once at the library's defaults (``RecommendOptions(budget_bits=B)``: what
``kvlens recommend -b B`` runs), allocates a config per budget, then runs decode-mode perplexity
(and optionally passkey) for fp16, the presets and each recommendation on the same text, with the
capture's model (or ``--model``). Bits are the
held-bytes accounting of ``kvlens.cache.layout.config_bits`` at --context tokens (fp16 scales/zeros and
residual window), identical for presets and recommendations. Writes a PNG plot and a JSON.

Usage: python benchmarks/recommend_curve.py RUN.h5 [--budgets 2.5,3,3.5,4,5] [--out docs/img]
       python benchmarks/recommend_curve.py --replot docs/img/recommend_curve.json
(the second form redraws the PNG from measured rows, e.g. after editing the JSON by hand with
the figures of separate runs).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

PRESETS = ("kivi-2", "kivi-2-sinks", "kivi-4", "per-token-2", "per-token-4")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture", nargs="?")
    ap.add_argument("--model", help="model for recommend and the evaluation (default: the "
                                    "capture's)")
    ap.add_argument("--replot", help="Redraw the PNG next to this JSON of measured rows.")
    ap.add_argument("--budgets", default="2.5,3,3.5,4,5")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--passkey-prompts", type=int, default=0)
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args(argv)
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())
        _plot(rows, Path(args.replot).with_suffix(".png"), args.context)
        return
    if not args.capture:
        ap.error("a capture file is needed (or --replot JSON)")

    from kvlens.cache.layout import config_bits
    from kvlens.capture.source import CaptureModel
    from kvlens.config import preset
    from kvlens.errors import InputError
    from kvlens.evaluation import EvalOptions, evaluate_configs
    from kvlens.recommend import RecommendOptions, choose, measure

    t0 = time.perf_counter()
    budgets = [float(b) for b in args.budgets.split(",")]
    opts = RecommendOptions(budget_bits=budgets[0], context=args.context, model=args.model)
    m = measure(args.capture, opts)
    recs = {}
    for b in budgets:
        try:
            rec = choose(m, replace(opts, budget_bits=b))
        except InputError as exc:  # e.g. 2.5 bits at 4096 tokens: below any layout
            print(f"budget {b:g}: skipped ({exc})")
            continue
        recs[b] = replace(rec.config, name=f"recommended-{b:g}")
    model, tok = CaptureModel(args.capture, args.model).get()
    configs = [preset(p) for p in PRESETS] + list(recs.values())
    evals = ("ppl",) + (("passkey",) if args.passkey_prompts else ())
    report = evaluate_configs(model, tok, configs, EvalOptions(
        evals=evals, ppl_tokens=args.ppl_tokens, passkey_prompts=args.passkey_prompts),
        progress=lambda msg: print("  " + msg, flush=True))
    shape = m.meta.shape
    rows = []
    for cfg, res in zip(configs, report["results"]):
        rows.append({"name": res["name"], "bits": config_bits(cfg, shape, args.context),
                     "ppl": res["ppl"], "ppl_fp16": res["ppl_fp16"],
                     "ppl_change": res["ppl_change"], "passkey": res.get("passkey")})
    print(f"{'config':<18} {'bits@' + str(args.context):>10} {'ppl':>8} {'change':>8}  passkey")
    for r in rows:
        pk = r["passkey"]
        pk = f"{pk['correct']}/{pk['total']}" if pk else "-"
        print(f"{r['name']:<18} {r['bits']:>10.3f} {r['ppl']:>8.3f} {100 * r['ppl_change']:>7.2f}%"
              f"  {pk}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recommend_curve.json").write_text(json.dumps(rows, indent=2) + "\n")
    _plot(rows, out / "recommend_curve.png", args.context)


def _plot(rows, path: Path, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    rec = sorted((r for r in rows if r["name"].startswith("recommended")), key=lambda r: r["bits"])
    ax.plot([r["bits"] for r in rec], [100 * r["ppl_change"] for r in rec], "o-",
            label="kvlens recommend (per budget)")
    for r in rows:
        if not r["name"].startswith("recommended"):
            ax.scatter(r["bits"], 100 * r["ppl_change"], marker="s")
            ax.annotate(r["name"], (r["bits"], 100 * r["ppl_change"]), textcoords="offset points",
                        xytext=(5, 4), fontsize=8)
    ax.set_xlabel(f"stored bits per K/V element at {context} tokens (all overheads)")
    ax.set_ylabel("decode-mode perplexity change vs fp16 (%)")
    ax.set_yscale("log")  # all changes are positive; log shows 0.7% and 20% together
    for r in rec:
        ax.annotate(r["name"].replace("recommended-", "B="), (r["bits"], 100 * r["ppl_change"]),
                    textcoords="offset points", xytext=(5, -10), fontsize=7)
    ax.set_title("SmolLM2-135M-Instruct: KV bits vs perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
