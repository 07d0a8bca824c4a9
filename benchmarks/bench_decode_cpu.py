"""Decode speed on CPU: kvlens compressed cache (torch path) vs transformers' default cache.

For each context length: prefill ``ctx`` tokens, then time ``--steps`` single-token decode
forwards; report the median seconds per token, tokens/s ratio (compressed / default) and KV
bytes (compressed measured by ``kvlens.cache.memory_report``; default = bytes of its tensors).

    python benchmarks/bench_decode_cpu.py --contexts 512,2048,4096 --preset kivi-2

Never run in CI (minutes of CPU). Timings on a shared 2-core machine are noisy: compare the
two caches in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _decode_times(model, ids, cache_kwargs, steps: int) -> list[float]:
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(nxt, use_cache=True, **cache_kwargs)
            times.append(time.perf_counter() - t)
            nxt = out.logits[:, -1:].argmax(-1)
    return times


def main() -> None:
    from transformers import DynamicCache

    from kvlens.cache import compressed_attention, memory_report
    from kvlens.corpus import load_text
    from kvlens.hf import cache_argument_name
    from kvlens.kvconfig import resolve
    from kvlens.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="kivi-2")
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, _ = load_model(args.model, device="cpu")
    config = resolve(args.preset)
    name = cache_argument_name(model)
    text, _ = load_text(None)
    base = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = base.repeat(1, -(-ctx // base.shape[1]))[:, :ctx]
        cache = DynamicCache()
        t_def = _decode_times(model, ids, {name: cache}, args.steps)
        def_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2
                        for layer in cache.layers)
        with compressed_attention(model, config, backend="torch") as session:
            ccache = session.new_cache()
            t_cmp = _decode_times(model, ids, {name: ccache}, args.steps)
        rep = memory_report(ccache)
        row = {"context": ctx, "default_s_per_token": statistics.median(t_def),
               "compressed_s_per_token": statistics.median(t_cmp),
               "default_kv_bytes": def_bytes, "compressed_kv_bytes": rep["kv_bytes"],
               "kv_bytes_fp16": rep["kv_bytes_fp16"],
               "bits_per_element": rep["bits_per_element"]}
        row["slowdown"] = row["compressed_s_per_token"] / row["default_s_per_token"]
        row["tokens_per_s_ratio"] = 1 / row["slowdown"]
        row["kv_bytes_ratio_vs_default"] = rep["kv_bytes"] / def_bytes
        row["kv_bytes_ratio_vs_fp16"] = rep["kv_bytes"] / rep["kv_bytes_fp16"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| context | default ms/token | kivi ms/token | slowdown | tokens/s ratio | "
          "KV bytes vs default (fp32) | KV bytes vs fp16 | bits/elem |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {1e3 * r['default_s_per_token']:.1f} | "
              f"{1e3 * r['compressed_s_per_token']:.1f} | {r['slowdown']:.2f}x | "
              f"{r['tokens_per_s_ratio']:.2f} | {r['kv_bytes_ratio_vs_default']:.3f} | "
              f"{r['kv_bytes_ratio_vs_fp16']:.3f} | {r['bits_per_element']:.2f} |")


if __name__ == "__main__":
    main()
