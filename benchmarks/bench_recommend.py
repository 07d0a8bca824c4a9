"""How long `kvlens recommend` takes against the `kvlens capture` that made its input.

Runs, as a user would, `kvlens capture` (defaults) and then `kvlens recommend -b BUDGET --json`
on that capture, each as its own process, and prints wall times, their ratio, peak memory and
recommend's own stage profile (the `profile` of its JSON). The fast-recommend goal is a ratio of
at most 3 on the default model (`docs/benchmarks.md` records the measured figures with the
machine). A benchmark, not a test: run it by hand on a quiet machine.

    python benchmarks/bench_recommend.py                     # embedded SmolLM2, budget 3.0
    python benchmarks/bench_recommend.py --model gemma-3-270m-Q4_K_M.gguf
    python benchmarks/bench_recommend.py --extra="--set mikv=on"  # with the MiKV experiment
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(args: list[str]) -> tuple[float, str, int]:
    """Wall seconds, stdout and the peak bytes the run's processes held together (the sum of
    their proportional set sizes, sampled every 0.2 s: forked workers share the pages they
    did not write; 0 where /proc cannot say)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvlens", *args], stdout=out, stderr=err,
                                text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _held_bytes(proc.pid))
            time.sleep(0.2)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        sys.exit(f"`kvlens {' '.join(args)}` failed ({proc.returncode}):\n{stderr[-3000:]}")
    return wall, stdout, peak


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _held_bytes(pid: int) -> int:
    """The summed proportional set size (Pss) of ``pid``'s process tree, in bytes."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):
            pass
    return total


def _peak_child_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="--model for capture (default: embedded SmolLM2)")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--extra", default="", help="extra recommend options, one string")
    p.add_argument("--keep", type=Path, default=None, help="keep the capture and outputs here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvlens-bench-") as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        cap = out / "run.h5"
        model = ["--model", args.model] if args.model else []
        cap_wall, _, _ = _run(["capture", "-o", str(cap), "--overwrite", *model])
        cap_peak = _peak_child_mib()
        rec_wall, stdout, rec_held = _run(["recommend", str(cap), "-b", str(args.budget), "-o",
                                 str(out / "recommended.json"), "--overwrite", "--json",
                                 "--remeasure",  # never an earlier run's kept measurement
                                 *shlex.split(args.extra)])
        doc = json.loads(stdout)
    print(f"capture    {cap_wall:8.1f} s  (peak RSS {cap_peak:,.0f} MiB)")
    print(f"recommend  {rec_wall:8.1f} s  (peak RSS of the larger child "
          f"{_peak_child_mib():,.0f} MiB; all its processes together "
          f"{rec_held / 2**20:,.0f} MiB, Pss)")
    print(f"ratio      {rec_wall / cap_wall:8.2f}  (goal: <= 3)")
    profile = doc.get("profile") or {}
    for stage, seconds in profile.get("stages", {}).items():
        print(f"  {stage:28s} {seconds:8.1f} s")
    for stage, seconds in (profile.get("predicted") or {}).items():
        print(f"  {stage:28s} {seconds:8.1f} s predicted (from its first layers)")
    print(f"held bits  {doc.get('mean_bits', float('nan')):.3f} at budget {args.budget}")


if __name__ == "__main__":
    main()
