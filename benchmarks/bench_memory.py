"""Memory the compressed cache really adds to the process, beside what ``memory_report`` says.

For each config and prompt length: with the model already loaded, record the process-level
memory, fill a fresh cache with the prompt (chunked prefill) and 4 decode steps, free the
activations, and record again; the growth is what the cache holds as the process sees it.
CPU: resident set size from /proc/self/statm after ``gc.collect()`` and glibc's
``malloc_trim(0)`` (so freed activations are returned to the OS); CUDA:
``torch.cuda.memory_allocated`` (and the peak, ``max_memory_allocated``). Printed beside it:
``memory_report``'s held bytes and bits per element, and the formula's prediction
(``kvlens.cache.layout.config_bits``).

    python benchmarks/bench_memory.py --configs fp16,kivi-2,kivi-4,out/recommended.json \
        --contexts 2048,4096,8192

Never run in CI (minutes of CPU). RSS moves in pages and the allocator keeps some freed memory,
so the process figure is noisy at the level of a few MB; the cache figures are exact.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import time

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _process_bytes(device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _fill(model, ids, session, chunk: int, steps: int):
    from kvlens.model.hooks import cache_argument_name

    cache = session.new_cache()
    kw = {cache_argument_name(model): cache}
    with torch.no_grad():
        for c0 in range(0, ids.shape[1], chunk):
            out = model(ids[:, c0:c0 + chunk], use_cache=True, logits_to_keep=1, **kw)
        nxt = out.logits[:, -1:].argmax(-1)
        del out
        for _ in range(steps):
            nxt = model(nxt, use_cache=True, **kw).logits[:, -1:].argmax(-1)
    return cache


def main(argv=None) -> None:
    from kvlens.cache import compressed_attention, memory_report
    from kvlens.cache.layout import config_bits, shape_of
    from kvlens.config import resolve
    from kvlens.model.load import load_model
    from kvlens.text.corpus import load_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default="fp16,kivi-2,kivi-4")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--chunk", type=int, default=0,
                    help="prefill chunk (0 = the whole prompt in one forward: the cache's bytes "
                         "do not depend on the chunking, and one forward is much faster here)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    model, tok, source = load_model(args.model)
    device = next(model.parameters()).device
    shape = shape_of(model)
    text, _ = load_text(None)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    need = max(int(c) for c in args.contexts.split(",")) + args.steps
    while ids.shape[1] < need:  # repeat the corpus for long prompts (memory does not care)
        ids = torch.cat((ids, ids), dim=1)
    ids = ids.to(device)
    print(f"model {source.display_name} ({shape.num_layers} layers, {shape.num_key_value_heads} KV heads, "
          f"head_dim {shape.head_dim}); {device}; process memory = "
          f"{'torch.cuda.memory_allocated' if device.type == 'cuda' else 'RSS after malloc_trim'}")
    header = (f"{'config':<22} {'tokens':>6} {'report MiB':>10} {'process MiB':>11} "
              f"{'report bits':>11} {'formula bits':>12} {'vs fp16':>8} {'s':>5}")
    print(header)
    # warm-up: the first forward passes allocate for good (thread pools, kernel caches);
    # measured before any of them, the first row would count ~0.5 GB that is not the cache
    with compressed_attention(model, resolve("exact")) as session:
        first = min(int(c) for c in args.contexts.split(","))
        _fill(model, ids[:, :first], session, args.chunk or first, 1)
    rows = []
    fp16_bytes = {}
    for spec in args.configs.split(","):
        config = resolve(spec)
        for ctx in (int(c) for c in args.contexts.split(",")):
            before = _process_bytes(device)
            t0 = time.perf_counter()
            with compressed_attention(model, config, backend="auto") as session:
                cache = _fill(model, ids[:, :ctx], session, args.chunk or ctx, args.steps)
            seconds = time.perf_counter() - t0
            after = _process_bytes(device)
            rep = memory_report(cache)
            tokens = ctx + args.steps
            if config.name == "fp16" and not config.compressed:
                fp16_bytes[ctx] = rep["kv_bytes"]
            row = {"config": config.name, "tokens": tokens, "report_bytes": rep["kv_bytes"],
                   "process_bytes": after - before, "report_bits": rep["bits_per_element"],
                   "formula_bits": config_bits(config, shape, tokens),
                   "breakdown": rep["breakdown"], "seconds": seconds}
            ratio = rep["kv_bytes"] / fp16_bytes[ctx] if ctx in fp16_bytes else float("nan")
            row["ratio_vs_fp16"] = ratio
            rows.append(row)
            print(f"{config.name:<22} {tokens:>6} {rep['kv_bytes'] / 2**20:>10.2f} "
                  f"{(after - before) / 2**20:>11.2f} {rep['bits_per_element']:>11.3f} "
                  f"{row['formula_bits']:>12.3f} {ratio:>8.3f} {seconds:>5.0f}", flush=True)
            del cache
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
