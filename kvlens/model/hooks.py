"""Registering kvlens attention functions with transformers, and undoing it.

``attention_override`` registers a function under a unique name together with the mask function
of the implementation it wraps (without which transformers passes ``attention_mask=None`` and
drops padding and sliding windows), and restores everything on exit. Also: per-layer RoPE inputs
via forward pre-hooks, and the name of ``forward``'s cache argument.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvlens.errors import ModelLoadError
from kvlens.model.architecture import attention_modules
from kvlens.model.mla import absorbed_mla
from kvlens.model.rotary import RopeInputs

_counter = itertools.count()


def original_attention(model) -> tuple[str, Callable]:
    """The attention implementation the model uses now: (name, function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation or "eager"
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        module = sys.modules[type(attention_modules(model)[0]).__module__]
        fn = getattr(module, "eager_attention_forward", None)
        if fn is None:
            raise ModelLoadError(f"Unsupported model {type(model).__name__}: its attention does "
                                 "not go through transformers' attention interface (no "
                                 "eager_attention_forward), which kvlens hooks.")
        return "eager", fn
    return name, ALL_ATTENTION_FUNCTIONS[name]


@contextmanager
def attention_override(model, make_fn: Callable[[Callable], Callable]) -> Iterator[str]:
    """Run the model with ``make_fn(original_fn)`` as its attention function (MLA layers in
    their absorbed form, ``kvlens.model.mla``: the function reads their latent rows)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    orig_name, orig_fn = original_attention(model)
    name = f"kvlens_{next(_counter)}"
    mask_map = AttentionMaskInterface._global_mapping
    AttentionInterface.register(name, make_fn(orig_fn))
    AttentionMaskInterface.register(name, mask_map.get(orig_name, mask_map.get("sdpa")))
    model.set_attn_implementation(name)
    try:
        with absorbed_mla(model):  # MLA layers attend over their cached latent rows
            yield name
    finally:
        model.set_attn_implementation(orig_name)
        AttentionInterface._global_mapping.pop(name, None)
        mask_map.pop(name, None)


@contextmanager
def rope_inputs(model) -> Iterator[RopeInputs]:
    """Per layer index, the RoPE inputs of the latest call of its attention module
    (``kvlens.model.rotary.RopeInputs``)."""
    seen = RopeInputs()
    handles = []
    for module in attention_modules(model):
        def hook(mod, args, kwargs):
            seen.record(mod, kwargs.get("position_embeddings"), kwargs.get("position_ids"))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def rope_frequency_candidates(model) -> list[tuple]:
    """Every ``(inv_freq, attention_scaling)`` the model's rotary modules hold (one per layer
    type in models such as Gemma3), for ``kvlens.rope.RopeFrequencies``."""
    out = []
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if name.endswith("inv_freq") and "original" not in name:
                scaling = getattr(module, name[:-len("inv_freq")] + "attention_scaling", 1.0)
                out.append((buf, float(scaling or 1.0)))
    return out


def cache_argument_name(model) -> str:
    """``cache`` on transformers >= 5.24, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_attention_shapes(model, info, input_ids) -> None:
    """Raise ``ModelLoadError`` unless, in one forward of ``input_ids`` ``[1, T]``, every layer
    with a KV cache in ``info`` (a ``ModelShape``) calls the attention interface with the query
    heads, KV heads and key and value widths ``info`` read from the model."""
    import torch

    seen: dict[int, tuple[int, int, int, int]] = {}

    def make(original):
        def fn(module, query, key, value, attention_mask, **kwargs):
            seen.setdefault(module.layer_idx, (query.shape[1], key.shape[1], key.shape[-1],
                                               value.shape[-1]))
            return original(module, query, key, value, attention_mask, **kwargs)
        return fn

    with torch.no_grad(), attention_override(model, make):
        model(input_ids=input_ids, use_cache=False)
    want = (info.num_attention_heads, info.num_key_value_heads, info.head_dim, info.head_dim)
    missing = [i for i in info.attention_layers if i not in seen]
    if missing:
        raise ModelLoadError(
            f"Unsupported model {info.architecture}: layers {missing} never called the "
            "attention interface, so kvlens cannot capture or cache them.")
    for i in info.attention_layers:
        if seen[i] != want:
            hq, hkv, dk, dv = seen[i]
            raise ModelLoadError(
                f"Unsupported model {info.architecture}: layer {i}'s attention receives {hq} "
                f"query heads, {hkv} KV heads, keys of {dk} and values of {dv} channels, but "
                f"its modules and config say {want[0]}, {want[1]}, {want[2]} and {want[3]}; "
                "kvlens needs these to agree (and keys and values of one width).")
