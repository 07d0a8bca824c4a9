"""Which engine arithmetic a whole run uses: llama.cpp's matrix products
(``kvlens.model.engine_matmul``) apply to every config of a run, the exact reference included,
because the engine's own reference (its f16 cache) runs through them too. A run is a llama.cpp
run when some config attends with llama.cpp's arithmetic, no config is another engine's setting
or a ``:noarith`` one, and the model is a GGUF file with quantized weights."""

from __future__ import annotations

import os

from kvlens.evaluation.frontier import PARTIAL_LLAMACPP
from kvlens.model.engine_matmul import matmul_types


def llamacpp_matmul_plan(configs, source, model) -> tuple[dict[str, str], list[str]]:
    """``(types, notes)``: the Linear modules to hook (empty unless a llama.cpp run) and the
    notes to print; ``configs`` may include transformers baselines (no engine arithmetic)."""
    llama = [c.name for c in configs
             if (getattr(c, "engine_attention", None) or "").startswith("llamacpp")]
    if not llama:
        return {}, []
    others = [c.name for c in configs
              if getattr(getattr(c, "default", None), "engine", False)
              and not getattr(c, "engine_attention", None)]
    if others:
        return {}, [f"llama.cpp's matrix-product arithmetic is not simulated in this run: "
                    f"{', '.join(others)} run another engine's (or the model's) arithmetic; "
                    "compare llama.cpp settings in a run of their own for the engine's "
                    "figures."]
    if source is None or source.kind != "gguf":
        return {}, ["llama.cpp's matrix-product arithmetic needs the model's GGUF weight "
                    "types; this model is not a GGUF file, so only the attention arithmetic "
                    "is simulated."]
    types, unmodelled = matmul_types(model, os.path.join(source.location, source.gguf_file))
    notes = []
    if types:
        kinds = sorted(set(types.values()))
        notes.append(f"llama.cpp's CPU matrix products simulated for every config, exact "
                     f"included (the engine's own reference runs them too): the inputs of "
                     f"{len(types)} Linear layers with {'/'.join(kinds)} weights are converted "
                     f"to q8 as llama.cpp's CPU path does (:noarith turns this off).")
    if unmodelled:
        notes.append(f"llama.cpp's activation conversion is not simulated for "
                     f"{len(unmodelled)} Linear layers whose weight type kvlens does not "
                     f"model (e.g. {unmodelled[0]}).")
    return types, notes


def mark_partial_llamacpp(results, configs, types: dict[str, str]) -> None:
    """Mark (``engine_arithmetic = PARTIAL_LLAMACPP``) the results of llama.cpp settings
    (aligned with ``configs``) when the run did not simulate the engine's matrix products
    (``types`` empty): their KLD is below what the engine itself loses."""
    for r, c in zip(results, configs):
        if not types and (getattr(c, "engine_attention", None) or "").startswith("llamacpp"):
            r["engine_arithmetic"] = PARTIAL_LLAMACPP
