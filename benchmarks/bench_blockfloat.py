"""Write and read speed of the block-float engine stores (NVFP4, MXFP8, SGLang's fp4_e2m1) on the
torch path: append a history ``[1, H, T, D]`` in flush blocks of ``--block`` tokens, then
dequantize all of it, as a simulated engine cache does while it generates.

    OMP_NUM_THREADS=1 python benchmarks/bench_blockfloat.py --tokens 4096 --heads 3 --dim 64

Prints the median over ``--repeats`` runs of the appends and of the one read. Never run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlens.layouts import layout_from_dict, layout_of

LAYOUTS = ("nvfp4", "mxfp8", "fp4_e2m1")


def run(kind: str, x: torch.Tensor, block: int, repeats: int) -> tuple[float, float]:
    layout = layout_of(layout_from_dict({"layout": kind}, "uniform"))
    appends, reads = [], []
    for _ in range(repeats):
        store = layout.new_store(x.shape[-1], block)
        t0 = time.perf_counter()
        for i in range(0, x.shape[2], block):
            store.append(x[:, :, i:i + block])
        t1 = time.perf_counter()
        store.dequantize_range(0, x.shape[2])
        appends.append(t1 - t0)
        reads.append(time.perf_counter() - t1)
    return statistics.median(appends), statistics.median(reads)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=32, help="tokens per flush")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(1, args.heads, args.tokens, args.dim, generator=torch.Generator().manual_seed(0))
    print(f"{'layout':9s} {'append (ms)':>12s} {'read (ms)':>10s}   "
          f"[1, {args.heads}, {args.tokens}, {args.dim}], flush {args.block}")
    for kind in LAYOUTS:
        append, read = run(kind, x, args.block, args.repeats)
        print(f"{kind:9s} {append * 1e3:12.1f} {read * 1e3:10.1f}")


if __name__ == "__main__":
    main()
