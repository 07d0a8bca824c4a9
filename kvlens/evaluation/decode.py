"""Greedy decoding through a cache session: the one decode loop the evaluations share."""

from __future__ import annotations

import torch

from kvlens.model.hooks import cache_argument_name


def cache_kwargs(model, cache) -> dict:
    return {cache_argument_name(model): cache}


def greedy(model, ids, session, max_new_tokens: int, attention_mask=None):
    """Greedy continuation ``[B, new]`` and the cache used (``session`` None: the model's own
    cache, as the exact reference decodes)."""
    cache = None if session is None else session.new_cache()
    mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id(model),
                             **({} if cache is None else cache_kwargs(model, cache)))
    return out[:, ids.shape[1]:], cache


def pad_id(model) -> int:
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "pad_token_id", None), getattr(gen, "eos_token_id", None)):
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0
