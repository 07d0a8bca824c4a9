"""What a layer's choice costs: the bytes its (key, value, window, flush) choice holds after
``RecommendOptions.context`` tokens (``option_bytes``, from ``kvlens.cache.layout``, the
description the cache allocates by), relative to an fp16 cache of the same tokens
(``tensor_fp16_bytes``), and the bytes one decode step reads (``decode_costs``,
``kvlens.cache.decode_cost``: a documented model, not a timing).
"""

from __future__ import annotations

from typing import Any

from kvlens.cache.decode_cost import config_decode_cost
from kvlens.cache.layout import flush_every, layer_part_bytes, shares_storage, stream_state
from kvlens.config import FP_BYTES, ProtectSettings, preset, validate_for
from kvlens.errors import ConfigError
from kvlens.layouts import layout_of
from kvlens.recommend.extension import extension_class
from kvlens.recommend.options import Candidate, RecommendOptions, Stream


def option_bytes(kc: Candidate, vc: Candidate, flush: int, opts: RecommendOptions, shape,
                 layer: int, residual: int | None = None) -> tuple[int, int, int]:
    """``(total, key share, value share)`` bytes ``layer`` holds after ``opts.context`` tokens
    storing ``kc`` and ``vc`` with a ``residual``-token window (default: the largest offered)
    and flush block ``flush``; the shares split what both use evenly (for display)."""

    r = max(opts.window_sizes) if residual is None else residual
    setting = Stream(r, flush).setting(kc, vc)
    w = shape.window(layer)
    protect = _layer_section(kc, opts)
    fp, sd = FP_BYTES[opts.fp_dtype], opts.scale_dtype
    parts = layer_part_bytes(setting, tokens=opts.context, head_dim=shape.head_dim,
                             kv_heads=shape.num_key_value_heads, protect=protect, balancer=kc.balancer,
                             sliding_window=w, fp_bytes=fp, scale_dtype=sd,
                             kv_shared=shape.kv_shared)
    total = sum(parts.values())
    if shares_storage(setting, shape.kv_shared, shape.head_dim, balancer=kc.balancer):
        # one store for both (MLA): half each
        return total, total / 2, total / 2
    held = stream_state(setting, opts.context, w).q_held
    f = flush_every(setting)
    own = [shape.num_key_value_heads
           * sum(layout_of(c.spec()).part_bytes(held, shape.head_dim, f, sd).values())
           for c in (kc, vc)]
    shared = (total - sum(own)) / 2
    return total, own[0] + shared, own[1] + shared


def _layer_section(c: Candidate, opts: RecommendOptions):
    """The sinks section a layer storing ``c`` is priced with (what the written config's
    ``protect_for`` gives that layer): the sinks at ``fp_dtype``, or what ``c``'s twin keeps
    (``CandidateExtension.held``)."""

    if c.twin is not None:
        return extension_class(c.twin.extension)().held(c.twin.setting, opts)
    return ProtectSettings(opts.sink_tokens, "off") if opts.sink_tokens else None


def tensor_fp16_bytes(shape, layer: int, context: int) -> float:
    """Bytes of one tensor (K or V) of ``layer`` in an fp16 cache after ``context`` tokens (an
    MLA model's: half its one latent row, which serves as both)."""
    return shape.num_key_value_heads * shape.visible_tokens(layer, context) * shape.head_dim \
        * 2 * shape.kv_tensors / 2


#: the presets a recommendation is compared with (its validation scores them beside it)
COMPARED_PRESETS = ("kivi-2", "kivi-4", "per-token-4")
COST_PRESETS = ("fp16", *COMPARED_PRESETS)


def decode_costs(config, shape, context: int) -> list[tuple[str, Any]]:
    """``[(name, kvlens.cache.decode_cost.DecodeCost)]`` at ``context`` tokens: the
    recommendation first, then the presets of ``COST_PRESETS`` that fit the model."""

    rows = [(config.name, config_decode_cost(config, shape, context))]
    for name in COST_PRESETS:
        cfg = preset(name)
        try:
            validate_for(cfg, shape)  # as the validation checks the presets it compares
        except ConfigError:  # e.g. G=64 per-token groups on a head_dim-16 model
            continue
        rows.append((name, config_decode_cost(cfg, shape, context)))
    return rows
