"""Why transformers' HQQ cache with ``axis=0`` (its default) loses far more than per-channel
groups would, and that kvlens's ``hqq-strided`` layout reproduces it: relative reconstruction
error of SmolLM2's keys and values (every layer, the held-out text), quantized once with hqq's
``axis=0`` (groups of ``G`` elements ``numel / G`` apart: one channel, tokens strided over the
whole history and across heads), the same re-quantized at every window flush as
``QuantizedLayer`` does (first at the prompt's ``--chunk`` tokens, then every ``--residual``
tokens, the dequantized history with the new window), kvlens's ``hqq-strided`` store fed the
same flushes, and per-channel groups of ``G`` consecutive tokens of one head (``fit="hqq"``,
kvlens's simulation before the layout)::

    OMP_NUM_THREADS=1 python benchmarks/studies/hqq_strided_groups.py --tokens 1024

Needs the ``hf-caches`` extra (hqq).
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    import torch
    from hqq.core.quantize import Quantizer

    from kvlens.layouts.hqq_strided import HqqStrided
    from kvlens.model.load import load_model
    from kvlens.quant import QuantSpec
    from kvlens.quant.reference import dequantize, quantize
    from kvlens.text.heldout import heldout_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--residual", type=int, default=128)
    args = ap.parse_args(argv)

    model, tok, _ = load_model(args.model)
    ids = tok(heldout_text(), return_tensors="pt").input_ids[:, :args.tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values

    def hqq(x):
        codes, meta = Quantizer.quantize(x.contiguous(), nbits=args.bits, axis=0,
                                         group_size=args.group, device="cpu",
                                         compute_dtype=torch.float32)
        meta["compute_dtype"] = torch.float32
        return Quantizer.dequantize(codes, meta)

    def flushed(x):
        held, t = hqq(x[:, :, :args.chunk]), args.chunk
        store = HqqStrided(args.bits, args.group).new_store(x.shape[-1], args.residual,
                                                            "float32")
        store.append(x[:, :, :args.chunk])
        store.settle()  # the prompt is quantized on its own, as transformers does
        while t + args.residual <= x.shape[2]:
            held = hqq(torch.cat([held, x[:, :, t:t + args.residual]], dim=2))
            store.append(x[:, :, t:t + args.residual])
            store.settle()
            t += args.residual
        return held, store.dequantize_range(0, t), t

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    spec = QuantSpec(args.bits, "per-channel", args.group, fit="hqq")
    layers = cache.layers
    print(f"{args.tokens} tokens, {len(layers)} layers, {args.bits} bits, G{args.group}: mean "
          "relative error per layer")
    for what in ("keys", "values"):
        once = again = store = blocks = 0.0
        for layer in layers:
            x = getattr(layer, what).float()
            held, ours, t = flushed(x)
            ref = x[:, :, :t]
            again += rel(held, ref) / len(layers)
            store += rel(ours, ref) / len(layers)
            once += rel(hqq(ref), ref) / len(layers)
            blocks += rel(dequantize(quantize(ref, spec)), ref) / len(layers)
        print(f"{what}: hqq axis=0 once {once:.4f}, re-quantized at every flush {again:.4f}, "
              f"kvlens hqq-strided flushed alike {store:.4f}; per-channel G{args.group} "
              f"{blocks:.4f}")


if __name__ == "__main__":
    main()
