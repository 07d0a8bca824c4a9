"""Model families kvlens refuses before any weight loads, and why.

Every other causal LM transformers ships is tried: ``kvlens.model.architecture.describe`` reads
what kvlens needs from the loaded model and refuses, in one ``error:`` line, what it cannot
hook. The families here are known not to work, so a user learns it from the model's
``config.json`` (or GGUF header) alone, without waiting for the weights. The tested matrix of
families that work is docs/reference/architectures.md (tests/test_architectures.py).
"""

from __future__ import annotations

from kvlens.errors import ModelLoadError

_NO_KV = ("has no attention layer, hence no KV cache (every layer keeps a fixed-size "
          "recurrent state): there is nothing for kvlens to quantize")
_SHARED = ("shares KV caches between layers (some layers read another layer's cache), which "
           "kvlens' capture and cache do not model")
_SPARSE = ("selects the keys each query reads with a learned indexer (sparse attention over "
           "an indexed cache), which kvlens' attention does not model")
_ENCODER = "is an encoder or encoder-decoder model; kvlens analyses decoder-only causal LMs"

#: model_type (config.json) or GGUF general.architecture -> why kvlens refuses it
REFUSED: dict[str, str] = {
    "mamba": _NO_KV, "mamba2": _NO_KV, "falcon_mamba": _NO_KV, "rwkv": _NO_KV,
    "xlstm": _NO_KV, "rwkv6": _NO_KV, "rwkv7": _NO_KV,
    "gemma3n": _SHARED, "gemma3n_text": _SHARED, "gemma4": _SHARED, "gemma4_text": _SHARED,
    "deepseek_v32": _SPARSE, "glm_moe_dsa": _SPARSE,
    "t5": _ENCODER, "t5gemma": _ENCODER, "bart": _ENCODER, "bert": _ENCODER,
    "roberta": _ENCODER, "whisper": _ENCODER,
}


def refusal(model_type: str) -> str | None:
    """Why kvlens refuses ``model_type`` (``None``: it does not, or the type is unknown)."""
    return REFUSED.get(model_type.lower()) if model_type else None


def check_family(model_type: str, where: str = "") -> None:
    """Raise ``ModelLoadError`` for a family in ``REFUSED`` (before any weight loads)."""
    why = refusal(model_type)
    if why is not None:
        src = f" ({where})" if where else ""
        raise ModelLoadError(f"Unsupported model type {model_type!r}{src}: it {why}. "
                             "docs/reference/architectures.md lists the families kvlens supports.")
