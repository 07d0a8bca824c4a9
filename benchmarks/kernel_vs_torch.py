"""The fused Triton decode kernel against the torch read path on a real model, call by call.

Prefills a prompt and decodes ``--steps`` teacher-forced tokens with ``--config`` through the
triton backend; at every call the kernel serves (``kvlens.cache.triton_glue.triton_decode``),
the torch path (``kvlens.cache.torch_read.packed_attention``) reads the same layer state, and
the relative difference of the two outputs is kept. Prints the largest per layer and the
number of kernel calls. Same math, different float rounding (the kernel's fp16 dots): this
says how large that rounding is on real activations, layer by layer.

    TRITON_INTERPRET=1 python benchmarks/kernel_vs_torch.py --config vllm:turboquant_k3v4_nc
    TRITON_INTERPRET=1 python benchmarks/kernel_vs_torch.py --model gemma.gguf --config kivi-2

``--config``: a preset name, a JSON config file or an engine setting (``vllm:turboquant_*``).
On CPU the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, slow: about a
minute for a 135M model); on a CUDA GPU (``--device cuda``) compiled. Never run in CI.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
          "Italy is Rome. The capital of Spain is")


def _config(name: str, num_layers: int):
    from kvlens.config import load_config, preset
    from kvlens.config.engine import is_engine_setting
    from kvlens.deploy.presets import engine_config

    if is_engine_setting(name):
        return engine_config(name, num_layers=num_layers).config
    return load_config(name) if os.path.exists(name) else preset(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=8, help="teacher-forced decode steps")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import kvlens.cache.attention as attention
    from kvlens.cache import compressed_attention
    from kvlens.cache.torch_read import packed_attention
    from kvlens.cache.triton_glue import triton_decode
    from kvlens.model.hooks import cache_argument_name
    from kvlens.model.load import load_model

    model, tok, _ = load_model(args.model, device=args.device)
    config = _config(args.config, model.config.num_hidden_layers)
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(model.device)
    if ids.shape[1] <= args.steps:
        raise SystemExit(f"--steps {args.steps} must be below the prompt's {ids.shape[1]} tokens")
    worst: dict[int, float] = {}

    def compared(query, layer, mask, scaling):
        out, why = triton_decode(query, layer, mask, scaling)
        if why is None:
            ref, _ = packed_attention(query, layer, mask, scaling)
            rel = float((out.float() - ref.float()).norm() / ref.float().norm())
            worst[layer.layer_idx] = max(rel, worst.get(layer.layer_idx, 0.0))
        return out, why

    attention.triton_decode = compared  # restored below; this script owns the process
    try:
        with compressed_attention(model, config, backend="triton") as session, torch.no_grad():
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            split = ids.shape[1] - args.steps
            model(ids[:, :split], use_cache=True, **kw)
            for t in range(split, ids.shape[1]):
                model(ids[:, t:t + 1], use_cache=True, **kw)
    finally:
        attention.triton_decode = triton_decode
    print(f"{args.config}: kernel calls served on {len(worst)} layers; torch path for: "
          f"{session.torch_path_calls}")
    for layer, rel in sorted(worst.items()):
        print(f"layer {layer:3d}  max relative difference kernel vs torch {rel:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
