"""Benchmark the Triton decode-attention kernel over the packed cache (GPU only; never in CI).

1. Correctness on the GPU: the fused kernel vs "dequantize with the reference, then attend" on
   a few shapes (fails loudly if any differs).
2. Timing (``triton.testing.do_bench``, median, L2 flushed) of one decode step for a
   Llama-2-7B-like layer (32 heads, d=128) and a GQA layer (32 query / 8 KV heads), contexts
   1k-128k, 2 and 4 bits, G = 32/64/128, a 128-token fp16 residual window, against torch SDPA
   on fp16 K/V of the same length (``enable_gqa=True``).
3. Bytes moved (codes + scales + residual + q/out) / latency, as a fraction of the measured
   device-to-device copy bandwidth.

Prints a table and writes JSON (``--out``). Usage::

    python benchmarks/bench_kernels.py --contexts 1024 4096 32768 131072 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+",
                   default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4], choices=[2, 4, 8])
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128], choices=[32, 64, 128])
    p.add_argument("--layers", nargs="+", default=["mha", "gqa"], choices=["mha", "gqa"],
                   help="mha = 32/32 heads (Llama-2-7B), gqa = 32/8 heads; d = 128")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--residual", type=int, default=128, help="fp16 residual window tokens")
    p.add_argument("--out", default="bench_kernels.json", help="JSON results path")
    p.add_argument("--skip-check", action="store_true", help="skip the GPU correctness check")
    return p.parse_args(argv)


def _require_gpu():
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). The "
                 "CPU-interpreter correctness tests are `pytest tests/test_kernels_*.py`.")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        sys.exit(f"bench_kernels.py needs triton ({exc}); pip install -e '.[triton]'.")


def _copy_bandwidth(torch, triton) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def _store(torch, b, hkv, t, d, bits, group, residual):
    from kvlens_kernels import quantize_pack_keys, quantize_pack_values

    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16)
    kc, ks, kz = quantize_pack_keys(k, bits, group)
    vc, vs, vz = quantize_pack_values(v, bits, group)
    rk = torch.randn(b, hkv, residual, d, device="cuda", dtype=torch.float16)
    rv = torch.randn_like(rk)
    return (kc, ks, kz, vc, vs, vz), (rk, rv), (k, v)


def check(torch) -> None:
    """Fused kernel vs reference dequantize-then-attend on the GPU."""
    from kvlens_kernels import decode_attention

    from kvlens.quant import QuantSpec, dequantize, quantize

    for hq, hkv, t, bits, group in ((32, 32, 1000, 2, 32), (32, 8, 4133, 4, 128),
                                    (8, 1, 257, 2, 64)):
        d = 128
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.float16)
        n = t // group * group
        packed, (rk, rv), (k, v) = _store(torch, 1, hkv, n, d, bits, group, t - n)
        out = decode_attention(q, *packed, n, k_bits=bits, v_bits=bits, k_group=group,
                               v_group=group, scaling=d ** -0.5, residual_k=rk, residual_v=rv,
                               residual_len=t - n)
        kd = dequantize(quantize(k.float(), QuantSpec(bits, "per-channel", group))).half()
        vd = dequantize(quantize(v.float(), QuantSpec(bits, "per-token", group))).half()
        kd, vd = torch.cat((kd, rk), 2), torch.cat((vd, rv), 2)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), kd.float(), vd.float(), enable_gqa=True, scale=d ** -0.5)
        err = (out.float() - ref).abs().max().item()
        if not math.isfinite(err) or err > 2e-2:
            sys.exit(f"GPU correctness check failed: Hq={hq} Hkv={hkv} T={t} {bits}b G{group}: "
                     f"max abs error {err:.3g}")
        print(f"check ok: Hq={hq} Hkv={hkv} T={t} {bits}b G{group} max|err|={err:.2e}",
              file=sys.stderr)


def run(args) -> tuple[list[dict], float]:
    import torch
    import triton
    import triton.testing
    from kvlens_kernels import decode_attention

    bw = _copy_bandwidth(torch, triton)
    print(f"measured copy bandwidth: {bw / 1e9:.0f} GB/s", file=sys.stderr)
    rows = []
    d, b = 128, args.batch
    for layer in args.layers:
        hq, hkv = (32, 32) if layer == "mha" else (32, 8)
        for t in args.contexts:
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
            kf = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16)
            vf = torch.randn_like(kf)
            sdpa = triton.testing.do_bench(lambda q=q, kf=kf, vf=vf: torch.nn.functional.
                                           scaled_dot_product_attention(q, kf, vf,
                                                                        enable_gqa=True))
            fp16_bytes = 2 * kf.numel() * 2
            del kf, vf
            for bits in args.bits:
                for group in args.groups:
                    n = max(group, (t - args.residual) // group * group)
                    packed, (rk, rv), _ = _store(torch, b, hkv, n, d, bits, group,
                                                 t - n if t > n else 0)
                    res = rk.shape[2]

                    def step(q=q, packed=packed, rk=rk, rv=rv, n=n, res=res, bits=bits,
                             group=group):
                        return decode_attention(q, *packed, n, k_bits=bits, v_bits=bits,
                                                k_group=group, v_group=group,
                                                scaling=d ** -0.5, residual_k=rk,
                                                residual_v=rv, residual_len=res)

                    ms = triton.testing.do_bench(step)
                    moved = sum(x.numel() * x.element_size() for x in packed) + \
                        2 * rk.numel() * 2 + 2 * q.numel() * 2
                    rows.append(dict(layer=layer, hq=hq, hkv=hkv, d=d, batch=b, context=t,
                                     bits=bits, group=group, residual=res, triton_ms=ms,
                                     sdpa_fp16_ms=sdpa, speedup=sdpa / ms, bytes=moved,
                                     gbps=moved / (ms * 1e-3) / 1e9,
                                     frac_copy_bw=moved / (ms * 1e-3) / bw,
                                     sdpa_frac_copy_bw=fp16_bytes / (sdpa * 1e-3) / bw))
                    del packed, rk, rv
            torch.cuda.empty_cache()
    return rows, bw


def main(argv=None) -> None:
    args = parse_args(argv)
    _require_gpu()
    import torch

    if not args.skip_check:
        check(torch)
    t0 = time.time()
    rows, bw = run(args)
    head = (f"{'layer':5} {'ctx':>7} {'bits':>4} {'G':>4} {'triton ms':>10} {'sdpa ms':>9} "
            f"{'speedup':>7} {'GB/s':>7} {'%copy':>6}")
    print(head)
    for r in rows:
        print(f"{r['layer']:5} {r['context']:>7} {r['bits']:>4} {r['group']:>4} "
              f"{r['triton_ms']:>10.4f} {r['sdpa_fp16_ms']:>9.4f} {r['speedup']:>7.2f} "
              f"{r['gbps']:>7.0f} {100 * r['frac_copy_bw']:>5.0f}%")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_gbps": bw / 1e9,
                   "seconds": time.time() - t0, "results": rows}, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
