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
_COMPRESSED = ("caches some layers in a learned compressed form (heavily compressed "
               "attention), which kvlens' capture and cache do not model")
_ENCODER = "is an encoder-decoder model; kvlens analyses decoder-only causal LMs"
_LEGACY = ("computes attention without transformers' attention interface, which kvlens hooks "
           "to read and replace the keys and values")
_OWN_CACHE = ("keeps a cache of its own type (lightning attention), which transformers does not "
              "let kvlens' cache replace")
_TWICE = ("attends twice per layer over one cache update (differential attention), which "
          "kvlens' cache, one attention call per update, does not model")
_PER_HEAD_MASK = ("masks each head differently (dynamic mask attention), which kvlens' cache "
                  "attention does not model")
_CYCLES = ("runs its layers in cycles, with cache layer indices beyond its layer count, which "
           "kvlens' cache does not model")

#: model_type (config.json) or GGUF general.architecture -> why kvlens refuses it (a survey of
#: transformers 5.24's causal LMs found each failing, with an error line, after loading)
REFUSED: dict[str, str] = {
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv6", "rwkv7", "xlstm"),
                    _NO_KV),
    **dict.fromkeys(("gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                     "gemma4_unified_text"), _SHARED),
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text", "hy_v4",
                     "qwen4_exp_text"), _SPARSE),
    "deepseek_v4": _COMPRESSED,
    **dict.fromkeys(("t5", "t5gemma", "bart", "whisper", "blenderbot", "blenderbot-small",
                     "marian", "mbart", "pegasus", "plbart", "bigbird_pegasus", "prophetnet",
                     "mvp"), _ENCODER),
    **dict.fromkeys(("bloom", "mpt", "falcon", "gpt_neo", "gptj", "codegen", "xglm",
                     "openai-gpt", "xlm", "xlnet", "reformer", "cpmant", "gpt_neox_japanese",
                     "rembert", "roformer", "megatron-bert", "big_bird", "trocr"), _LEGACY),
    "minimax": _OWN_CACHE, "diffllama": _TWICE, "doge": _PER_HEAD_MASK, "hrm_text": _CYCLES,
}


def check_family(model_type: str, where: str = "") -> None:
    """Raise ``ModelLoadError`` for a family in ``REFUSED`` (before any weight loads)."""
    why = REFUSED.get(model_type.lower()) if model_type else None
    if why is not None:
        src = f" ({where})" if where else ""
        raise ModelLoadError(f"Unsupported model type {model_type!r}{src}: it {why}. "
                             "docs/reference/architectures.md lists the families kvlens supports.")
