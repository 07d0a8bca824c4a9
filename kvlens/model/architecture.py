"""What kvlens needs to know about a loaded model's attention, in one frozen dataclass.

Shapes and RoPE facts are read from the model config and its attention modules; an
architecture kvlens cannot hook raises ``ModelLoadError`` naming the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlens.errors import ModelLoadError

_ROPE_CONFIG_KEYS = ("rope_parameters", "rope_theta", "rotary_dim", "rotary_pct",
                     "partial_rotary_factor", "rotary_emb_base")


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    declares_rope: bool
    rope: dict[str, Any] = field(default_factory=dict)

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def attention_modules(model) -> list:
    """The self-attention module of each decoder layer, in layer order."""
    found = {}
    for _, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if idx is None or not isinstance(idx, int):
            continue
        name = type(module).__name__.lower()
        if "attention" in name and "flash" not in name and idx not in found:
            found[idx] = module
    return [found[i] for i in sorted(found)]


def decoder_layers(model) -> list:
    """The decoder layer (the module holding the self-attention) of each layer, in layer
    order."""
    parents = {}
    for _, module in model.named_modules():
        for child in module.children():
            parents[id(child)] = module
    return [parents[id(m)] for m in attention_modules(model)]


def rope_config(config) -> dict[str, Any]:
    """RoPE parameters as plain JSON-able values (empty when the model declares none)."""
    out: dict[str, Any] = {}
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict):
        out.update({k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))})
    for key in _ROPE_CONFIG_KEYS[1:]:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)):
            out[key] = value
    return out


def describe(model) -> ModelInfo:
    config = _text_config(model.config)
    modules = attention_modules(model)
    if not modules:
        raise ModelLoadError(
            f"Unsupported model {type(model).__name__}: no attention modules with a layer index "
            "were found. kvlens supports decoder-only HF causal LMs that use transformers' "
            "attention interface (Llama, Mistral, Qwen2/3, Gemma3, GPT-NeoX, Phi3, GPT-2, ...)."
        )
    if any(getattr(m, "is_causal", True) is False for m in modules):
        raise ModelLoadError(
            f"Unsupported model {type(model).__name__}: its attention is not causal (an encoder "
            "such as BERT). kvlens analyses KV caches of decoder-only causal LMs.")
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(modules[0], "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and hidden and n_heads:
        head_dim = hidden // n_heads
    if not (n_heads and n_kv and head_dim):
        raise ModelLoadError(f"Unsupported model {type(model).__name__}: cannot read head counts.")
    rope = rope_config(config)
    return ModelInfo(
        architecture=type(model).__name__,
        model_type=str(getattr(config, "model_type", "unknown")),
        num_layers=len(modules),
        num_attention_heads=int(n_heads),
        num_key_value_heads=int(n_kv),
        head_dim=int(head_dim),
        declares_rope=bool(rope) or any(hasattr(config, k) for k in _ROPE_CONFIG_KEYS),
        rope=rope,
    )
