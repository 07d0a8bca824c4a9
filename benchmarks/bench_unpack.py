"""Torch-path unpack speed per code width: the CPU decode's per-chunk cost of turning packed
codes into float32 (``kvlens.cache.torch_read.unpack_rows`` / ``unpack_cols``).

    OMP_NUM_THREADS=1 python benchmarks/bench_unpack.py --tokens 4096 --heads 3 --dim 64

For each width it packs random codes the way the cache stores one chunk (keys packed along
tokens, ``[1, H, T*W/U, D]``; values along channels, ``[1, H, T, packed_length(D)]``) and
reports the median time of ``--repeats`` unpacks and nanoseconds per code. 1-, 2-, 4- and 8-bit
codes never straddle a byte (one uint8 shift); 3-bit codes are packed densely (8 in 3 bytes)
and are joined into an int32 word per unit first. Before dense packing, 3-bit codes were stored
in 4-bit containers, so the 4-bit row is what a 3-bit chunk cost then. Never run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlens.cache.torch_read import unpack_cols, unpack_rows
from kvlens.quant import pack_codes


def _time(fn, repeats: int) -> float:
    fn()  # warm the workspace
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per chunk")
    ap.add_argument("--heads", type=int, default=3, help="KV heads")
    ap.add_argument("--dim", type=int, default=64, help="head_dim")
    ap.add_argument("--bits", default="2,3,4,8")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    n = args.heads * args.tokens * args.dim
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); chunk [1, "
          f"{args.heads}, {args.tokens}, {args.dim}] = {n} codes")
    print("| bits | keys (along tokens) ms | ns/code | values (along channels) ms | ns/code |")
    print("|---:|---:|---:|---:|---:|")
    for bits in (int(b) for b in args.bits.split(",")):
        codes = torch.randint(0, 1 << bits, (1, args.heads, args.tokens, args.dim), generator=g,
                              dtype=torch.uint8)
        # contiguous, as the cache's buffers are (pack_codes along dim 2 returns a permuted view)
        rows = pack_codes(codes, bits, dim=2).contiguous()
        cols = pack_codes(codes, bits, dim=3).contiguous()
        assert torch.equal(unpack_rows(rows, bits), codes.float())  # unpacks what was packed
        assert torch.equal(unpack_cols(cols, bits, args.dim), codes.float().transpose(-1, -2))
        tk = _time(lambda rows=rows, bits=bits: unpack_rows(rows, bits), args.repeats)
        tv = _time(lambda cols=cols, bits=bits: unpack_cols(cols, bits, args.dim), args.repeats)
        print(f"| {bits} | {tk * 1e3:.3f} | {tk / n * 1e9:.2f} | {tv * 1e3:.3f} | "
              f"{tv / n * 1e9:.2f} |")


if __name__ == "__main__":
    main()
