"""Benchmark the Triton decode-attention kernel over the packed cache (GPU only; never in CI).

1. Correctness on the GPU: the fused kernel vs "dequantize with the reference, then attend" on
   a few shapes (fails loudly if any differs).
2. Timing (``triton.testing.do_bench``, median, L2 flushed) of one decode step for a
   Llama-2-7B-like layer (32 heads, d=128) and a GQA layer (32 query / 8 KV heads), contexts
   1k-128k, 2 and 4 bits, G = 32/64/128, a 128-token fp16 residual window, against torch SDPA
   on fp16 K/V of the same length (``enable_gqa=True``), for each ``--layouts`` entry: ``kivi``
   (per-channel keys, per-token values), ``tokch`` (per-token keys, per-channel values:
   ``recommend``'s usual SmolLM2 choice), ``tensor`` (per-tensor, one scale per 128-token
   block), ``tok3`` (3-bit per-token keys and per-channel values, densely packed: 8 codes in 3 bytes),
   ``kivi8`` (KIVI's layout with 8-bit group metadata, decoded in the kernel), ``cbk``
   (codebook keys, Lloyd-Max for the normal, renormalised: vLLM TurboQuant's key coding,
   beside per-token values; the keys ignore ``--groups``).
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

#: layout name -> (key granularity, value granularity, fixed bits or None, scale dtype)
LAYOUTS = {"kivi": ("per-channel", "per-token", None, "float16"),
           "tokch": ("per-token", "per-channel", None, "float16"),
           "tensor": ("per-tensor", "per-tensor", None, "float16"),
           "tok3": ("per-token", "per-channel", 3, "float16"),
           "kivi8": ("per-channel", "per-token", None, "8bit"),
           "cbk": ("codebook", "per-token", None, "float16")}
#: the codebook of the codebook keys (kvlens.quant.codebook: vLLM TurboQuant's)
KEY_CODEBOOK = "lloyd-max-normal"
BLOCK = 128  # flush block F of the generic stores (per-tensor: one scale per block)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+",
                   default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4], choices=[2, 4, 8])
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128], choices=[32, 64, 128])
    p.add_argument("--layers", nargs="+", default=["mha", "gqa"], choices=["mha", "gqa"],
                   help="mha = 32/32 heads (Llama-2-7B), gqa = 32/8 heads; d = 128")
    p.add_argument("--layouts", nargs="+", default=["kivi"], choices=list(LAYOUTS),
                   help="packed layouts to time (see the module doc)")
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
    """KIVI's layout (per-channel keys, per-token values, both groups of ``group``, fp16 scales)
    built by the cache's own ``PackedTensor`` as ``_generic`` does, with a flush block of
    ``group`` tokens so that ``t`` need only be a multiple of ``group``: returns the kernel's
    positional packed arguments, a random fp16 residual window and the fp16 K/V quantized."""
    from kvlens.layouts.packed import PackedTensor
    from kvlens.quant import QuantSpec

    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.float16)
    stores = []
    for x, gran in ((k, "per-channel"), (v, "per-token")):
        st = PackedTensor.create(QuantSpec(bits, gran, group), group, d, "float16")
        st.append(x.float())
        stores.append(st)
    packed = tuple(x for st in stores for x in (st.codes, st.scale, st.zero))
    rk = torch.randn(b, hkv, residual, d, device="cuda", dtype=torch.float16)
    rv = torch.randn_like(rk)
    return packed, (rk, rv), (k, v)


def _generic(torch, layout, b, hkv, t, d, bits, group):
    """Packed K/V of ``layout`` built by the cache's own ``PackedTensor`` (reference quantizer),
    ``t`` a multiple of ``BLOCK``: returns the kernel arguments and the dequantized K/V."""
    from kvlens.layouts.packed import PackedTensor
    from kvlens.quant import QuantSpec

    kg, vg, fixed, scale_dtype = LAYOUTS[layout]
    bits = fixed or bits
    args, deq = {}, []
    for name, gran in (("k", kg), ("v", vg)):
        if gran == "codebook":
            st, book_args = _codebook_store(torch, name, b, hkv, t, d, bits)
            args.update(book_args)
            deq.append(st.dequantize_range(0, t))
            continue
        spec = QuantSpec(bits, gran, None if gran == "per-tensor" else group)
        st = PackedTensor.create(spec, BLOCK, d, scale_dtype)
        st.append(torch.randn(b, hkv, t, d, device="cuda"))
        kgroup = {"per-channel": group, "per-tensor": BLOCK, "per-token": group}[gran]
        args.update({f"{name}_codes": st.codes, f"{name}_scale": st.scale,
                     f"{name}_zero": st.zero, f"{name}_bits": bits, f"{name}_group": kgroup,
                     f"{name}_layout": gran,
                     f"{name}_zero_unit": st.zero_unit})
        deq.append(st.dequantize_range(0, t))
    return args, deq


def _codebook_store(torch, name, b, hkv, t, d, bits):
    """Codebook-coded keys as the cache holds them (``kvlens.layouts.codebook.CodebookStore``,
    renormalised, ``KEY_CODEBOOK``) and the kernel's arguments for them."""
    from kvlens.layouts import layout_of
    from kvlens.quant import CodebookSpec

    spec = CodebookSpec(bits, KEY_CODEBOOK, None, renormalize=True)
    st = layout_of(spec).new_store(d, BLOCK)
    st.append(torch.randn(b, hkv, t, d, device="cuda"))
    return st, {f"{name}_codes": st.packed, f"{name}_scale": st.norms, f"{name}_zero": None,
                f"{name}_bits": bits, f"{name}_group": None, f"{name}_layout": "codebook",
                f"{name}_centroids": st.codebook.centroids.to(st.packed.device),
                f"{name}_renormalize": True}


def check_layouts(torch, layouts) -> None:
    """Every non-KIVI layout on the GPU vs dequantize (reference) then attend, odd lengths."""
    from kvlens_kernels import decode_attention

    for layout in (x for x in layouts if x != "kivi"):
        for hq, hkv, t, bits, group, used in ((32, 8, 1024, 2, 64, 1000),
                                              (8, 1, 256, 4, 32, 255)):
            d = 128
            q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.float16)
            args, (kd, vd) = _generic(torch, layout, 1, hkv, t, d, bits, group)
            out = decode_attention(q, length=used, scaling=d ** -0.5, **args)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), kd[:, :, :used], vd[:, :, :used], enable_gqa=True, scale=d ** -0.5)
            err = (out.float() - ref).abs().max().item()
            if not math.isfinite(err) or err > 2e-2:
                sys.exit(f"GPU correctness check failed: {layout} Hq={hq} Hkv={hkv} T={used}: "
                         f"max abs error {err:.3g}")
            print(f"check ok: {layout} Hq={hq} Hkv={hkv} T={used} max|err|={err:.2e}",
                  file=sys.stderr)


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


def _time_one(torch, triton, decode_attention, q, layout, b, hkv, t, d, bits, group, residual,
              sdpa, fp16_bytes, bw, layer) -> dict:
    hq = q.shape[1]
    if layout == "kivi":
        n = max(group, (t - residual) // group * group)
        packed, (rk, rv), _ = _store(torch, b, hkv, n, d, bits, group, t - n if t > n else 0)
        kw = dict(k_bits=bits, v_bits=bits, k_group=group, v_group=group)
        args = (*packed, n)
        tensors = list(packed)
    else:
        n = max(BLOCK, (t - residual) // BLOCK * BLOCK)
        kw, _ = _generic(torch, layout, b, hkv, n, d, bits, group)
        tensors = [v for v in kw.values() if hasattr(v, "numel")]
        args = tuple(kw.pop(k) for k in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                                         "v_zero")) + (n,)
        rk = torch.randn(b, hkv, max(t - n, 0), d, device="cuda", dtype=torch.float16)
        rv = torch.randn_like(rk)
    res = rk.shape[2]

    def step():
        return decode_attention(q, *args, scaling=d ** -0.5, residual_k=rk, residual_v=rv,
                                residual_len=res, **kw)

    ms = triton.testing.do_bench(step)
    moved = sum(x.numel() * x.element_size() for x in tensors) + 2 * rk.numel() * 2 + \
        2 * q.numel() * 2
    return dict(layer=layer, layout=layout, hq=hq, hkv=hkv, d=d, batch=b, context=t,
                bits=kw.get("k_bits", bits), group=group, residual=res, triton_ms=ms,
                sdpa_fp16_ms=sdpa, speedup=sdpa / ms, bytes=moved,
                gbps=moved / (ms * 1e-3) / 1e9, frac_copy_bw=moved / (ms * 1e-3) / bw,
                sdpa_frac_copy_bw=fp16_bytes / (sdpa * 1e-3) / bw)


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
            for layout in args.layouts:
                for bits in args.bits:
                    for group in args.groups:
                        rows.append(_time_one(torch, triton, decode_attention, q, layout, b,
                                              hkv, t, d, bits, group, args.residual, sdpa,
                                              fp16_bytes, bw, layer))
            torch.cuda.empty_cache()
    return rows, bw


def main(argv=None) -> None:
    args = parse_args(argv)
    _require_gpu()
    import torch

    if not args.skip_check:
        check(torch)
        check_layouts(torch, args.layouts)
    t0 = time.time()
    rows, bw = run(args)
    head = (f"{'layer':5} {'layout':6} {'ctx':>7} {'bits':>4} {'G':>4} {'triton ms':>10} "
            f"{'sdpa ms':>9} {'speedup':>7} {'GB/s':>7} {'%copy':>6}")
    print(head)
    for r in rows:
        print(f"{r['layer']:5} {r['layout']:6} {r['context']:>7} {r['bits']:>4} {r['group']:>4} "
              f"{r['triton_ms']:>10.4f} {r['sdpa_fp16_ms']:>9.4f} {r['speedup']:>7.2f} "
              f"{r['gbps']:>7.0f} {100 * r['frac_copy_bw']:>5.0f}%")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_gbps": bw / 1e9,
                   "seconds": time.time() - t0, "results": rows}, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
