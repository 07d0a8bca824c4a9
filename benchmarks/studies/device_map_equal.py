"""`kvlens recommend` and `kvlens generate --eval kld` placed by accelerate with most of the
model offloaded to disk, against the same commands on the whole model (the default model).

Runs `kvlens capture` once (unless the folder holds one), then, for the plain run and the
placed one (`--device-map auto --max-memory cpu=LIMIT --offload-folder DIR`), each in its own
process:

- `kvlens recommend CAPTURE -b BUDGET --remeasure --validate` (every model stage: layout
  sensitivity, retrieval probe, validation), writing its config;
- `kvlens generate --compare CONFIG,kivi-2 --eval kld` with the plain run's config.

Prints each run's wall time, whether the two configs are identical (every layer's choice), the
per-layer sensitivity weights' largest relative difference, and the KLDs of both evaluations side
by side with their largest absolute difference. A study, run by hand on a quiet machine:

    python benchmarks/studies/device_map_equal.py --keep out-map
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def kvlens(args: list[str]) -> tuple[float, dict]:
    """``(wall seconds, the JSON it printed)`` of ``kvlens ARGS --json``."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvlens", *args, "--json"],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"`kvlens {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, json.loads(proc.stdout)


def klds(doc: dict) -> dict[str, float]:
    return {r["name"]: r["kld"]["mean_kld"]["value"] for r in doc["results"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, required=True, help="folder for the capture and configs")
    p.add_argument("--max-memory", default="cpu=150MiB")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--samples", type=int, default=2, help="recommend --samples")
    p.add_argument("--tokens", type=int, default=512, help="recommend --tokens")
    p.add_argument("--eval-tokens", type=int, default=1024)
    args = p.parse_args(argv)
    out = args.keep
    out.mkdir(parents=True, exist_ok=True)
    cap = out / "run.h5"
    if not cap.exists():
        kvlens(["capture", "-o", str(cap)])
    shared = ["--samples", str(args.samples), "--tokens", str(args.tokens), "-b",
              str(args.budget), "--validate", "--eval-tokens", str(args.eval_tokens),
              "--remeasure", "--overwrite"]
    recs, evals = {}, {}
    with tempfile.TemporaryDirectory(prefix="kvlens-offload-") as folder:
        placed = ["--device-map", "auto", "--max-memory", args.max_memory,
                  "--offload-folder", folder]
        for name, extra in (("plain", []), ("placed", placed)):
            cfg = out / f"{name}.json"
            wall, recs[name] = kvlens(["recommend", str(cap), "-o", str(cfg), *shared, *extra])
            print(f"recommend, {name}: {wall:.1f} s, held bits {recs[name]['mean_bits']:.4f}")
        for name, extra in (("plain", []), ("placed", placed)):
            wall, evals[name] = kvlens(["generate", "--compare", f"{out / 'plain.json'},kivi-2",
                                        "--eval", "kld", "--eval-tokens",
                                        str(args.eval_tokens), *extra])
            print(f"generate --eval kld, {name}: {wall:.1f} s, {klds(evals[name])}")
    a, b = (json.loads((out / f"{n}.json").read_text()) for n in ("plain", "placed"))
    a.pop("name", None), b.pop("name", None)
    print(f"configs identical: {a == b}")
    wa, wb = (recs[n]["layer_weights"] for n in ("plain", "placed"))
    print(f"sensitivity weights: largest relative difference "
          f"{max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(wa, wb)):.2e}")
    va, vb = (klds({"results": recs[n]["validation"]}) for n in ("plain", "placed"))
    print(f"validation KLD (recommend --validate): plain {va}, placed {vb}")
    ka, kb = klds(evals["plain"]), klds(evals["placed"])
    print(f"generate KLD largest absolute difference: "
          f"{max(abs(ka[k] - kb[k]) for k in ka):.2e}")


if __name__ == "__main__":
    main()
