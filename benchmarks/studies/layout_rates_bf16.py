"""Would bfloat16 forwards make recommend's layout-sensitivity stage faster at the same rates?

The layout stage (``kvlens.recommend.sensitivity.layout_factors``) is most of ``recommend``'s
time: one model forward per storage family and layer. On a CPU with AVX512-BF16 a bfloat16
matrix product is several times faster than a float32 one, so this script measures, on a few
layers of a capture, each family's rate (KL per unit of attention-output error, exactly as the
stage computes it) three ways: float32 (what recommend does), the whole model in bfloat16, and
float32 weights under ``torch.autocast`` to bfloat16 (products in bfloat16, the residual stream
in float32). It prints seconds per layer row and how the bfloat16 rates differ from the float32
ones (log-rate correlation, mean and spread of the log ratio, share of family pairs within a
layer ordered the same way). One thread, as a worker process measures. A benchmark, not a test.

    python benchmarks/studies/layout_rates_bf16.py CAPTURE.h5 [--layers 0,6,12,18,24,29]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import time
from dataclasses import replace

import torch

from kvlens.analysis.compare import torch_threads
from kvlens.analysis.metrics import attention_errors_many
from kvlens.analysis.sensitivity import perturbed_kl
from kvlens.capture.store import open_capture
from kvlens.recommend import RecommendOptions, candidates, family, family_probes
from kvlens.recommend.layer_errors import layer_variants
from kvlens.recommend.probe import load_model_for
from kvlens.recommend.sensitivity import layout_tokens


def layout_row(layer, meta, probes, opts, keep: int, kl) -> dict:
    """One layer's ``{family: KL rate}`` for every probe, as the layout stage measures it (a
    copy of the per-layer step of ``kvlens.recommend.sensitivity.layout_factors``, which has
    no public one-layer entry point; balancers fitted here on the layer, as
    ``measure`` fits them). ``kl`` is ``perturbed_kl``'s measuring function."""
    n = opts.tokens
    with torch_threads(1):
        q, k, v, variants, _, _ = layer_variants(layer, meta, probes, opts, None)
        got = [c for c in probes if variants.get(c) is not None]
        la = layer.attrs
        errs = attention_errors_many(q[:, :, n - keep:], k, v, [variants[c] for c in got],
                                     scaling=la.scaling, sliding_window=la.sliding_window,
                                     softcap=la.logit_softcap, reconstruction=False)
    row = {}
    for c, e in zip(got, errs):
        var, err = variants[c], float(e.output.mean())
        damage = kl(layer.index, key=var.k_hat - k) if c.tensor == "key" else \
            kl(layer.index, value=var.v_hat - v)
        if err > 0:
            row[family(c)] = damage / err
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layers (default: six spread over the depth)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    opts = RecommendOptions(budget_bits=3.0)  # what `kvlens recommend` measures
    with open_capture(args.capture) as cap:
        meta = cap.meta
        layers = [int(x) for x in args.layers.split(",")] if args.layers else \
            sorted({round(i * (meta.shape.num_layers - 1) / 5) for i in range(6)})
        model, _ = load_model_for(cap, opts, [])
        n = layout_tokens(opts, meta.num_tokens)
        ids = cap.tokens()[:1, :n]
        probes = family_probes(candidates(meta.shape.head_dim, opts, meta.shape.has_rope))
        keep = n // 2
        # as layout_factors: one window (the largest), every token quantized
        largest = max(opts.window_sizes)
        one = replace(opts, samples=1, tokens=n, windows=(largest,))
        ways = {
            "float32": (model, contextlib.nullcontext),
            "bfloat16 model": (copy.deepcopy(model).to(torch.bfloat16), contextlib.nullcontext),
            "bfloat16 autocast": (model, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        }
        rates = {}
        for name, (m, ctx) in ways.items():
            with ctx(), perturbed_kl(m, ids, keep) as kl:
                start = time.perf_counter()
                rates[name] = [layout_row(cap.layer(i), meta, probes, one, keep, kl)
                               for i in layers]
            print(f"{name:18s} {(time.perf_counter() - start) / len(layers):6.2f} s per layer "
                  f"row ({len(probes)} families, {n} tokens, layers {layers})", flush=True)
    exact = rates["float32"]
    for name in list(ways)[1:]:
        other = rates[name]
        pairs = [(math.log(r[f]), math.log(other[i][f])) for i, r in enumerate(exact)
                 for f in r if f in other[i] and r[f] > 0 and other[i][f] > 0]
        a, b = zip(*pairs)
        diff = [y - x for x, y in pairs]
        same = total = 0
        for i, r in enumerate(exact):
            fams = [f for f in r if f in other[i]]
            for j, f in enumerate(fams):
                for g in fams[j + 1:]:
                    total += 1
                    same += (r[f] < r[g]) == (other[i][f] < other[i][g])
        print(f"{name:18s} log-rate correlation {statistics.correlation(a, b):.3f}; "
              f"log(rate / float32 rate) mean {statistics.mean(diff):+.3f} "
              f"(x{math.exp(statistics.mean(diff)):.2f}), sd {statistics.pstdev(diff):.3f}, "
              f"max |.| {max(map(abs, diff)):.3f}; family pairs in the same order within a "
              f"layer {same}/{total} ({same / total:.1%}); n = {len(pairs)} rates")


if __name__ == "__main__":
    main()
