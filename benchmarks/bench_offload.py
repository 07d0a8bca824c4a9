"""SmolLM2 loaded whole vs placed by accelerate with part of it offloaded to disk (CPU only).

For each placement, in a fresh process (so peak RSS is that placement's): load time, capture
time (1 x T tokens, all 30 layers, float16 storage), and compressed generation (kivi-2, a
T-token prompt, N new tokens: prefill time and time per decoded token), medians of --repeats.
Prints a table and the weights each placement put on each device.

Usage: python benchmarks/bench_offload.py [--tokens 256] [--new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

PLACEMENTS = {  # name -> load_model placement kwargs
    "whole (no map)": {},
    "map, all in memory": {"device_map": "auto", "max_memory": "cpu=4GiB"},
    "cpu=300MB, rest disk": {"device_map": "auto", "max_memory": "cpu=300MB"},
    "cpu=200MB, rest disk": {"device_map": "auto", "max_memory": "cpu=200MB"},
}


def run_one(name: str, tokens: int, new_tokens: int, repeats: int) -> dict:
    import torch

    from kvlens.cache import compressed_attention
    from kvlens.capture.run import capture_model
    from kvlens.config import preset
    from kvlens.evaluation.decode import greedy
    from kvlens.model.load import load_model
    from kvlens.model.placement import weights_by_device
    from kvlens.text.corpus import load_text, token_windows

    with tempfile.TemporaryDirectory() as tmp:
        kwargs = dict(PLACEMENTS[name])
        if "device_map" in kwargs:
            kwargs["offload_folder"] = os.path.join(tmp, "offload")
        t0 = time.perf_counter()
        model, tok, _ = load_model(None, device="cpu", **kwargs)
        load_s = time.perf_counter() - t0
        text, _ = load_text(None)
        ids = token_windows(tok, text, 1, tokens)
        cap, prefill, decode = [], [], []
        config = preset("kivi-2")
        for r in range(repeats):
            t0 = time.perf_counter()
            capture_model(model, ids, os.path.join(tmp, f"c{r}.h5"))
            cap.append(time.perf_counter() - t0)
            with compressed_attention(model, config) as session:
                t0 = time.perf_counter()
                greedy(model, ids, session, 1)
                t1 = time.perf_counter()
                out, _ = greedy(model, ids, session, new_tokens + 1)
                t2 = time.perf_counter()
            prefill.append(t1 - t0)
            decode.append(((t2 - t1) - (t1 - t0)) / new_tokens)
        return {"name": name, "load_s": load_s, "capture_s": statistics.median(cap),
                "prefill_s": statistics.median(prefill),
                "decode_ms_per_token": 1000 * statistics.median(decode),
                "weights_by_device": weights_by_device(model),
                "tokens": out[0].tolist(),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one placement, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.tokens, args.new_tokens, args.repeats)))
        return
    rows = []
    for name in PLACEMENTS:
        out = subprocess.run([sys.executable, __file__, "--one", name, "--tokens",
                              str(args.tokens), "--new-tokens", str(args.new_tokens),
                              "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"done: {name}", file=sys.stderr)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch threads {rows[0]['threads']}; SmolLM2-135M float32 (513 MiB of weights); "
          f"capture 1 x {args.tokens} tokens; kivi-2 generation from a {args.tokens}-token "
          f"prompt, {args.new_tokens} new tokens; medians of {args.repeats}")
    print(f"{'placement':24} {'load s':>7} {'capture s':>9} {'prefill s':>9} "
          f"{'decode ms/tok':>13} {'peak RSS MiB':>12}  weights by device (MiB)")
    for r in rows:
        where = ", ".join(f"{d} {b / 2**20:.0f}" for d, b in r["weights_by_device"].items())
        print(f"{r['name']:24} {r['load_s']:7.1f} {r['capture_s']:9.2f} {r['prefill_s']:9.2f} "
              f"{r['decode_ms_per_token']:13.0f} {r['peak_rss_mib']:12.0f}  {where}")
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"generated tokens identical across placements: {same}")


if __name__ == "__main__":
    main()
