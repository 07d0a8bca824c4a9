"""Capture cost vs a plain forward pass, and HDF5 write throughput, on SmolLM2.

Prints: plain forward time for S x T tokens (batch 1 per sample, as capture runs), capture time
(forward + RoPE inversion + fp16 conversion + HDF5 writes), their ratio, and MB/s written.
Usage: python benchmarks/bench_capture.py [--samples 4] [--tokens 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--storage-dtype", default="float16")
    args = ap.parse_args(argv)

    import torch

    from kvlens.capture.run import capture_model
    from kvlens.model.load import load_model
    from kvlens.text.corpus import load_text, token_windows

    model, tokenizer, _ = load_model(None, device="cpu")
    text, _ = load_text(None)
    windows = token_windows(tokenizer, text, args.samples, args.tokens)

    def plain():
        with torch.no_grad():
            for s in range(windows.shape[0]):
                model(input_ids=windows[s:s + 1], use_cache=False)

    plain()  # warm-up
    plain_times, cap_times, sizes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            t0 = time.perf_counter()
            plain()
            plain_times.append(time.perf_counter() - t0)
            path = os.path.join(tmp, f"run{r}.h5")
            t0 = time.perf_counter()
            summary = capture_model(model, windows, path, storage_dtype=args.storage_dtype)
            cap_times.append(time.perf_counter() - t0)
            sizes.append(summary.file_bytes)
    fwd, cap = statistics.median(plain_times), statistics.median(cap_times)
    mb = sizes[0] / 1e6
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"SmolLM2-135M, {args.samples} x {args.tokens} tokens, all 30 layers, "
          f"storage {args.storage_dtype}, median of {args.repeats}")
    print(f"plain forward : {fwd:7.2f} s")
    print(f"capture       : {cap:7.2f} s   ratio {cap / fwd:.2f}x")
    print(f"file          : {mb:7.1f} MB   write throughput {mb / cap:.0f} MB/s "
          f"(overall, incl. forward)")


if __name__ == "__main__":
    main()
