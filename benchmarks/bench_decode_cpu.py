"""Decode speed on CPU: kvlens compressed caches (torch path) vs transformers' default cache.

For each context length: prefill ``ctx`` tokens once with the default cache (``DynamicCache``,
the model's dtype: float32 on CPU), fill every compressed cache from the same K/V (each layer's
``update`` + ``commit``, exactly what the model's forward would store: no second prefill), then
time ``--steps`` single-token decode forwards per cache; report the median seconds per token,
the slowdown versus the default cache and the KV bytes.

    python benchmarks/bench_decode_cpu.py --contexts 2048,8192,16384 --configs kivi-2,mixed-3bit

``--configs`` takes preset names, JSON config files (e.g. ``kvlens recommend -o``) and
``mixed-3bit``: a built-in per-layer mix shaped like ``recommend``'s SmolLM2 output at ~3 bits
(per-token 3-bit keys + per-channel 2-bit values G64 in most layers, 4-bit in the first two,
a KIVI-like 2-bit layer every third; residual window 128). Configs whose fill needs the model (pre-RoPE keys, MiKV
heavy hitters, an online balancer) are prefilled through the model instead (slow; say so).

Never run in CI (minutes of CPU). Timings on a shared 2-core machine are noisy, so the caches are
measured **interleaved**: each step runs one default-cache forward, then one forward per
compressed cache, back to back (all inside ``compressed_attention``; the default cache's layers
carry no kvlens tag, so they take the model's own attention). ``slowdown`` is the median of the
per-step ratios, which cancels load that changes slower than a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def mixed_3bit(num_layers: int):
    """A per-layer mix like ``recommend``'s SmolLM2 output at ~3 bits (see module doc)."""
    from kvlens.config import KVConfig, LayerKV
    from kvlens.quant import QuantSpec

    def kv(kb, kg, vb, vg):
        return LayerKV(QuantSpec(kb, *kg), QuantSpec(vb, *vg), 128)

    tok_ch = kv(3, ("per-token", 64), 2, ("per-channel", 64))
    layers = {0: kv(4, ("per-token", 64), 4, ("per-channel", 64)),
              1: kv(4, ("per-token", 64), 4, ("per-channel", 64))}
    for i in range(2, num_layers, 3):
        layers[i] = kv(2, ("per-channel", 64), 2, ("per-token", 64))
    return KVConfig(name="mixed-3bit", default=tok_ch, layers=layers,
                    description="bench_decode_cpu: recommend-like per-layer mix")


def _fillable(config) -> bool:
    m = config.protect
    pre = any(s.pre_rope_keys for s in (config.default, *config.layers.values()))
    heavy = m is not None and getattr(m.importance, "heavy_fraction", 0) > 0
    return not pre and (m is None or (not heavy and m.balancer != "online"))


def _fill(ccache, dcache, hq: int) -> None:
    """Store the default cache's K/V in the compressed cache, layer by layer."""
    for layer, src in zip(ccache.layers, dcache.layers, strict=True):
        layer.update(src.keys, src.values)
        b, _, t, d = src.keys.shape
        layer.commit(src.keys.new_zeros(b, hq, 1, d), None)  # query: only an online balancer
        # would read it (not fillable)


def _prefill(model, ids, cache, name: str, chunk: int = 2048):
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            out = model(ids[:, s:s + chunk], use_cache=True, **{name: cache})
    return out.logits[:, -1:].argmax(-1)


def main(argv=None) -> None:
    from transformers import DynamicCache

    from kvlens.cache import compressed_attention, memory_report
    from kvlens.config import resolve
    from kvlens.model.hooks import cache_argument_name
    from kvlens.model.load import load_model
    from kvlens.text.corpus import load_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default="kivi-2,mixed-3bit",
                    help="comma-separated presets, JSON config paths or mixed-3bit")
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 0 keeps torch's default (OMP_NUM_THREADS or all cores)")
    ap.add_argument("--backend", default="torch", help="auto, torch or triton")
    ap.add_argument("--json-out", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _ = load_model(args.model, device="cpu")
    n_layers = model.config.num_hidden_layers
    configs = [mixed_3bit(n_layers) if c == "mixed-3bit" else resolve(c)
               for c in args.configs.split(",")]
    name = cache_argument_name(model)
    hq = model.config.num_attention_heads
    text, _ = load_text(None)
    base = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = base.repeat(1, -(-ctx // base.shape[1]))[:, :ctx]
        t0 = time.perf_counter()
        dcache = DynamicCache()
        nxt = _prefill(model, ids, dcache, name)
        print(f"[{ctx}] prefill {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        sessions = [compressed_attention(model, c, backend=args.backend) for c in configs]
        entered = [s.__enter__() for s in sessions]
        try:
            caches = []
            for cfg, sess in zip(configs, entered, strict=True):
                cache = sess.new_cache()
                if _fillable(cfg):
                    _fill(cache, dcache, hq)
                    caches.append((cache, nxt))
                else:
                    print(f"[{ctx}] {cfg.name}: prefilled through the model", file=sys.stderr)
                    caches.append((cache, _prefill(model, ids, cache, name)))
            tokens = [nxt] + [c[1] for c in caches]
            all_caches = [dcache] + [c[0] for c in caches]
            times = [[] for _ in all_caches]
            with torch.no_grad():
                for _ in range(args.steps):
                    for i, cache in enumerate(all_caches):
                        t = time.perf_counter()
                        out = model(tokens[i], use_cache=True, **{name: cache})
                        times[i].append(time.perf_counter() - t)
                        tokens[i] = out.logits[:, -1:].argmax(-1)
        finally:
            for s in reversed(sessions):
                s.__exit__(None, None, None)
        def_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2
                        for layer in dcache.layers)
        load = open("/proc/loadavg").read().split()[0] if sys.platform == "linux" else "?"
        rows.append({"context": ctx, "cache": "default (DynamicCache, float32)",
                     "s_per_token": statistics.median(times[0]), "slowdown": 1.0,
                     "kv_bytes": def_bytes, "bits_per_element": 32.0, "load": load})
        for cfg, (cache, _), t_c, sess in zip(configs, caches, times[1:], entered, strict=True):
            rep = memory_report(cache)
            rows.append({"context": ctx, "cache": cfg.name, "s_per_token": statistics.median(t_c),
                         "slowdown": statistics.median(c / d for c, d in zip(t_c, times[0],
                                                                                strict=True)),
                         "kv_bytes": rep["kv_bytes"],
                         "bits_per_element": rep["bits_per_element"], "load": load,
                         "backend": sess.backend_reason})
        for r in rows[-len(all_caches):]:
            print(json.dumps(r), flush=True)
        del dcache, caches, all_caches
    print("\n| context | cache | ms/token | slowdown vs default | KV MB | bits/elem |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['cache']} | {1e3 * r['s_per_token']:.1f} | "
              f"{r['slowdown']:.2f}x | {r['kv_bytes'] / 1e6:.1f} | {r['bits_per_element']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
