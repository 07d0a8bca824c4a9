"""Tables for docs/lab-notes/codebooks.md: codebooks and key centering against the uniform variants.

Two modes:

- ``python benchmarks/studies/codebook_table.py table RESULT.json`` reads the ``--json`` output of
  ``kvlens compare-axes`` (run with ``--codebooks`` and ``--variants center,rotate``) and prints
  one markdown table per tensor: every variant with its storage bits per element (uniform
  specs: ``bits + 32/G``, a float16 scale and zero per group of ``G``; codebooks: the summary's
  ``bits_per_element``), and the mean over layers and heads of each metric, sorted by bits.
- ``python benchmarks/studies/codebook_table.py ranges CAPTURE.h5`` measures what centering does to the
  keys' per-token range (max - min over channels, the span of a whole-vector per-token group)
  and to the key norm (what a per-vector codebook stores), for post-RoPE keys centred by their
  mean and pre-RoPE keys centred by theirs: mean over layers of the ratio centred / raw.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

METRICS = ("reconstruction", "score", "attention_output")


def table(path: str) -> None:
    data = json.loads(open(path).read())
    summary = data["summary"]
    rows: dict[tuple, dict] = defaultdict(dict)
    for m in summary["means"]:
        stage = m["stage"] or ""
        name = f"{m['axis']} G{m['group_size']} {stage} {m['variant']}".replace("  ", " ")
        bits = m["bits"] + 32 / m["group_size"]
        rows[(m["tensor"], name, m["bits"], bits)][m["metric"]] = m["mean"]
    info = {f["format"]: f for f in summary.get("formats", [])}
    for m in summary.get("format_means", []):
        f = info[m["format"]]
        rows[(m["tensor"], m["format"], f["code_bits"], f["bits_per_element"])][m["metric"]] = (
            m["mean"])
    for tensor in ("key", "value"):
        print(f"\n{tensor}s\n")
        metrics = METRICS if tensor == "key" else ("reconstruction", "attention_output")
        print("| variant | code bits | bits/element | " + " | ".join(metrics) + " |")
        print("|---|---:|---:|" + "---:|" * len(metrics))
        for (t, name, code_bits, bpe), vals in sorted(
            rows.items(), key=lambda kv: (kv[0][3], kv[1].get("attention_output", 9))
        ):
            if t != tensor:
                continue
            cells = " | ".join(f"{vals[m]:.4f}" if m in vals else "-" for m in metrics)
            print(f"| {name} | {code_bits} | {bpe:.3f} | {cells} |")


def ranges(path: str) -> None:
    import torch

    from kvlens.capture.store import open_capture
    from kvlens.quant.centering import center, key_mean, token_range

    out = defaultdict(list)
    with open_capture(path) as cap:
        for layer in cap.layers:
            data = cap.layer(layer)
            for stage, name in (("post", "k"), ("pre", "k_pre")):
                k = data.read(name).float()
                c = center(k, key_mean(k))
                out[(stage, "range")].append(float(token_range(c).mean() / token_range(k).mean()))
                out[(stage, "norm")].append(float(c.norm(dim=-1).mean() / k.norm(dim=-1).mean()))
        model = cap.meta.model
    print(f"{model}: centred / raw, mean over {len(cap.layers)} layers (min-max over layers)")
    for (stage, what), vals in out.items():
        t = torch.tensor(vals)
        print(f"  {stage}-RoPE keys, per-token {what}: {t.mean():.3f} "
              f"({t.min():.3f}-{t.max():.3f})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("table", "ranges"))
    ap.add_argument("path")
    args = ap.parse_args(argv)
    table(args.path) if args.mode == "table" else ranges(args.path)


if __name__ == "__main__":
    main()
