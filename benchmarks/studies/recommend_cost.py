"""`recommend`'s time predicted two ways against its measured stage profile (#57 item 5).

Runs recommend's measurement (`kvlens.recommend.pipeline.measure`, what `kvlens recommend
CAPTURE -b BUDGET` measures when nothing is kept) once on a capture and records: each stage's
measured time (the profile), when each per-layer unit of each stage finished (every
`map_layers` call: its start and its units' finishing times), the machine's load average
before and after, and, where the code still has it (up to commit 6c4a6a5), the fitted cost
model's prediction made before it starts (`pipeline.predict_cost`). It prints per stage the
measured time, the fitted prediction and the progress estimate: the stage's time until its
first round of units (one per worker) had finished plus the rest at their rate, the units
weighted equally ("equal") or by their FLOPs ("by work": a layout sensitivity run goes from its
own layer to the last, then the LM head; `kvlens.recommend.profile.perturbed_work`, what
`recommend` does since it replaced the fitted model: its own "live" prediction is printed too). A study, run by hand (say how loaded the machine was):

    python benchmarks/studies/recommend_cost.py smol.h5 --out smol-cost.json
    python benchmarks/studies/recommend_cost.py --read smol-cost.json   # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

#: the stage each map_layers label runs in (kvlens.recommend.pipeline.measure)
STAGES = {"layer": "candidate errors", "layout sensitivity layer": "layout sensitivity",
          "retrieval probe layer": "retrieval probe"}


def _record(path: str, budget: float) -> dict:
    """Measure ``path`` at ``budget`` with every ``map_layers`` call recorded."""
    from kvlens.capture.store import open_capture
    from kvlens.recommend import RecommendOptions, parallel, pipeline, probe, sensitivity

    calls: list[dict] = []
    real = parallel.map_layers

    def recorded(fn, cap_path, layers, args, workers, progress=None, label="layer", threads=1,
                 **kw):
        call = {"stage": STAGES[label], "label": label,
                "workers": workers, "units": list(layers), "start": time.time(), "done": []}
        calls.append(call)

        def tick(done, total, note):
            call["done"].append([time.time(), int(note.rsplit(" ", 1)[-1])])
            if progress:
                progress(done, total, note)

        out = real(fn, cap_path, layers, args, workers, tick, label=label, threads=threads,
                   **kw)
        call["end"] = time.time()
        return out

    for module in (pipeline, sensitivity, probe):
        module.map_layers = recorded
    opts = RecommendOptions(budget_bits=budget)
    with open_capture(path) as cap:
        meta = cap.meta
    load_before = os.getloadavg()
    fitted = pipeline.predict_cost(meta, opts).to_dict() if hasattr(pipeline, "predict_cost") \
        else None
    start = time.time()
    measured = pipeline.measure(path, opts)
    return {"capture": str(path), "budget": budget, "started": start, "wall": time.time() - start,
            "load_before": load_before, "load_after": os.getloadavg(), "fitted": fitted,
            "model": {"layers": meta.shape.num_layers, **{k: meta.extra.get(k) for k in (
                "num_parameters", "vocab_size", "hidden_size")}},
            "layout_tokens": opts.layout_tokens or opts.tokens,
            "profile": {**measured.profile.to_dict(),
                        "predicted": dict(getattr(measured.profile, "predicted", {}))},
            "calls": calls, "config": pipeline.choose(measured, opts).config.to_dict()}


def _work(run: dict, call: dict, by_work: bool) -> dict[int, float]:
    """Each unit's work: equal, or a layout sensitivity run's FLOPs (every family on every
    layer, recommend's default; a tied LM head)."""
    units = call["units"]
    if not by_work or call["stage"] != "layout sensitivity":
        return dict.fromkeys(units, 1.0)
    m = run["model"]
    head = m["vocab_size"] * m["hidden_size"]
    n = run["layout_tokens"]
    layer = 2 * (m["num_parameters"] - head) / m["layers"] * n
    return {u: (m["layers"] - u) * layer + 2 * head * (n // 2) for u in units}


def progress_estimates(run: dict, by_work: bool) -> dict[str, float]:
    """Per stage: the estimate made when its first round of units had finished (the rule of
    ``kvlens.recommend.parallel.map_layers``)."""
    began: dict[str, float] = {}
    for name, start, _end in run["profile"]["spans"]:
        began[name] = min(start, began.get(name, start))
    out = {}
    for call in run["calls"]:
        total = len(call["units"])
        k = min(total, max(1, call["workers"]))
        if k >= total or call["stage"] in out:
            continue
        work = _work(run, call, by_work)
        at = call["done"][k - 1][0]
        done = sum(work[u] for _, u in call["done"][:k])
        rest = (at - call["start"]) * (sum(work.values()) - done) / done
        out[call["stage"]] = at - began[call["stage"]] + rest
    return out


def report(run: dict) -> None:
    measured = run["profile"]["stages"]
    fitted = (run["fitted"] or {}).get("stages", {})
    columns = {"fitted": fitted, "equal": progress_estimates(run, False),
               "by work": progress_estimates(run, True), "live": run["profile"].get("predicted")}
    columns = {k: v for k, v in columns.items() if v}
    workers = max((c["workers"] for c in run["calls"]), default=1)
    factor = f"; machine factor {run['fitted']['machine_factor']:.2f}" if run["fitted"] else ""
    print(f"{run['capture']} -b {run['budget']:g}: {workers} worker(s), load average "
          f"{run['load_before'][0]:.1f} before, {run['load_after'][0]:.1f} after{factor}")
    print("| stage | measured | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for name in sorted(measured, key=lambda n: -measured[n]):
        if measured[name] < 0.5 and not any(name in c for c in columns.values()):
            continue
        cells = [measured[name]] + [c.get(name) for c in columns.values()]
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.1f} s" for c in cells)
              + " |")
    # a column's total: its predictions, and the measured time of the stages it has none of
    totals = [sum(measured.values())] + [
        sum(c.get(n, v) for n, v in measured.items()) + sum(v for n, v in c.items()
                                                              if n not in measured)
        for c in columns.values()]
    print("| total | " + " | ".join(f"{t:.1f} s" for t in totals) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", nargs="?")
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--out", help="write the recorded run here (JSON)")
    parser.add_argument("--read", help="print the table of a recorded run")
    args = parser.parse_args(argv)
    if args.read:
        run = json.loads(Path(args.read).read_text())
    else:
        if not args.capture:
            parser.error("give a capture, or --read a recorded run")
        run = _record(args.capture, args.budget)
        if args.out:
            Path(args.out).write_text(json.dumps(run, indent=1))
    report(run)


if __name__ == "__main__":
    main()
