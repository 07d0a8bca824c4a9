"""Whether a config fits a model: ``validate_for(config, info)`` checks a ``KVConfig`` (which
checks on its own what it can) against the model's shape and raises ``ConfigError`` naming the
allowed values.
"""

from __future__ import annotations

from kvlens.config.schema import KVConfig
from kvlens.errors import ConfigError
from kvlens.layouts import check_layout
from kvlens.quant import ds_mla, hadamard_block_size
from kvlens.quant.cachetypes import check_engine_layer
from kvlens.text.selection import format_index_spec as _spec


def validate_for(config: KVConfig, info) -> None:
    """Raise ``ConfigError`` unless ``config`` fits the model of shape ``info``
    (``kvlens.model.shape.ModelShape``: a loaded model's, or its files' before it loads)."""

    n, d, hkv = info.num_layers, info.head_dim, info.num_key_value_heads
    kv = info.attention_layers
    if config.model:
        for key, actual in (("num_layers", n), ("head_dim", d), ("num_key_value_heads", hkv)):
            want = config.model.get(key)
            if want is not None and want != actual:
                raise ConfigError(f"Config {config.name!r} was made for a model with {key}="
                                  f"{want}, but this model has {key}={actual}.")
    for what, indexed in (("overrides layers", config.layers),
                          ("gives kv_scales for layers", config.kv_scales),
                          ("gives balancers for layers", config.balancers)):
        bad = sorted(i for i in indexed if i >= n)
        if bad:
            raise ConfigError(f"Config {config.name!r} {what} {bad}, but the model has {n} "
                              f"layers; allowed indices: 0-{n - 1}.")
        stateful = sorted(i for i in indexed if i < n and i not in kv)
        if stateful:
            raise ConfigError(f"Config {config.name!r} {what} {stateful}, which hold no KV "
                              "cache in this hybrid model (a linear-attention or SSM state, "
                              f"left exact); its layers with a KV cache: {_spec(kv)}.")
    _check_ds_mla(config, info, kv)
    for idx in kv:
        layer = config.layer(idx)
        if layer.engine:
            check_engine_layer(layer, d, hkv, config.kv_scales.get(idx),
                               f"Config {config.name!r} layer {idx}")
        elif idx in config.kv_scales:
            raise ConfigError(f"Config {config.name!r} gives kv_scales for layer {idx}, which "
                              "is not an engine-format layer (no key_format/value_format).")
        for what, spec in (("key", layer.key), ("value", layer.value)):
            if spec is not None:
                check_layout(spec, layer.residual_tokens, d, f"layer {idx} {what}",
                             layer.flush_tokens)
        if layer.rotates:
            try:
                hadamard_block_size(d)
            except ConfigError as exc:
                raise ConfigError(f"Config {config.name!r} layer {idx}: {exc}") from None
        if layer.rotate_keys and config.protect is not None and (
                config.protect.balancer == "online" or idx in config.balancers):
            raise ConfigError(f"Config {config.name!r} layer {idx}: rotate_keys cannot be "
                              "combined with the key-channel balancer (it rescales channels "
                              "the rotation mixes); disable one of them.")
        if layer.pre_rope_keys and not info.has_rope:
            raise ConfigError(f"Config {config.name!r} asks for pre-RoPE keys but "
                              f"{info.architecture} has no rotary embedding.")
    if config.protect is not None and config.protect.importance is not None:
        config.protect.importance.check_model(n)
    for idx, b in config.balancers.items():
        if len(b) != hkv or any(len(r) != d for r in b):
            raise ConfigError(f"balancers.{idx} has shape [{len(b)}, {len(b[0]) if b else 0}] "
                              f"but the model needs [num_key_value_heads={hkv}, head_dim={d}].")


def _check_ds_mla(config: KVConfig, info, kv: tuple[int, ...]) -> None:
    """vLLM's ``fp8_ds_mla`` stores an MLA model's latent row (``kvlens.quant.ds_mla``): refused
    for any other model (``info.mla`` is None) and for a row it cannot split into its RoPE
    channels and whole latent tiles."""
    layers = [i for i in kv if config.layer(i).engine and any(
        getattr(getattr(ct, "format", None), "family", None) == ds_mla.DS_MLA.family
        for ct in (config.layer(i).key_type, config.layer(i).value_type))]
    if not layers:
        return
    what = f"Config {config.name!r} stores layers {_spec(layers)} as fp8_ds_mla"
    mla = info.mla
    if mla is None:
        model = info.architecture or "this model"
        raise ConfigError(f"{what}, vLLM's cache of an MLA model's latent row (DeepSeek V2/V3 "
                          f"and their kin), but {model} is not an MLA model; use vllm:fp8 or "
                          "vllm:fp8_per_token_head.")
    tile = ds_mla.TILE
    if not (mla.rope_dim < tile and mla.latent_dim > 0 and mla.latent_dim % tile == 0):
        raise ConfigError(f"{what}, which needs fewer than {tile} RoPE channels "
                          f"(qk_rope_head_dim) and a latent of a positive multiple of {tile} "
                          f"channels (kv_lora_rank); this model has qk_rope_head_dim="
                          f"{mla.rope_dim}, kv_lora_rank={mla.latent_dim}.")
