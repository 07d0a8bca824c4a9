"""Ablation of ``kvlens recommend``'s levers: what each one buys at a fixed budget.

For one capture and budget, writes the full recommendation and one recommendation per lever
switched off, then (``--eval``) scores every distinct config in one lockstep KL-divergence run
on the built-in held-out text (``kvlens.evaluation.evaluate_configs``: the first config, the full recommendation,
is the paired reference):

    OMP_NUM_THREADS=1 python benchmarks/studies/recommend_ablation.py run.h5 -b 3.0 --out abl/ --eval
    OMP_NUM_THREADS=1 python benchmarks/studies/recommend_ablation.py gemma.h5 -b 4.85 \\
        --model gemma-3-270m-Q4_K_M.gguf --out abl-gemma/ --eval

Levers (each row: the full recommendation's options with that one lever off):

- candidate families, filtered from one measurement: ``rotation`` (Hadamard-rotated per-token
  candidates), ``balancer`` (MiKV channel balancer on per-token keys), ``pre-rope`` (keys
  quantized before RoPE), ``transforms`` (all three);
- ``sensitivity``: uniform weights instead of the model's measured KL damage per unit error
  (the KLD-driven allocation);
- ``layout`` (re-measured): one weight per layer (``--sensitivity model``) instead of one per
  layer and storage family;
- re-measured: ``retrieval`` (no retrieval probe), ``sinks`` (``--sinks 0``), ``sliding``
  (``--flush 0``: KIVI's flush-the-whole-window instead of the sliding window), ``windows``
  (one 128-token window for every layer, errors scored on the same late queries as with
  several windows: the per-layer window alone), ``windows+proxy`` (``--residual 128``: one
  window and errors over every query of the first 256 tokens, recommend's behaviour before
  per-layer windows).

The full recommendation uses the library's defaults, ``RecommendOptions(budget_bits=B,
model=M)``: what ``kvlens recommend -b B [--model M]`` runs.

``--variant KEY=VALUE[,KEY=VALUE...]`` (repeatable) adds re-measured rows with other
``RecommendOptions`` (e.g. ``retrieval_tokens=2000``, ``tokens=1024``), named by the overrides:
what a changed default would buy, before it is re-checked on fresh text. Candidates that are
off by default are such rows: ``--variant mikv=true`` (MiKV twins, ``--set mikv=on``).

Configs that come out identical to the full recommendation are reported as such and not
evaluated again. Prints a markdown table and writes ``OUT/ablation.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

# levers on by default, switched off; the opt-in candidates (MiKV) are --variant rows
# that switch them on
FAMILIES = {"rotation": {"rotation": False}, "balancer": {"balancer": False},
            "pre-rope": {"pre_rope": "off"},
            "transforms": {"rotation": False, "balancer": False, "pre_rope": "off"}}
REMEASURED = {"layout": {"sensitivity": "model"}, "retrieval": {"retrieval": "off"}, "sinks": {"sink_tokens": 0},
              "sliding": {"flush_tokens": 0}, "windows": {"windows": (128,)},
              "windows+proxy": {"windows": (128,), "tokens": 256}}
LEVERS = ("rotation", "balancer", "pre-rope", "transforms", "sensitivity", "layout",
          "retrieval", "sinks", "sliding", "windows", "windows+proxy")


def _one_window_same_queries(opts, **changes):
    """``opts`` with ``changes`` whose errors are still scored from ``opts.score_from`` on
    (``RecommendOptions`` scores every query when it has one window)."""
    start = opts.score_from

    class SameQueries(type(opts)):
        @property
        def score_from(self) -> int:
            return start

    return SameQueries(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__},
                          **changes})


def parse_variant(spec: str, opts) -> dict:
    """``"retrieval_tokens=2000,tokens=512"`` -> typed ``RecommendOptions`` overrides."""
    import typing
    from dataclasses import fields

    hints = typing.get_type_hints(type(opts))
    names = {f.name for f in fields(opts)}
    out = {}
    for item in spec.split(","):
        key, _, raw = item.partition("=")
        if key not in names:
            raise SystemExit(f"--variant: unknown option {key!r}; allowed: {sorted(names)}")
        kind = hints[key]
        if kind in (int, float, str, bool):
            out[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
        elif raw.lower() in ("none", "null"):
            out[key] = None
        elif "tuple" in str(kind):
            out[key] = tuple(_scalar(x) for x in raw.split("/"))
        else:  # int | None, int | str | None and the like
            out[key] = _scalar(raw)
    return out


def _scalar(raw: str):
    """``"4"`` -> 4, ``"0.1"`` -> 0.1, anything else (``"auto"``, ``"mse"``) the string."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def recommendations(capture: str, opts, levers, log, variants=(), budgets=()) -> dict:
    """``{row name: Recommendation}``: "full", one per lever off, one per variant, and
    "recommend-B" for each other budget ``B`` (from the full measurement)."""
    from kvlens.recommend import candidates, choose, measure

    t0 = time.time()
    full_m = measure(capture, opts)
    log(f"measured full candidate set in {time.time() - t0:.0f} s")
    recs = {"full": choose(full_m, opts)}
    for b in budgets:
        try:
            recs[f"recommend-{b:g}"] = choose(full_m, replace(opts, budget_bits=b))
        except Exception as exc:  # e.g. below the cheapest layouts
            log(f"budget {b:g}: {exc}")
            recs[f"recommend-{b:g}"] = exc
    meta = full_m.meta
    for lever in levers:
        if lever in FAMILIES:
            lopts = replace(opts, **FAMILIES[lever])
            wanted = set(candidates(meta.shape.head_dim, lopts, meta.shape.has_rope))
            tables = [{cf: e for cf, e in t.items() if cf[0] in wanted} for t in full_m.tables]
            m = replace(full_m, tables=tables)
        elif lever == "sensitivity":
            lopts = opts
            m = replace(full_m, weights=(1.0,) * len(full_m.weights), factors=())
        else:
            lopts = (_one_window_same_queries(opts, **REMEASURED[lever]) if lever == "windows"
                     else replace(opts, **REMEASURED[lever]))
            t0 = time.time()
            m = measure(capture, lopts)
            log(f"re-measured without {lever} in {time.time() - t0:.0f} s")
        try:
            recs[f"no-{lever}"] = choose(m, lopts)
        except Exception as exc:  # e.g. infeasible budget without a lever: a row that says so
            log(f"no-{lever}: {exc}")
            recs[f"no-{lever}"] = exc
    for spec in variants:
        vopts = replace(opts, **parse_variant(spec, opts))
        t0 = time.time()
        m = measure(capture, vopts)
        log(f"measured variant {spec} in {time.time() - t0:.0f} s")
        try:
            recs[spec] = choose(m, vopts)
        except Exception as exc:
            log(f"{spec}: {exc}")
            recs[spec] = exc
    return recs


def _fmt(stat: dict, digits: int = 4) -> str:
    lo, hi = stat["ci95"]
    return f"{stat['value']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def table(rows: list[dict]) -> str:
    head = ("| lever off | held bits | layers changed | mean KLD [95%] | top-1 [95%] | "
            "ppl change [95%] | vs full: mean KLD |\n|---|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        k = r.get("kld")
        if r.get("error"):
            lines.append(f"| {r['row']} | - | - | {r['error']} | | | |")
            continue
        if k is None:
            same = f"same config as {r['same_as']}" if r.get("same_as") else "not evaluated"
            lines.append(f"| {r['row']} | {r['predicted_bits']:.3f} | {r['changed']} | "
                         f"{same} | | | |")
            continue
        pc = k["ppl_change"]
        ppl = f"{100 * pc['value']:+.1f}% [{100 * pc['ci95'][0]:+.1f}, {100 * pc['ci95'][1]:+.1f}]"
        vs = k.get("vs_first")
        vs = "-" if not vs else (f"{vs['mean_kld']['diff']:+.4f} [{vs['mean_kld']['ci95'][0]:+.4f},"
                                 f" {vs['mean_kld']['ci95'][1]:+.4f}] {vs['mean_kld']['verdict']}")
        lines.append(f"| {r['row']} | {r['bits']:.3f} | {r['changed']} | {_fmt(k['mean_kld'])} | "
                     f"{_fmt(k['top1_agreement'], 3)} | {ppl} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("capture")
    ap.add_argument("-b", "--budget-bits", type=float, required=True)
    ap.add_argument("--model", help="model for sensitivity, probe and --eval (default: the "
                                    "capture's)")
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--variant", action="append", default=[],
                    help="KEY=VALUE[,KEY=VALUE]: a row with other RecommendOptions "
                         "(tuples as 32/64)")
    ap.add_argument("--budgets", default="",
                    help="other budgets, comma list: rows recommend-B from the full measurement")
    ap.add_argument("--presets", default="",
                    help="presets to score beside the configs, comma list (e.g. kivi-2,kivi-4)")
    ap.add_argument("--out", required=True, help="folder for the configs and ablation.json")
    ap.add_argument("--eval", action="store_true", help="score the configs (KLD, 4096 tokens)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    levers = [x for x in args.levers.split(",") if x and x != "none"]
    bad = [x for x in levers if x not in LEVERS]
    if bad:
        opt_in = [x for x in bad if x == "mikv"]
        hint = (f" ({', '.join(opt_in)}: off by default, so measure them on with "
                f"{' '.join(f'--variant {x}=true' for x in opt_in)})" if opt_in else "")
        ap.error(f"unknown levers {bad}; allowed: {', '.join(LEVERS)}{hint}")

    from kvlens.config import save_config
    from kvlens.recommend import RecommendOptions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    opts = RecommendOptions(budget_bits=args.budget_bits, model=args.model)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    recs = recommendations(args.capture, opts, levers, log, args.variant, budgets)
    rows, configs, seen = [], [], {}
    full_layers = None
    for row, rec in recs.items():
        if isinstance(rec, Exception):
            rows.append({"row": row, "error": str(rec).split(";")[0]})
            continue
        doc = rec.config.to_dict()
        layers = [(c.layer, c.tensor, c.candidate.label, c.residual_tokens, c.flush_tokens)
                  for c in rec.choices]
        full_layers = full_layers or layers
        changed = len({a[0] for a, b in zip(layers, full_layers) if a != b})
        key = json.dumps({k: v for k, v in doc.items() if k not in ("name", "description")},
                         sort_keys=True)
        r = {"row": row, "predicted_bits": rec.mean_bits, "changed": changed,
             "expected_output_error": rec.expected_output_error}
        if key in seen:
            r["same_as"] = seen[key]
        else:
            seen[key] = row
            if row.startswith("recommend-"):  # a budget row keeps its name (plots read it)
                configs.append((row, replace(rec.config, name=row)))
                save_config(configs[-1][1], out / f"{row}.json")
                rows.append(r)
                continue
            slug = row.replace("=", "-").replace(",", "_").replace("/", "+")
            cfg = replace(rec.config, name=f"recommend-{args.budget_bits:g}" if row == "full"
                          else f"rec-{slug}")
            save_config(cfg, out / f"{slug}.json")
            configs.append((row, cfg))
        rows.append(r)
        log(f"{row}: {rec.mean_bits:.3f} bits, {changed} layers changed, expected error "
            f"{rec.expected_output_error:.4f}{' (same as ' + r['same_as'] + ')' if 'same_as' in r else ''}")
    if args.eval:
        from kvlens.capture.source import CaptureModel
        from kvlens.evaluation import EvalOptions, evaluate_configs

        model, tok = CaptureModel(args.capture, args.model).get()
        from kvlens.config import preset

        for name in (x for x in args.presets.split(",") if x.strip()):
            configs.append((name, preset(name)))
            rows.append({"row": name, "predicted_bits": float("nan"), "changed": "-"})
        t0 = time.time()
        report = evaluate_configs(model, tok, [c for _, c in configs],
                                  EvalOptions(evals=("kld",), eval_tokens=args.eval_tokens),
                                  progress=log)
        log(f"evaluated {len(configs)} configs in {time.time() - t0:.0f} s")
        by_row = {row: res for (row, _), res in zip(configs, report["results"])}
        for r in rows:
            res = by_row.get(r["row"])
            if res and "kld" in res:
                r["kld"], r["bits"] = res["kld"], res["bits_per_element"]
        (out / "evaluation.json").write_text(json.dumps(report, indent=1, default=str))
    doc = {"capture": args.capture, "budget_bits": args.budget_bits, "model": args.model,
           "eval_tokens": args.eval_tokens if args.eval else None, "rows": rows}
    (out / "ablation.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(rows))


if __name__ == "__main__":
    main()
