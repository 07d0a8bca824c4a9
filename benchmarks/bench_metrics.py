"""Time ``attention_errors_many`` (variants batched by kind) against its one-variant-at-a-time
reference loop (``attention_errors_reference``) on a SmolLM2-like layer, as ``kvlens
recommend`` calls it: ``reconstruction=False``, queries from a late row, a streaming exact
mask, key-only and value-only variants from real quantizers. Prints seconds per call (median
of alternating repeats, wall and process CPU time) and the median speedup of the pairs; CPU,
float32, one thread unless ``--threads``."""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from kvlens.analysis.attention import streaming_exact_mask
from kvlens.analysis.metrics import Variant, attention_errors_many, attention_errors_reference
from kvlens.quant import QuantSpec, fake_quantize


def _variants(x: torch.Tensor, count: int, tensor: str) -> list[Variant]:
    """``count`` quantized copies of ``x`` over bits x granularity x group size (cycled)."""
    specs = [QuantSpec(bits, gran, group) for bits, gran, group in itertools.product(
        (2, 3, 4, 5, 6, 8), ("per-token", "per-channel"), (16, 32, 64))]
    out = []
    for spec in itertools.islice(itertools.cycle(specs), count):
        x_hat = fake_quantize(x, spec)
        out.append(Variant(k_hat=x_hat) if tensor == "key" else Variant(v_hat=x_hat))
    return out


def _paired(ref, fast, repeats: int) -> dict[str, float]:
    """Median seconds (wall and this process's CPU) of ``ref`` and ``fast`` called in
    alternation, and the median of the per-pair ratios: robust to load that drifts on a
    shared machine."""
    ref(), fast()  # warm-up
    wall: dict[str, list[float]] = {"ref": [], "fast": []}
    cpu: dict[str, list[float]] = {"ref": [], "fast": []}
    for _ in range(repeats):
        for name, fn in (("ref", ref), ("fast", fast)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    med = statistics.median
    return {"ref": med(wall["ref"]), "fast": med(wall["fast"]),
            "ref_cpu": med(cpu["ref"]), "fast_cpu": med(cpu["fast"]),
            "speedup": med([r / f for r, f in zip(wall["ref"], wall["fast"], strict=True)]),
            "speedup_cpu": med([r / f for r, f in zip(cpu["ref"], cpu["fast"], strict=True)])}


def _max_rel_diff(got, want) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        for field in ("scores", "weights", "output"):
            a, b = getattr(g, field), getattr(w, field)
            if a is not None:
                diff = ((a - b).abs() / b.abs()).nan_to_num(0.0)
                worst = max(worst, float(diff.max()))
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--from-row", type=int, default=384, help="first query row measured")
    ap.add_argument("--keys", type=int, default=60, help="key-only variants")
    ap.add_argument("--values", type=int, default=40, help="value-only variants")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d = args.samples, 9, 3, args.tokens, 64
    q = torch.randn(b, hq, t, d, generator=gen)
    k = torch.randn(b, hkv, t, d, generator=gen) * 2 + torch.randn(1, hkv, 1, d, generator=gen)
    v = torch.randn(b, hkv, t, d, generator=gen)
    rows = q[:, :, args.from_row:]
    exact = streaming_exact_mask(t, residual_tokens=64, flush_tokens=32,
                                 sink_tokens=4)[args.from_row:]
    keys, values = _variants(k, args.keys, "key"), _variants(v, args.values, "value")
    kw = dict(scaling=d ** -0.5, exact=exact, reconstruction=False)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"B={b} Hq={hq} Hkv={hkv} T={t} D={d}, queries {args.from_row}..{t - 1}, "
          f"median of {args.repeats}")
    print("| variants | reference s | batched s | speedup | reference CPU s | batched CPU s "
          "| CPU speedup | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, group in ((f"{len(keys)} key", keys), (f"{len(values)} value", values),
                        (f"{len(keys)} key + {len(values)} value", keys + values)):
        t = _paired(lambda g=group: attention_errors_reference(rows, k, v, g, **kw),
                    lambda g=group: attention_errors_many(rows, k, v, g, **kw), args.repeats)
        diff = _max_rel_diff(attention_errors_many(rows, k, v, group, **kw),
                             attention_errors_reference(rows, k, v, group, **kw))
        print(f"| {name} | {t['ref']:.3f} | {t['fast']:.3f} | {t['speedup']:.1f}x "
              f"| {t['ref_cpu']:.3f} | {t['fast_cpu']:.3f} | {t['speedup_cpu']:.1f}x "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
