"""Projected `kvlens recommend` cost for larger models (a projection, not a measurement).

Applies the cost model (`kvlens.recommend.cost`, rates measured on the 2-core reference machine)
to the shapes of public models at recommend's defaults (`RecommendOptions(budget_bits=3.0)`),
and prints per stage the projected time and peak memory: on the reference CPU with the model
stages in float32 and in bfloat16 (`--dtype bfloat16`: half the weights' memory; timed at the
float32 rates), and with the model stages on one H100 in bfloat16 (the published peak times
`kvlens.recommend.cost.GPU_EFFICIENCY`, an assumption; the candidate errors stay on the CPU).
The two real models kvlens measured are listed first so that the projection can be read
against `docs/benchmarks.md`'s measured times.

    python benchmarks/recommend_projection.py
"""

from __future__ import annotations

import argparse

from kvlens.model.shape import ModelShape
from kvlens.recommend import RecommendOptions
from kvlens.recommend.catalog import candidates, family_probes
from kvlens.recommend.cost import GPU_MEMORY_BYTES, CostShape, Hardware, predict

# name: (layers, q heads, kv heads, head_dim, parameters, vocabulary, hidden size), from the
# models' configs
MODELS = {
    "SmolLM2-135M": (30, 9, 3, 64, 134_515_008, 49_152, 576),
    "Gemma3-270M": (18, 4, 1, 256, 268_098_176, 262_144, 640),
    "Llama-3.2-1B": (16, 32, 8, 64, 1_235_814_400, 128_256, 2048),
    "Llama-3.1-8B": (32, 32, 8, 128, 8_030_261_248, 128_256, 4096),
    "Llama-3.1-70B": (80, 64, 8, 128, 70_553_706_496, 128_256, 8192),
}


def shape_for(layers, q_heads, kv_heads, head_dim, params, vocab, hidden,
              weight_bytes: int = 4) -> CostShape:
    opts = RecommendOptions(budget_bits=3.0)  # what `kvlens recommend -b 3.0` runs
    cands = candidates(head_dim, opts, True)
    return CostShape(model=ModelShape(layers, q_heads, kv_heads, head_dim), layers=layers,
                     samples=4, tokens=opts.tokens, score_from=opts.score_from,
                     candidates=len(cands) + 2, streams=len(opts.streams()) + 1,
                     families=len(family_probes(cands)), sensitivity_tokens=opts.tokens,
                     probe_tokens=opts.retrieval_tokens, params=params, vocab=vocab,
                     hidden=hidden, workers=2,  # the reference machine's two cores
                     weight_bytes=weight_bytes)


HARDWARE = ((Hardware(None, "float32"), 4), (Hardware(None, "bfloat16"), 2),
            (Hardware("h100", "bfloat16"), 2))


def _fmt(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min"


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for hw, weight_bytes in HARDWARE:
        print(f"\n{hw.label}\n")
        print("| model | candidate errors | layout sensitivity | retrieval probe | total | "
              "host peak | GPU memory |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, dims in MODELS.items():
            cost = predict(shape_for(*dims, weight_bytes=weight_bytes),
                           hardware=hw if hw.gpu else None)
            st = cost.stages
            gpu = f"{cost.device_bytes / 2**30:.1f} GiB" if cost.device_bytes else "-"
            if hw.gpu and cost.device_bytes > GPU_MEMORY_BYTES[hw.gpu]:
                gpu += " (more than one GPU holds: --device-map)"
            print(f"| {name} | {_fmt(st['candidate errors'])} | "
                  f"{_fmt(st['layout sensitivity'])} | {_fmt(st['retrieval probe'])} | "
                  f"{_fmt(cost.seconds)} | {cost.peak_bytes / 2**30:.1f} GiB | {gpu} |")


if __name__ == "__main__":
    main()
