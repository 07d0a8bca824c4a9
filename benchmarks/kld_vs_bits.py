"""Mean KLD against held bits: kvlens's recommendations and presets beside llama.cpp's cache types.

Collects measured points from the JSON that ``kvlens generate --compare ... --eval kld --json``
and ``benchmarks/llamacpp_kld.py --json`` wrote (all at the same tokens of the built-in held-out
text), writes them to one data file and draws the plot (log KLD, 95% interval bars):

    python benchmarks/kld_vs_bits.py --model SmolLM2 --kvlens a.json b.json \\
        --llamacpp llamacpp_smol.json --out docs/img/kld_vs_bits_smollm2
    python benchmarks/kld_vs_bits.py --replot docs/img/kld_vs_bits_smollm2.json
    python benchmarks/kld_vs_bits.py --kvlens abl/evaluation.json \\
        --skip rec- --previous docs/img/kld_vs_bits_smollm2.json --out docs/img/kld_vs_bits_smollm2

``--previous`` keeps an earlier data file's points that the new files do not measure again,
except its ``recommend*`` points: those belong to the recommend of their day and are replaced by
the new ones (the engine's and the presets' points do not depend on recommend's code).

kvlens's bits are the bytes its cache held after the scored tokens (every part, window
included; ``memory_report``); llama.cpp's are its types' block sizes (8.5 bits for q8_0, 4.5
for q4_0: what its cache holds per element, with no full-precision window).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _points_kvlens(path: str) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    out = []
    for r in doc["results"]:
        k = r.get("kld")
        if not k or r["name"] in ("exact", "fp16"):
            continue
        out.append({"name": r["name"], "source": "kvlens", "bits": r["bits_per_element"],
                    "kld": k["mean_kld"]["value"], "ci95": k["mean_kld"]["ci95"],
                    "top1": k["top1_agreement"]["value"], "file": Path(path).name})
    return out


def _points_llamacpp(path: str) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    tag = "" if doc.get("rotation", True) else " (no rotation)"
    return [{"name": r["name"] + tag, "source": "llama.cpp", "bits": r["bits_per_element"],
             "kld": r["mean_kld"]["value"], "ci95": r["mean_kld"]["ci95"],
             "top1": r["top1_agreement"]["value"], "file": Path(path).name}
            for r in doc["results"]]


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    style = {"recommend": ("o", "tab:blue"), "kvlens": ("s", "tab:gray"),
             "llama.cpp": ("^", "tab:red")}
    for p in data["points"]:
        kind = ("recommend" if p["name"].startswith("recommend") else p["source"])
        marker, color = style[kind]
        lo, hi = p["ci95"]
        ax.errorbar(p["bits"], p["kld"], yerr=[[p["kld"] - lo], [hi - p["kld"]]], fmt=marker,
                    color=color, capsize=2, ms=6)
        ax.annotate(p["name"].replace("llama.cpp ", ""), (p["bits"], p["kld"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    rec = sorted((p for p in data["points"] if p["name"].startswith("recommend")),
                 key=lambda p: p["bits"])
    if rec:
        ax.plot([p["bits"] for p in rec], [p["kld"] for p in rec], "-", color="tab:blue",
                alpha=0.5)
    for kind, (marker, color) in style.items():
        label = {"recommend": "kvlens recommend", "kvlens": "kvlens presets",
                 "llama.cpp": "llama.cpp (real engine, llama-cpp-python)"}[kind]
        ax.plot([], [], marker, color=color, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("bits per element held (all parts; kvlens at the scored length)")
    ax.set_ylabel("mean KL(exact || compressed) per token (log)")
    ax.set_title(f"{data['model']}: {data['tokens']} tokens of held-out text, "
                 "mean KLD with 95% intervals")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kvlens", nargs="*", default=[], help="generate --json outputs")
    ap.add_argument("--llamacpp", nargs="*", default=[], help="llamacpp_kld.py --json outputs")
    ap.add_argument("--previous", help="an earlier OUT.json: keep its points not measured "
                    "again, except its recommend* points")
    ap.add_argument("--skip", default="", help="comma-separated name prefixes to leave out "
                    "(e.g. rec- for an ablation's lever rows)")
    ap.add_argument("--out", help="write OUT.json and OUT.png")
    ap.add_argument("--replot", help="redraw OUT.png from this OUT.json")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    if not args.out:
        ap.error("--out is needed (or --replot)")
    points = [p for f in args.kvlens for p in _points_kvlens(f)]
    points += [p for f in args.llamacpp for p in _points_llamacpp(f)]
    if args.previous:
        points += [p for p in json.loads(Path(args.previous).read_text())["points"]
                   if not p["name"].startswith("recommend")]
    skip = tuple(x for x in args.skip.split(",") if x)
    points = [p for p in points if not p["name"].startswith(skip)]
    seen: set = set()  # a config measured in several runs: the first file's figure
    points = [p for p in points if not (p["name"] in seen or seen.add(p["name"]))]
    data = {"model": args.model, "tokens": args.tokens, "points": points}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
