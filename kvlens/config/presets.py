"""The named KV-cache presets (``exact``, ``fp16``, ``kivi-2``...) and ``resolve``, which turns a
preset name or a config file path into a ``KVConfig``. Research adds its presets with
``add_preset`` when it is imported (``kvlens.research``). Engine settings (``llamacpp:q4_0``
...) are ``kvlens.config.engine``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvlens.config.io import load_config
from kvlens.config.schema import KVConfig, LayerKV, ProtectSettings
from kvlens.errors import ConfigError
from kvlens.quant import QuantSpec


def _kivi(bits: int) -> KVConfig:
    return KVConfig(f"kivi-{bits}", LayerKV(QuantSpec(bits, "per-channel", 32),
                                            QuantSpec(bits, "per-token", 32), 128),
                    description=f"KIVI {bits}-bit: keys per-channel G32, values per-token G32, "
                                "128-token fp residual window")


def _per_token(bits: int) -> KVConfig:
    return KVConfig(f"per-token-{bits}", LayerKV(QuantSpec(bits, "per-token", 64),
                                                 QuantSpec(bits, "per-token", 64), 128),
                    description=f"{bits}-bit keys and values per-token G64 with a 128-token "
                                "window (transformers QuantizedCache-style baseline)")


def _variant(base: KVConfig, name: str, description: str, protect: ProtectSettings | None = None,
             **layer) -> KVConfig:
    """``base`` named ``name``, its default layer changed by ``layer``."""
    return replace(base, name=name, default=replace(base.default, **layer),
                   protect=protect or base.protect, description=description)


PRESETS: dict[str, KVConfig] = {
    "exact": KVConfig("exact", LayerKV(), fp_dtype="exact",
                      description="no compression, the model's own dtype (same tokens as "
                                  "transformers' DynamicCache)"),
    "fp16": KVConfig("fp16", LayerKV(), description="no compression, stored in float16 (what a "
                                                     "GPU deployment holds)"),
    "kivi-2": _kivi(2),
    "kivi-4": _kivi(4),
    "per-token-2": _per_token(2),
    "per-token-4": _per_token(4),
    "kivi-2-sinks": _variant(_kivi(2), "kivi-2-sinks", "kivi-2 with the first 4 tokens "
                             "(attention sinks) kept at full precision and a sliding window "
                             "(the oldest 32 of 128 tokens quantized at a time)",
                             protect=ProtectSettings(4, "off"), flush_tokens=32),
    "kivi-2-rot": _variant(_kivi(2), "kivi-2-rot", "kivi-2 with Hadamard-rotated keys and "
                           "values", rotate_keys=True, rotate_values=True),
    **{f"per-token-{b}-rot": _variant(_per_token(b), f"per-token-{b}-rot", f"per-token-{b} with "
                                      "Hadamard-rotated keys and values (llama.cpp-style "
                                      "rotation)", rotate_keys=True, rotate_values=True)
       for b in (2, 4)},
    "kivi-2-prerope": _variant(_kivi(2), "kivi-2-prerope", "kivi-2 with keys quantized before "
                               "RoPE", pre_rope_keys=True),
}


#: what an unknown preset's message adds: research presets arrive with kvlens.research
RESEARCH_HINT = "research presets are added when kvlens.research is imported (the CLI does)"


def add_preset(config: KVConfig) -> None:
    """Add a preset under ``config.name`` (research registers its own this way)."""
    if PRESETS.get(config.name, config) != config:
        raise ValueError(f"preset {config.name!r} is registered twice")
    PRESETS[config.name] = config


def preset(name: str) -> KVConfig:
    if name not in PRESETS:
        raise ConfigError(f"Unknown preset {name!r}; allowed: {', '.join(PRESETS)}; "
                          f"{RESEARCH_HINT}.")
    return PRESETS[name]


def resolve(spec: str) -> KVConfig:
    """A preset name, or a path to a JSON config file."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith(".json") or Path(spec).is_file():
        return load_config(spec)
    raise ConfigError(f"Unknown preset {spec!r} (and no such config file); allowed presets: "
                      f"{', '.join(PRESETS)}; {RESEARCH_HINT}.")
