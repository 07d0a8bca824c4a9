"""Coupled (CQ) quantization against today's scalar layouts at equal held bits (issue #50, step 1).

    python benchmarks/studies/coupled_ablation.py CAPTURE.h5 [--save result.json]
    python benchmarks/studies/coupled_ablation.py --load result.json

Runs ``kvlens compare-axes``' sweep (``kvlens.analysis.compare.compare_axes``) with the
``coupled`` variant: coupled codebooks fitted per layer on the first half of the capture's
samples, every layout measured on the rest. Scalar layouts are KIVI's: per-channel keys (groups
of G tokens of one channel), per-token values (groups of G channels of one token), 1-3 bits,
G in 16, 32, 64, 128 (those dividing head_dim), every token quantized (no residual window), float scales in the error.

Held bits per element: scalar ``bits + 32/G`` (float16 scale and zero per group; the
``--meta8`` column: ``bits + 16/G``, 8-bit metadata, with the error still measured with float
scales, which favours the scalar side); coupled ``b/c`` plus its codebooks amortised over
``--tokens`` tokens of one sequence (``CoupledSpec.bits_per_element``). For each coupled band
(2.0, 2.5, 3.0 index bits per channel) the table names the coupled setting with the lowest mean
attention-output error and the best scalar layout that holds no more bits than it; per layer,
the same two layouts. Error: relative Frobenius error of the attention output (mean over layers
and query heads), an error proxy, not a KLD.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

SETTINGS = ("c2b4", "c4b8", "c4b8+corr", "c4b8+hadamard", "c4b8+weighted",
            "c2b5", "c4b10", "c2b6")
SCALAR_BITS = (1, 2, 3)
GROUP_SIZES = (16, 32, 64, 128)
BANDS = (2.0, 2.5, 3.0)
SCALAR_AXIS = {"key": "per-channel", "value": "per-token"}
METRIC = "attention_output"
# a band's coupled setting may spend at most this many bits per element on its codebooks
# (amortised over --tokens): c4b10's 1.33 at SmolLM2's shape is a different budget
CODEBOOK_ALLOWANCE = 0.5


def run(capture: str, settings, iters: int, layers) -> dict:
    import sys

    from kvlens.analysis.compare import CompareConfig, compare_axes
    from kvlens.capture.store import open_capture

    with open_capture(capture) as cap:
        head_dim = cap.meta.head_dim
    # per-token groups must divide head_dim (compare-axes sweeps both axes at each G)
    groups = tuple(g for g in GROUP_SIZES if head_dim % g == 0)
    config = CompareConfig(bits=SCALAR_BITS, group_sizes=groups, variants=("coupled",),
                           coupled=tuple(settings), coupled_iters=iters, layers=layers)

    def progress(done, total, what):
        print(f"  {done}/{total} {what}", file=sys.stderr, flush=True)

    return compare_axes(capture, config, progress=progress).to_dict()


def tables(result: dict, tokens: int, meta_bits: int = 16) -> str:
    from kvlens.quant.coupled import parse_coupled, scalar_bits_per_element

    summary = result["summary"]
    cap = summary["capture"]
    heads, head_dim = cap["num_key_value_heads"], cap["head_dim"]
    per_layer: dict[tuple, list[float]] = defaultdict(list)
    for r in result["records"]:
        if r["metric"] != METRIC:
            continue
        if r["format"] and r["format"].startswith("coupled:"):
            name = r["format"].split(":", 1)[1]
        elif r["format"] is None and r["variant"] == "plain" and \
                r["axis"] == SCALAR_AXIS[r["tensor"]]:
            name = f"{r['bits']}b G{r['group_size']}"
        else:
            continue
        per_layer[(r["tensor"], name, r["layer"])].append(r["rel_error"])
    layer_mean = {k: sum(v) / len(v) for k, v in per_layer.items()}
    layers = sorted({k[2] for k in layer_mean})
    mean = defaultdict(list)
    for (tensor, name, _), v in layer_mean.items():
        mean[(tensor, name)].append(v)
    mean = {k: sum(v) / len(v) for k, v in mean.items()}  # mean over layers of head means

    held = {}
    for _, name in mean:
        if name.startswith("c"):
            spec = parse_coupled(name)
            held[name] = (spec.bits_per_element(tokens, heads, head_dim), spec.bits_per_channel)
        else:
            b, g = name.split("b G")
            held[name] = (scalar_bits_per_element(int(b), int(g), 32),
                          scalar_bits_per_element(int(b), int(g), meta_bits))

    def best_scalar(tensor, budget, column):
        fits = [(mean[(tensor, n)], n) for t, n in mean
                if t == tensor and not n.startswith("c") and held[n][column] <= budget + 1e-9]
        return min(fits) if fits else (None, None)

    split = summary.get("coupled", {})
    out = [f"capture {cap['path']} ({cap['model']}): {len(layers)} layers, {heads} KV heads, "
           f"head_dim {head_dim}; {split.get('note', '')}: fitted on samples "
           f"{split.get('fitted_on_samples')}, measured on samples "
           f"{split.get('measured_on_samples')} ({cap['samples']} x {cap['tokens']} tokens). "
           f"Coupled held bits amortise the codebooks over {tokens} tokens of one sequence.", ""]
    out += ["| tensor | band | coupled (best) | held bits | output error | best scalar <= "
            "its held bits (fp16 meta) | held | output error | coupled / scalar | best scalar "
            "<= its held bits (8-bit meta) | output error | best scalar <= band (fp16 meta) | "
            "output error |",
            "|---|---:|---|---:|---:|---|---:|---:|---:|---|---:|---|---:|"]
    winners = {}

    def cell(name, err):
        return f"{name or '-'} | {'-' if err is None else f'{err:.4f}'}"

    for tensor in ("key", "value"):
        for band in BANDS:
            cands = [(mean[(tensor, n)], n) for t, n in mean
                     if t == tensor and n.startswith("c") and abs(held[n][1] - band) < 1e-9
                     and held[n][0] <= band + CODEBOOK_ALLOWANCE]
            if not cands:
                continue
            err, name = min(cands)
            s_err, s_name = best_scalar(tensor, held[name][0], 0)
            m_err, m_name = best_scalar(tensor, held[name][0], 1)
            b_err, b_name = best_scalar(tensor, band, 0)
            winners[(tensor, band)] = (name, m_name)
            ratio = f"{err / s_err:.2f}" if s_err else "-"
            out.append(f"| {tensor} | {band:.1f} | {name} | {held[name][0]:.2f} | {err:.4f} | "
                       f"{s_name or '-'} | {held[s_name][0] if s_name else 0:.2f} | "
                       f"{'-' if s_err is None else f'{s_err:.4f}'} | {ratio} | "
                       f"{cell(m_name, m_err)} | {cell(b_name, b_err)} |")
    out += ["", "All coupled settings (output error, mean over layers and heads) and the best "
            "scalar layout holding no more bits:", "",
            "| tensor | setting | code bits | held bits | output error | scalar (fp16 meta) | "
            "output error | scalar (8-bit meta) | output error |",
            "|---|---|---:|---:|---:|---|---:|---|---:|"]
    for (tensor, name), err in sorted(mean.items()):
        if name.startswith("c"):
            s_err, s_name = best_scalar(tensor, held[name][0], 0)
            m_err, m_name = best_scalar(tensor, held[name][0], 1)
            out.append(f"| {tensor} | {name} | {held[name][1]:.2f} | {held[name][0]:.2f} | "
                       f"{err:.4f} | {cell(s_name, s_err)} | {cell(m_name, m_err)} |")
    out += ["", "Per layer, attention-output error: the band's coupled setting / the best scalar "
            "layout (8-bit meta) holding no more bits:", ""]
    cols = [(t, b) for t in ("key", "value") for b in BANDS if (t, b) in winners]
    out.append("| layer | " + " | ".join(f"{t[0].upper()} {b:.1f}" for t, b in cols) + " |")
    out.append("|---:|" + "---:|" * len(cols))
    for layer in layers:
        cells = []
        for t, b in cols:
            c, s = winners[(t, b)]
            cv = layer_mean.get((t, c, layer))
            sv = layer_mean.get((t, s, layer)) if s else None
            cells.append(f"{cv:.3f} / {sv:.3f}" if sv is not None else f"{cv:.3f} / -")
        out.append(f"| {layer} | " + " | ".join(cells) + " |")
    wins = {(t, b): sum(layer_mean[(t, winners[(t, b)][0], la)]
                        < layer_mean[(t, winners[(t, b)][1], la)] for la in layers)
            for t, b in cols if winners[(t, b)][1]}
    out += ["", "Layers where coupled is lower: " + ", ".join(
        f"{t} {b:.1f}: {n}/{len(layers)}" for (t, b), n in wins.items())]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", nargs="?", help="capture file (kvlens capture)")
    parser.add_argument("--load", help="re-render a result saved with --save")
    parser.add_argument("--save", help="write the compare-axes result JSON here")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--iters", type=int, default=10, help="Lloyd rounds per codebook")
    parser.add_argument("--layers", default=None, help="e.g. 0,4,8-11 (default all)")
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens of one sequence the codebooks are amortised over")
    args = parser.parse_args(argv)
    if args.load:
        with open(args.load) as f:
            result = json.load(f)
    else:
        if not args.capture:
            parser.error("give a CAPTURE or --load")
        from kvlens.analysis.compare import parse_layers

        result = run(args.capture, args.settings.split(","), args.iters,
                     parse_layers(args.layers))
        if args.save:
            with open(args.save, "w") as f:
                json.dump(result, f)
    print(tables(result, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
