"""Decode speed on CPU: kvlens compressed cache (torch path) vs transformers' default cache.

For each context length: prefill ``ctx`` tokens, then time ``--steps`` single-token decode
forwards; report the median seconds per token, tokens/s ratio (compressed / default) and KV
bytes (compressed measured by ``kvlens.cache.memory_report``; default = bytes of its tensors).

    python benchmarks/bench_decode_cpu.py --contexts 512,2048,4096 --preset kivi-2

Never run in CI (minutes of CPU). Timings on a shared 2-core machine are noisy, so the two
caches are measured **interleaved**: both are prefilled, then each step runs one default-cache
forward and one compressed-cache forward back to back (both inside ``compressed_attention``;
the default cache's layers carry no kvlens tag, so they take the model's own attention, at the
cost of one attribute lookup per layer). ``slowdown`` is the median of the per-step ratios,
which cancels load that changes slower than a step; the medians of each side are reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _interleaved_times(model, ids, caches: list[dict], steps: int) -> list[list[float]]:
    """Prefill every cache, then time single-token decode steps, alternating the caches."""
    with torch.no_grad():
        nxt = [model(ids, use_cache=True, **kw).logits[:, -1:].argmax(-1) for kw in caches]
        times = [[] for _ in caches]
        for _ in range(steps):
            for i, kw in enumerate(caches):
                t = time.perf_counter()
                out = model(nxt[i], use_cache=True, **kw)
                times[i].append(time.perf_counter() - t)
                nxt[i] = out.logits[:, -1:].argmax(-1)
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
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 0 keeps torch's default (OMP_NUM_THREADS or all cores)")
    ap.add_argument("--backend", default="torch", help="auto, torch or triton")
    args = ap.parse_args()
    if args.threads:
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
        with compressed_attention(model, config, backend=args.backend) as session:
            ccache = session.new_cache()
            t_def, t_cmp = _interleaved_times(model, ids, [{name: cache}, {name: ccache}],
                                              args.steps)
        def_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2
                        for layer in cache.layers)
        rep = memory_report(ccache)
        row = {"context": ctx, "default_s_per_token": statistics.median(t_def),
               "compressed_s_per_token": statistics.median(t_cmp),
               "default_kv_bytes": def_bytes, "compressed_kv_bytes": rep["kv_bytes"],
               "kv_bytes_fp16": rep["kv_bytes_fp16"],
               "bits_per_element": rep["bits_per_element"], "backend": session.backend_reason}
        row["slowdown"] = statistics.median(c / d for c, d in zip(t_cmp, t_def, strict=True))
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
