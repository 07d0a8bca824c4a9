"""Tables for docs/lab-notes/codebooks.md "Cross-layer prediction": AQUA-KV-style prediction against plain
quantization at the same held bits.

Two modes:

- ``python benchmarks/studies/predict_table.py ev CAPTURE.h5 [--ridge 1e-3,1e-2]`` measures how much of
  each tensor the predictors explain with *exact* inputs (an upper bound for the reconstructed
  inputs the ``predict`` variant uses): keys from the previous layer's keys (post-RoPE from
  post-RoPE, pre-RoPE from pre-RoPE), values from the previous layer's values, from the layer's
  pre-RoPE keys, and from both. Each sample predicted by a map fitted on the other samples
  (``kvlens.quant.predict.cross_fit_predict``); mean, min and max over layers with a
  predecessor of the per-head explained variance.
- ``python benchmarks/studies/predict_table.py transfer CAL.h5 EVAL.h5`` checks that the leave-one-out
  fits above are not flattered by fitting on the same text: the same predictors (exact inputs)
  fitted on every sample of one capture and applied to another capture of the same model on
  other text, beside the leave-one-sample-out figure within the second capture.
- ``python benchmarks/studies/predict_table.py table RESULT.json`` reads the ``--json`` output of
  ``kvlens compare-axes ... --variants predict`` and prints, per tensor, plain and predict side
  by side for every swept layout (uniform: held bits ``bits + 16/G`` with 8-bit group metadata
  and ``bits + 32/G`` with float16; codebooks: the summary's ``bits_per_element``), the mean
  over layers and heads of each metric, the explained variance of the prediction with
  reconstructed inputs (mean over layers), and the predictors' model-side bytes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

METRICS = ("reconstruction", "score", "attention_output")


def ev(path: str, ridges: list[float]) -> None:
    from kvlens.capture.store import open_capture
    from kvlens.quant.predict import cross_fit_predict, explained_variance

    rows = defaultdict(list)
    with open_capture(path) as cap:
        prev = None
        for layer in cap.layers:
            data = cap.layer(layer)
            cur = {n: data.read(n).float() for n in ("k", "k_pre", "v")}
            if prev is not None:
                for ridge in ridges:
                    cases = {
                        "keys post <- keys post (l-1)": ([prev["k"]], cur["k"]),
                        "keys pre <- keys pre (l-1)": ([prev["k_pre"]], cur["k_pre"]),
                        "values <- values (l-1)": ([prev["v"]], cur["v"]),
                        "values <- keys pre (l)": ([cur["k_pre"]], cur["v"]),
                        "values <- keys pre (l), values (l-1)": (
                            [cur["k_pre"], prev["v"]], cur["v"]),
                    }
                    for name, (inputs, target) in cases.items():
                        e = explained_variance(target, cross_fit_predict(inputs, target, ridge))
                        rows[(name, ridge)].append(float(e.mean()))
            prev = cur
    print("| predictor | ridge | explained variance, mean over layers | min | max |")
    print("|---|---:|---:|---:|---:|")
    for (name, ridge), vals in rows.items():
        print(f"| {name} | {ridge:g} | {sum(vals) / len(vals):.3f} | {min(vals):.3f} | "
              f"{max(vals):.3f} |")


def _cases(prev: dict, cur: dict) -> dict:
    return {
        "keys post <- keys post (l-1)": ([prev["k"]], cur["k"]),
        "keys pre <- keys pre (l-1)": ([prev["k_pre"]], cur["k_pre"]),
        "values <- keys pre (l), values (l-1)": ([cur["k_pre"], prev["v"]], cur["v"]),
    }


def transfer(cal_path: str, eval_path: str, ridge: float) -> None:
    from kvlens.capture.store import open_capture
    from kvlens.quant.predict import (
        cross_fit_predict,
        explained_variance,
        fit_ridge,
        from_token_features,
        token_features,
    )

    rows = defaultdict(lambda: ([], []))
    with open_capture(cal_path) as cal, open_capture(eval_path) as ev_cap:
        if tuple(cal.layers) != tuple(ev_cap.layers):
            raise SystemExit("the two captures hold different layers")
        prev = None
        for layer in cal.layers:
            cur = {}
            for name in ("k", "k_pre", "v"):
                cur[name] = (cal.layer(layer).read(name).float(),
                             ev_cap.layer(layer).read(name).float())
            if prev is not None:
                pc = {n: t[0] for n, t in prev.items()}
                cc = {n: t[0] for n, t in cur.items()}
                pe = {n: t[1] for n, t in prev.items()}
                ce = {n: t[1] for n, t in cur.items()}
                for (name, (xc, yc)), (_, (xe, ye)) in zip(
                        _cases(pc, cc).items(), _cases(pe, ce).items(), strict=True):
                    fc, fy = token_features(*xc), token_features(yc)
                    fit = fit_ridge(fc.reshape(-1, fc.shape[-1]), fy.reshape(-1, fy.shape[-1]),
                                    ridge)
                    pred = from_token_features(fit(token_features(*xe)), ye.shape[1],
                                               ye.shape[-1])
                    rows[name][0].append(float(explained_variance(ye, pred).mean()))
                    loo = cross_fit_predict(xe, ye, ridge)
                    rows[name][1].append(float(explained_variance(ye, loo).mean()))
            prev = cur
    print("| predictor | fitted on the other capture | leave one sample out |")
    print("|---|---:|---:|")
    for name, (other, loo) in rows.items():
        print(f"| {name} | {sum(other) / len(other):.3f} | {sum(loo) / len(loo):.3f} |")


def table(path: str) -> None:
    data = json.loads(open(path).read())
    summary = data["summary"]
    rows: dict[tuple, dict] = defaultdict(dict)
    for m in summary["means"]:
        if m["variant"] not in ("plain", "predict"):
            continue
        stage = f" {m['stage']}" if m["stage"] else ""
        layout = f"{m['bits']}b {m['axis']} G{m['group_size']}{stage}"
        held = f"{m['bits'] + 16 / m['group_size']:.2f} / {m['bits'] + 32 / m['group_size']:.2f}"
        rows[(m["tensor"], m["bits"], layout, held)][(m["variant"], m["metric"])] = m["mean"]
    info = {f["format"]: f for f in summary.get("formats", [])}
    for m in summary.get("format_means", []):
        name = m["format"]
        base = name.replace("+predict", "")
        variant = "predict" if name != base else "plain"
        f = info[name]  # the same cache bits with and without +predict
        rows[(m["tensor"], f["code_bits"], base, f"{f['bits_per_element']:.2f}")][
            (variant, m["metric"])] = m["mean"]
    explained = defaultdict(list)
    for e in summary.get("predictors", {}).get("explained_variance", []):
        if e["inputs"]:  # layers with a predecessor (keys) / with keys and values (values)
            explained[(e["tensor"], e["layout"])].append(e["explained_variance"])
    for tensor in ("key", "value"):
        metrics = METRICS if tensor == "key" else ("reconstruction", "attention_output")
        print(f"\n{tensor}s\n")
        print("| layout | held bits | " + " | ".join(f"{m} plain / predict" for m in metrics)
              + " | explained variance |")
        print("|---|---:|" + "---:|" * (len(metrics) + 1))
        for (t, _, layout, held), vals in sorted(rows.items(), key=lambda kv: kv[0][1:]):
            if t != tensor or ("predict", "reconstruction") not in vals:
                continue
            cells = " | ".join(
                f"{vals.get(('plain', m), float('nan')):.3f} / {vals[('predict', m)]:.3f}"
                for m in metrics)
            evs = [v for (tt, lay), v in explained.items()
                   if tt == tensor and (lay == layout or lay.startswith(layout + "+predict"))]
            ev_cell = f"{sum(evs[0]) / len(evs[0]):.3f}" if evs else "-"
            print(f"| {layout} | {held} | {cells} | {ev_cell} |")
    pred = summary.get("predictors", {})
    for tensor in ("key", "value"):
        if tensor in pred:
            p = pred[tensor]
            print(f"\n{tensor} predictor: {p['bytes_per_layer']} bytes per layer, "
                  f"{p['bits_per_element_at_capture_length']:.2f} bits per cached element at "
                  f"the capture's length (reads {p['reads']})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("ev")
    p.add_argument("capture")
    p.add_argument("--ridge", default="1e-3")
    tr = sub.add_parser("transfer")
    tr.add_argument("calibration")
    tr.add_argument("evaluation")
    tr.add_argument("--ridge", type=float, default=1e-2)
    t = sub.add_parser("table")
    t.add_argument("result")
    args = parser.parse_args(argv)
    if args.mode == "ev":
        ev(args.capture, [float(r) for r in args.ridge.split(",")])
    elif args.mode == "transfer":
        transfer(args.calibration, args.evaluation, args.ridge)
    else:
        table(args.result)


if __name__ == "__main__":
    main()
