"""The llama.cpp simulation beside the real engine: one table from two result files.

``benchmarks/llamacpp_kld.py --json real.json`` (the real llama.cpp, f16 cache as reference)
and ``kvlens generate --compare exact,llamacpp:K/V,... --eval kld --report-json sim.json``
(the simulation, same model, tokens and chunking) -> a markdown table of mean KLD with the
95% intervals each tool printed, the ratio simulated / real, whether every pair is within
``--within`` (default 1.5x), and the Spearman rank correlation of the two orderings::

    python benchmarks/llamacpp_vs_sim.py real.json sim.json

Pairs are matched by their K/V types (``llama.cpp q8_0/q4_0`` <-> ``llamacpp:q8_0/q4_0`` or
``llamacpp:q4_0`` for ``q4_0/q4_0``); pairs missing from either file are listed and skipped.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys


def _real(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["type_k"], r["type_v"]): r for r in doc["results"]}


def _sim(doc: dict) -> dict[tuple[str, str], dict]:
    out = {}
    for r in doc["results"]:
        name = r["name"]
        if not name.startswith("llamacpp:") or "kld" not in r:
            continue
        types, *opts = name.split(":")[1:]
        if opts:  # :norot, :noarith ... are other settings than the real run's
            continue
        k, _, v = types.partition("/")
        out[(k, v or k)] = r["kld"]
    return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else float("nan")


def table(real: dict, sim: dict, within: float) -> tuple[list[str], list[tuple[str, str]]]:
    pairs = [p for p in real if p in sim]
    missing = [p for p in (*real, *sim) if p not in real or p not in sim]
    pairs.sort(key=lambda p: real[p]["mean_kld"]["value"])
    lines = ["| K/V | real mean KLD [95%] | simulated [95%] | simulated / real | within "
             f"{within}x |", "|---|---:|---:|---:|:---:|"]
    for p in pairs:
        r, s = real[p]["mean_kld"], sim[p]["mean_kld"]
        ratio = s["value"] / r["value"] if r["value"] else float("inf")
        ok = 1 / within <= ratio <= within
        lines.append(f"| {p[0]}/{p[1]} | {r['value']:.4f} [{r['ci95'][0]:.4f}, "
                     f"{r['ci95'][1]:.4f}] | {s['value']:.4f} [{s['ci95'][0]:.4f}, "
                     f"{s['ci95'][1]:.4f}] | {ratio:.2f} | {'yes' if ok else 'no'} |")
    if len(pairs) > 1:
        rho = spearman([real[p]["mean_kld"]["value"] for p in pairs],
                       [sim[p]["mean_kld"]["value"] for p in pairs])
        lines.append("")
        lines.append(f"Spearman rank correlation over {len(pairs)} pairs: {rho:.2f}")
    return lines, sorted(set(missing))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("real", help="benchmarks/llamacpp_kld.py --json output")
    ap.add_argument("sim", help="kvlens generate --report-json output")
    ap.add_argument("--within", type=float, default=1.5)
    args = ap.parse_args(argv)
    with open(args.real) as f:
        real = _real(json.load(f))
    with open(args.sim) as f:
        sim = _sim(json.load(f))
    lines, missing = table(real, sim, args.within)
    print("\n".join(lines))
    if missing:
        print(f"only in one file (skipped): {', '.join(k + '/' + v for k, v in missing)}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
