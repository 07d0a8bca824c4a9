"""`kvlens recommend --dtype`: the model stages in float32 and in bfloat16 on one capture.

Runs `kvlens capture` once, then `kvlens recommend CAPTURE -b BUDGET --remeasure --json` with
`--dtype float32` and with `--dtype bfloat16` (each its own process; the peak is the summed
proportional set size of its process tree, sampled every 0.2 s), and scores both configs
against the exact model in bfloat16 on the built-in held-out text in one lockstep run
(`kvlens generate --dtype bfloat16 --compare f32.json,bf16.json --eval kld`), so the KLD
difference is paired. Prints each run's wall time, peak and stage profile, how many layers'
choices differ, and both KLDs with the paired difference (bfloat16 config minus float32
config) and their 95% intervals. A study, run by hand on a quiet machine:

    python benchmarks/studies/recommend_dtype.py --keep out-dtype
    python benchmarks/studies/recommend_dtype.py --model gemma-3-270m-Q4_K_M.gguf --keep out-g
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def _pss(pid: int) -> int:
    """Summed Pss of ``pid`` and its descendants (bytes; Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{p}/task").glob("*"):
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def run(args: list[str]) -> tuple[float, dict, int, list]:
    """``(wall seconds, the JSON it printed, peak Pss bytes, [(unix time, Pss bytes), ...])``
    of ``kvlens ARGS``."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvlens", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    samples = []
    while proc.poll() is None:
        samples.append((time.time(), _pss(proc.pid)))
        time.sleep(0.2)
    text = proc.stdout.read()
    if proc.returncode:
        sys.exit(f"`kvlens {' '.join(args)}` failed ({proc.returncode})")
    doc = json.loads(text) if "--json" in args else {}
    return time.perf_counter() - start, doc, max(b for _, b in samples), samples


def stage_peaks(spans: list, samples: list) -> dict[str, int]:
    """The peak Pss sampled while each stage was the innermost one running (its profile's
    ``spans``; a sample in no span goes to "outside stages": start-up, loading, writing)."""
    peaks: dict[str, int] = {}
    for t, held in samples:
        inside = [s for s in spans if s[1] <= t <= s[2]]
        name = max(inside, key=lambda s: s[1])[0] if inside else "outside stages"
        peaks[name] = max(peaks.get(name, 0), held)
    return peaks

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="capture's --model (default: SmolLM2)")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--keep", type=Path, required=True, help="folder for the capture and configs")
    args = p.parse_args(argv)
    out = args.keep
    out.mkdir(parents=True, exist_ok=True)
    cap = out / "run.h5"
    if not cap.exists():
        run(["capture", "-o", str(cap), *(["--model", args.model] if args.model else [])])
    configs = []
    for dtype in DTYPES:
        cfg = out / f"{dtype}.json"
        wall, doc, peak, samples = run(["recommend", str(cap), "-b", str(args.budget),
                                        "--dtype", dtype, "--name", f"recommended-{dtype}",
                                        "-o", str(cfg), "--overwrite", "--remeasure", "--json"])
        configs.append((dtype, cfg, doc))
        peaks = stage_peaks(doc["profile"]["spans"], samples)
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in doc["profile"]["stages"].items())
        held = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in peaks.items())
        print(f"recommend --dtype {dtype}: {wall:.1f} s, peak Pss {peak / 2**20:,.0f} MiB, "
              f"held bits {doc['mean_bits']:.3f}\n  time by stage: {stages}\n"
              f"  peak Pss by stage: {held}")
    picks = [{(c["layer"], c["tensor"]): (c["candidate"]["label"], c["residual_tokens"])
              for c in doc["choices"]} for _, _, doc in configs]
    differ = sorted({layer for (layer, _), v in picks[0].items() if picks[1][layer, _] != v})
    print(f"layers whose choice differs: {len(differ)} {differ}")
    _, doc, _, _ = run(["generate", *(["--model", args.model] if args.model else []),
                     "--dtype", "bfloat16", "--compare", ",".join(str(c) for _, c, _ in configs),
                     "--eval", "kld", "--eval-tokens", str(args.eval_tokens), "--json"])
    for r in doc["results"]:
        k = r["kld"]
        line = (f"{r['name']}: KLD {k['mean_kld']['value']:.4f} {k['mean_kld']['ci95']}, "
                f"top-1 {k['top1_agreement']['value']:.3f}, n = {k['scored']}")
        if k.get("vs_first"):
            d = k["vs_first"]["mean_kld"]
            line += f"; minus {k['vs_first']['reference']}: {d}"
        print(line)
    print(f"exact reference: {doc['evaluation']['kld'].get('model_dtype')}")


if __name__ == "__main__":
    main()
