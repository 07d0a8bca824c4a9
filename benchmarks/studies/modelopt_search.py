"""Does NVIDIA ModelOpt's per-layer search (``mtq.auto_quantize``, ``method="kl_div"``) run on a
CPU, and can a KV-cache format be one of its per-layer choices? (docs/lab-notes/modelopt.md)

Runs under a Python with ``nvidia-modelopt`` and transformers installed, on an HF folder of the
model (``benchmarks/engine_checks.py`` exports kvlens's embedded SmolLM2 to ``OUT/model``), two
batches of held-out token ids (a JSON list, as engine_checks.py writes ``OUT/vllm/ids.json``).
For each candidate set it prints the search's result or its error, and which KV-side quantizers
the searched model has enabled.

    VENV/bin/python benchmarks/studies/modelopt_search.py --model-dir out-engines-cpu/model \\
        --ids out-engines-cpu/vllm/ids.json
"""

from __future__ import annotations

import argparse
import json
import time

CANDIDATES = {"weights-fp8-nvfp4": ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"],
              "weights-fp8": ["FP8_DEFAULT_CFG"],
              "kv": ["FP8_KV_CFG", "NVFP4_KV_CFG"]}  # KV presets offered as per-layer choices
KV_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer", "output_quantizer")


def search(model_dir: str, ids: list[int], tokens: int, bits: float, sets: list[str]) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    batches = [torch.tensor(ids[i * tokens:(i + 1) * tokens])[None] for i in range(2)]
    for label in sets:
        formats = CANDIDATES[label]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        start = time.time()
        try:
            model, state = mtq.auto_quantize(
                model, constraints={"effective_bits": bits}, quantization_formats=formats,
                data_loader=batches, forward_step=lambda m, b: m(b).logits, method="kl_div",
                num_calib_steps=2, num_score_steps=2)
        except Exception as exc:  # the point of the study: say what refused, and go on
            print(f"{label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            continue
        best = state.get("best", {})
        chosen = sorted({str(r) for r in best.get("recipe", {}).values()})
        kv_on = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if n.endswith(KV_QUANTIZERS) and getattr(m, "is_enabled", False)})
        print(f"{label}: ran in {time.time() - start:.0f} s; formats chosen: {chosen}; "
              f"KV-side quantizers enabled: {kv_on or 'none'}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="an HF folder of the model")
    parser.add_argument("--ids", required=True, help="JSON list of held-out token ids")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per batch (2 batches)")
    parser.add_argument("--effective-bits", type=float, default=8.0, help="the weight budget")
    parser.add_argument("--sets", default=",".join(CANDIDATES),
                        help=f"comma list of candidate sets: {', '.join(CANDIDATES)}")
    args = parser.parse_args(argv)
    sets = [x for x in args.sets.split(",") if x]
    unknown = [x for x in sets if x not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidate set {', '.join(unknown)}; allowed: {', '.join(CANDIDATES)}")
    with open(args.ids, encoding="utf-8") as f:
        ids = json.load(f)
    search(args.model_dir, ids, args.tokens, args.effective_bits, sets)


if __name__ == "__main__":
    main()
