"""What kvlens needs to know about a loaded model's attention: ``describe(model)``, its
``kvlens.model.shape.ModelShape``, read from its config and attention modules (head counts from
the modules: a config may carry a ``num_key_value_heads`` its architecture ignores). An
architecture kvlens cannot hook raises ``ModelLoadError`` naming the reason.

Every layer (``model.layers[i]``) has a kind: ``full``, ``sliding`` (a window of ``W`` tokens),
``chunked`` (attention inside chunks of ``C`` tokens): a KV cache that grows with the context;
``state``: a fixed-size state instead (linear attention, a Mamba/SSM mixer, a short
convolution), left exact; ``none``: no token mixing (only an MLP or MoE block).
"""

from __future__ import annotations

from typing import Any

from kvlens.errors import ModelLoadError, is_int
from kvlens.model.mla import is_mla, mla_shape
from kvlens.model.shape import ModelShape

_ROPE_CONFIG_KEYS = ("rope_theta", "rotary_dim", "rotary_pct", "partial_rotary_factor",
                     "rotary_emb_base")

KV_KINDS = ("full", "sliding", "chunked")
LAYER_KINDS = (*KV_KINDS, "state", "none")
# transformers' layer_types vocabulary -> (kvlens kind, holds a fixed-size state too)
_LAYER_TYPES = {
    "full_attention": ("full", False), "attention": ("full", False),
    "global_attention": ("full", False),
    "sliding_attention": ("sliding", False), "local_attention": ("sliding", False),
    "chunked_attention": ("chunked", False),
    "hybrid": ("full", True), "hybrid_sliding": ("sliding", True),
    "linear_attention": ("state", True), "conv": ("state", True), "mamba": ("state", True),
    "mamba2": ("state", True), "ssm": ("state", True), "recurrent": ("state", True),
    "mlp": ("none", False), "moe": ("none", False), "dummy": ("none", False),
}


def text_config(config):
    """The decoder's config (a multimodal model's text part; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # transformers versions without the decoder argument
        return get()


def _candidate_modules(model) -> dict[int, Any]:
    """Per layer index, the first module whose class name says attention (the first found in
    ``named_modules`` order is the layer's own: ``self_attn`` before anything it contains)."""
    found = {}
    for _, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not is_int(idx, 0):
            continue
        name = type(module).__name__.lower()
        if "attention" in name and "flash" not in name and idx not in found:
            found[idx] = module
    return found


def layer_kinds(config, found: dict[int, Any], architecture: str
                ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(kind per model layer, layers holding a fixed-size state)`` from the config's
    ``layer_types`` where it has them, else from the attention modules found and the config's
    ``sliding_window`` / ``attention_chunk_size`` (as transformers infers them)."""
    counts = (getattr(config, k, None) for k in ("num_hidden_layers", "n_layer", "num_layers"))
    n = next((v for v in counts if is_int(v, 1)), max(found, default=-1) + 1)
    sharing = getattr(config, "kv_sharing_modes", None) or getattr(
        config, "num_kv_shared_layers", None)
    if sharing:
        raise ModelLoadError(
            f"Unsupported model {architecture}: some of its layers reuse another layer's KV "
            "cache (KV sharing), which kvlens' capture and cache do not model.")
    types = getattr(config, "layer_types", None)
    if types is None or len(types) != n:
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        chunk = getattr(config, "attention_chunk_size", None)
        default = "sliding" if window else "chunked" if chunk else "full"
        return tuple(default if i in found else "none" for i in range(n)), ()
    types = [str(t) for t in types]
    unknown = sorted({t for t in types if t not in _LAYER_TYPES})
    if unknown:
        raise ModelLoadError(
            f"Unsupported model {architecture}: layer type(s) {', '.join(unknown)} (kvlens "
            f"supports {', '.join(sorted(_LAYER_TYPES))}).")
    kinds = tuple(_LAYER_TYPES[t][0] for t in types)
    state = tuple(i for i, t in enumerate(types) if _LAYER_TYPES[t][1])
    return kinds, state


def kv_layers_of_types(types) -> tuple[int, ...] | None:
    """Model indices of the layers with a KV cache from a config's ``layer_types`` list
    (``None`` when a type is unknown here: the loaded model decides)."""
    if not all(t in _LAYER_TYPES for t in types):
        return None
    return tuple(i for i, t in enumerate(types) if _LAYER_TYPES[t][0] in KV_KINDS)


def layer_windows(config, kinds: tuple[str, ...]) -> tuple[int | None, ...]:
    """Per model layer, its sliding window or attention chunk (tokens), ``None`` otherwise."""
    fields = {"sliding": "sliding_window", "chunked": "attention_chunk_size"}
    sizes = tuple(getattr(config, fields[k], None) if k in fields else None for k in kinds)
    for kind, size in zip(kinds, sizes):
        if kind in fields and not is_int(size, 1):
            raise ModelLoadError(f"A {kind} attention layer but the config gives no "
                                 f"{fields[kind]}.")
    return sizes


def attention_modules(model) -> list:
    """The self-attention module of each layer with a KV cache, in layer order (see
    ``describe(model).attention_layers`` for their model indices)."""
    found = _candidate_modules(model)
    config = text_config(model.config)
    kinds, _ = layer_kinds(config, found, type(model).__name__)
    return [found[i] for i in sorted(found) if i < len(kinds) and kinds[i] in KV_KINDS]


def decoder_layers(model) -> list:
    """Every decoder layer of the model, in model order (index ``i`` is layer ``i``): the
    modules of the ``ModuleList`` that holds the layers with attention."""
    import torch

    found = _candidate_modules(model)
    if not found:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    parts = names[id(found[min(found)])].split(".")
    for i in range(len(parts) - 1, -1, -1):  # its ancestors, nearest first
        parent = model.get_submodule(".".join(parts[:i]))
        if isinstance(parent, torch.nn.ModuleList):
            return list(parent)
    return [model.get_submodule(names[id(found[i])].rpartition(".")[0]) for i in sorted(found)]


def rope_config(config) -> dict[str, Any]:
    """RoPE parameters as plain JSON-able values (empty when the model declares none)."""
    out: dict[str, Any] = {}
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict):
        out.update({k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))})
    for key in _ROPE_CONFIG_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)):
            out[key] = value
    return out


def _head_counts(config, module, architecture: str) -> tuple[int, int, int]:
    """``(query heads, KV heads, head_dim)``: KV heads from the module's grouping, else the
    config's, else multi-head."""
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and hidden and n_heads:
        head_dim = hidden // n_heads
    groups = getattr(module, "num_key_value_groups", None)
    if is_int(groups, 1) and n_heads:
        n_kv = n_heads // groups
    else:  # no grouping attribute: the module's own count, else multi-head attention
        n_kv = getattr(module, "num_key_value_heads", None) or n_heads
    if not (n_heads and n_kv and head_dim):
        raise ModelLoadError(f"Unsupported model {architecture}: cannot read its head counts.")
    return int(n_heads), int(n_kv), int(head_dim)


def describe(model) -> ModelShape:
    """The shape of a loaded model (``ModelShape``, all on one device: ``devices`` is
    ``kvlens.cache.layout.shape_of``'s)."""
    config = text_config(model.config)
    architecture = type(model).__name__
    found = _candidate_modules(model)
    if not found:
        raise ModelLoadError(
            f"Unsupported model {architecture}: no attention modules with a layer index "
            "were found. kvlens supports decoder-only HF causal LMs that use transformers' "
            "attention interface (docs/reference/architectures.md lists the tested families)."
        )
    kinds, state = layer_kinds(config, found, architecture)
    beyond = sorted(i for i in found if i >= len(kinds))
    if beyond:
        raise ModelLoadError(
            f"Unsupported model {architecture}: attention modules with layer indices {beyond} "
            f"beyond its {len(kinds)} layers (layers run in cycles), which kvlens' cache does "
            "not model.")
    attention = [i for i, k in enumerate(kinds) if k in KV_KINDS]
    missing = [i for i in attention if i not in found]
    if missing:
        raise ModelLoadError(
            f"Unsupported model {architecture}: its config declares attention in layers "
            f"{missing} but kvlens found no attention module there.")
    if not attention:
        raise ModelLoadError(
            f"Unsupported model {architecture}: no layer holds a KV cache (every layer keeps "
            "a fixed-size state), so there is nothing for kvlens to quantize.")
    modules = [found[i] for i in attention]
    if any(getattr(m, "is_causal", True) is False for m in modules):
        raise ModelLoadError(
            f"Unsupported model {architecture}: its attention is not causal (an encoder "
            "such as BERT). kvlens analyses KV caches of decoder-only causal LMs.")
    n_heads, n_kv, head_dim = _head_counts(config, modules[0], architecture)
    mla = mla_shape(modules[0]) if is_mla(modules[0]) else None
    if mla is not None:  # absorbed: one latent row per token serves every head
        n_kv, head_dim = 1, mla.row_dim
    return ModelShape(
        num_layers=len(kinds), num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=head_dim,
        kv_layers=tuple(attention), windows=layer_windows(config, kinds),
        mla=mla, architecture=architecture,
        model_type=str(getattr(config, "model_type", "unknown")),
        # rotary frequencies held: a config may carry RoPE parameters its model does not use
        # (Granite 4 hybrid)
        has_rope=any(name.endswith(("inv_freq", "freqs_cis")) for name, _ in
                     model.named_buffers()), rope=rope_config(config),
        dtype_bytes=next(model.parameters()).element_size(),
        layer_kinds=kinds if any(k != "full" for k in kinds) else (),
        state_layers=state,
    )
