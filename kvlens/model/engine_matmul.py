"""llama.cpp's CPU matrix products as a model run: the activations a quantized GGUF weight meets.

llama.cpp's CPU ``mul_mat`` converts each activation row to the weight type's ``vec_dot_type``
(``ggml-cpu.c``, ``type_traits_cpu``) and dots in integers; kvlens multiplies float activations
by dequantized weights, so it rounds them here as llama.cpp does (why this matters for a
KV-cache comparison: docs/deploy/llamacpp.md). ``matmul_types`` maps each quantized
``nn.Linear`` to its GGUF weight type (llama-style names, ``lm_head`` from ``output`` or the tied
``token_embd``); ``engine_matmuls`` hooks those modules' inputs and removes the hooks on exit.
Not modelled: the ``m * s`` term of Q4_1/Q5_1 weights (far below the activation rounding),
weight types outside ``WEIGHT_VEC_DOT``, float weights and every other op.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from kvlens.quant.llamacpp_cpu import VEC_DOT_TYPE, convert_rows

_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_BLK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
#: a quantized weight type -> the type its activations are converted to (``type_traits_cpu``)
WEIGHT_VEC_DOT = {t: v for t, v in VEC_DOT_TYPE.items() if v.startswith("q8")} | {
    t: "q8_k" for t in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")}


def gguf_tensor_types(gguf_path: str) -> dict[str, str]:
    """GGUF tensor name -> ggml type name, lower case (``q4_1``, ``f32`` ...)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return {t.name: t.tensor_type.name.lower() for t in reader.tensors}


def matmul_types(model, gguf_path: str) -> tuple[dict[str, str], list[str]]:
    """``(types, unmodelled)``: ``nn.Linear`` module name -> its GGUF weight type, for the
    weight types whose activation conversion is modelled (``WEIGHT_VEC_DOT``); ``unmodelled``:
    ``"module: type"`` for the quantized Linear weights that are not (K-quants)."""
    import torch

    tensors = gguf_tensor_types(gguf_path)
    by_module = {}
    for name, ttype in tensors.items():
        m = _BLK.fullmatch(name)
        if m and m[2] in _GGUF_TO_HF:
            by_module[f"layers.{m[1]}.{_GGUF_TO_HF[m[2]]}"] = ttype
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    types, unmodelled = {}, []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        key = next((k for k in by_module if name.endswith(k)), None)
        ttype = by_module.get(key) if key else (head if name.endswith("lm_head") else None)
        if ttype in WEIGHT_VEC_DOT:
            types[name] = ttype
        elif ttype is not None and ttype not in ("f32", "f16", "bf16"):
            unmodelled.append(f"{name}: {ttype}")
    return types, unmodelled


@contextmanager
def engine_matmuls(model, types: dict[str, str]) -> Iterator[int]:
    """Run ``model`` with the inputs of the modules in ``types`` converted to their weight
    type's vec_dot type (module docstring); yields how many modules are hooked."""
    handles = []
    for name, mod in model.named_modules():
        if name not in types:
            continue
        vdt = WEIGHT_VEC_DOT[types[name]]

        def pre(module, args, _vdt=vdt):
            x = args[0]
            return (convert_rows(x, _vdt)[0].to(x.dtype), *args[1:])
        handles.append(mod.register_forward_pre_hook(pre))
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
