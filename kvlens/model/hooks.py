"""Registering kvlens attention functions with transformers, and undoing it.

``attention_override(model, make_fn)`` registers ``make_fn(original)`` under a unique name
(together with the mask function of the implementation it wraps, without which transformers
passes ``attention_mask=None`` and silently drops padding and sliding windows), switches the
model to it, and restores everything on exit. Also: per-layer RoPE inputs (tables and positions) via forward pre-hooks,
and the name of ``forward``'s cache argument (renamed ``past_key_values`` -> ``cache`` in 5.24).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvlens.errors import ModelLoadError
from kvlens.model.architecture import attention_modules

_counter = itertools.count()


def original_attention(model) -> tuple[str, Callable]:
    """The attention implementation the model uses now: (name, function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation or "eager"
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        module = sys.modules[type(attention_modules(model)[0]).__module__]
        fn = getattr(module, "eager_attention_forward", None)
        if fn is None:

            raise ModelLoadError(f"{type(model).__name__} has no eager attention function that "
                                 "kvlens can wrap; load it with attn_implementation='sdpa'.")
        return "eager", fn
    return name, ALL_ATTENTION_FUNCTIONS[name]


@contextmanager
def attention_override(model, make_fn: Callable[[Callable], Callable]) -> Iterator[str]:
    """Run the model with ``make_fn(original_fn)`` as its attention function."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    orig_name, orig_fn = original_attention(model)
    name = f"kvlens_{next(_counter)}"
    mask_map = AttentionMaskInterface._global_mapping
    AttentionInterface.register(name, make_fn(orig_fn))
    AttentionMaskInterface.register(name, mask_map.get(orig_name, mask_map.get("sdpa")))
    model.set_attn_implementation(name)
    try:
        yield name
    finally:
        model.set_attn_implementation(orig_name)
        AttentionInterface._global_mapping.pop(name, None)
        mask_map.pop(name, None)


@contextmanager
def rope_inputs(model) -> Iterator[dict[int, tuple]]:
    """Per layer index, ``(cos, sin, position_ids)`` of the latest call of its attention module
    (``position_ids`` is ``None`` where the model does not pass it to attention)."""
    seen: dict[int, tuple] = {}
    handles = []
    for module in attention_modules(model):
        def hook(mod, args, kwargs, _idx=module.layer_idx):
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, tuple) and len(pe) == 2:
                seen[_idx] = (*pe, kwargs.get("position_ids"))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def rope_frequency_candidates(model) -> list[tuple]:
    """Every ``(inv_freq, attention_scaling)`` the model's rotary modules hold (one per layer
    type in models such as Gemma3), for ``kvlens.rope.RopeFrequencies.match``."""
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
