"""Time the reference quantizer per flushed block, min/max vs the least-squares fit (``fit:
mse``), and min/max with the 8-bit group metadata search (``kvlens.quant.meta8``, the cache's
default ``scale_dtype``): what the cache pays each time its window flushes. Prints ms per call (median of
repeats) for SmolLM2-like (3 KV heads, head_dim 64) and Gemma3-like (1 KV head, head_dim 256)
blocks; CPU, float32, the threads torch is given."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlens.quant import QuantSpec, quantize
from kvlens.quant.meta8 import quantize_meta8


def _time(x, spec, repeats, fn=quantize):
    fn(x, spec)  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x, spec)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| block | spec | minmax ms | mse ms | ratio | minmax + 8-bit metadata ms |")
    print("|---|---|---:|---:|---:|---:|")
    for hkv, d in ((3, 64), (1, 256)):
        for tokens in (32, 128):
            x = torch.randn(1, hkv, tokens, d)
            for gran, g in (("per-channel", 32), ("per-token", 64)):
                a = _time(x, QuantSpec(2, gran, g), args.repeats)
                b = _time(x, QuantSpec(2, gran, g, fit="mse"), args.repeats)
                c = _time(x, QuantSpec(2, gran, g), args.repeats, quantize_meta8)
                print(f"| [1, {hkv}, {tokens}, {d}] | 2b {gran} G{g} | {a:.3f} | {b:.3f} | "
                      f"{b / a:.1f}x | {c:.3f} |")


if __name__ == "__main__":
    main()
