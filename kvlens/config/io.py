"""The KV config's JSON form: ``config_from_dict`` (parse and validate, every problem a
``ConfigError`` saying where), ``load_config`` / ``save_config``, and the version checks
(a feature newer than the file's ``version`` is refused; ``kvlens.config.versions`` holds the
``format`` string and the version history). ``generate`` reads these files, ``recommend``
writes them. The meaning of each field is ``kvlens.config.schema``. JSON form::

    {
      "format": "kvlens.config.kvconfig", "version": 1, "name": "kivi-2", "description": "...",
      "default": {"key":   {"bits": 2, "granularity": "per-channel", "group_size": 32},
                  "value": {"bits": 2, "granularity": "per-token",   "group_size": 32},
                  "residual_tokens": 128, "flush_tokens": 0, "pre_rope_keys": false,
                  "rotate_keys": false, "rotate_values": false},
                  # a spec may add "fit": "mse" (spec version 2, config version 2): a
                  # least-squares scale/zero per group (kvlens.quant.reference)
      "layers": {"0": {"key": null}},          # partial overrides, merged over "default"
      "mikv": null | {"heavy_fraction": 0.2, "sink_tokens": 4,
                      "balancer": "off" | "online" | "fixed", "balancer_exponent": 0.5,
                      "set_bits": null | 4 | 8,              # version 2
                      "layers": null | [0, 3, ...]},         # version 2
      "gear": null | {"rank": 4, "outlier_fraction": 0.02, "power_iters": 3,
                      "layers": null | [0, 3, ...]},         # version 2
      "balancers": null | {"0": [[b_0 ... b_{D-1}] per KV head], ...},   # for "fixed"
      "scale_dtype": "float16" | "float32" | "8bit",    # 8bit: version 3
      "fp_dtype": "float16" | "bfloat16" | "float32" | "float8_e4m3fn" | "exact",  # fp8: v2
      "rotation_seed": null | 0,               # sign flips of the Hadamard rotation
      "model": null | {"num_layers": 30, "head_dim": 64, "num_key_value_heads": 3}
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvlens.config.schema import GearSettings, KVConfig, LayerKV, MikvSettings
from kvlens.config.versions import FORMAT, VERSION
from kvlens.errors import ConfigError, is_int
from kvlens.quant import QuantSpec

__all__ = ["FORMAT", "VERSION", "config_from_dict", "load_config", "save_config"]

_LAYER_KEYS = ("key", "value", "residual_tokens", "flush_tokens", "pre_rope_keys",
               "rotate_keys", "rotate_values", "key_format", "value_format")
_TOP_KEYS = ("format", "version", "name", "description", "default", "layers", "mikv", "gear",
             "balancers", "scale_dtype", "fp_dtype", "rotation_seed", "model", "kv_scales")
_V2_LAYER_KEYS = ("key_format", "value_format")
_MIKV_KEYS = ("heavy_fraction", "sink_tokens", "balancer", "balancer_exponent", "set_bits",
              "layers")
_GEAR_KEYS = ("rank", "outlier_fraction", "power_iters", "layers")


def _spec(value: Any, where: str) -> QuantSpec | None:
    if value is None:
        return None
    try:
        return QuantSpec.from_dict(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _layer(data: Any, base: LayerKV | None, where: str) -> LayerKV:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object with keys {', '.join(_LAYER_KEYS)}.")
    unknown = sorted(set(data) - set(_LAYER_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {', '.join(_LAYER_KEYS)}.")
    base = base or LayerKV()
    kwargs: dict[str, Any] = {}
    for name in ("key", "value"):
        if name in data:
            kwargs[name] = _spec(data[name], f"{where}.{name}")
    for name in ("residual_tokens", "flush_tokens", "pre_rope_keys", "rotate_keys",
                 "rotate_values", "key_format", "value_format"):
        if name in data:
            kwargs[name] = data[name]
    return replace(base, **kwargs)


def config_from_dict(data: Any) -> KVConfig:
    """Parse and validate the JSON form; every problem is a ``ConfigError`` saying where."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"A KV config must be a JSON object, got {type(data).__name__}.")
    if data.get("format", FORMAT) != FORMAT:
        raise ConfigError(f"Not a kvlens KV config: format {data.get('format')!r} (expected "
                          f"{FORMAT!r}).")
    version = data.get("version")
    if not is_int(version, 1, VERSION):
        raise ConfigError(f"Unsupported KV config version {version!r}; this kvlens reads "
                          f"versions 1-{VERSION}.")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(f"Unknown KV config keys {unknown}; allowed: {', '.join(_TOP_KEYS)}.")
    if version < 2 and ("kv_scales" in data or any(
            isinstance(v, Mapping) and set(v) & set(_V2_LAYER_KEYS)
            for v in [data.get("default")] + list((data.get("layers") or {}).values()))):
        raise ConfigError("key_format/value_format and kv_scales need KV config version 2; "
                          f"this file says version {version}: set \"version\": 2.")
    if "default" not in data:
        raise ConfigError("KV config is missing 'default' (the setting for every layer).")
    default = _layer(data["default"], None, "default")
    layers: dict[int, LayerKV] = {}
    raw_layers = data.get("layers") or {}
    if not isinstance(raw_layers, Mapping):
        raise ConfigError("'layers' must be an object mapping layer indices to overrides.")
    for key, value in raw_layers.items():
        idx = _index(key, "layers")
        layers[idx] = _layer(value, default, f"layers.{key}")
    mikv = _section(data, "mikv", _MIKV_KEYS, MikvSettings)
    gear = _section(data, "gear", _GEAR_KEYS, GearSettings)
    if version < 2 and (gear is not None or (mikv is not None and (
            mikv.set_bits is not None or mikv.layers is not None))):
        raise ConfigError("'gear', 'mikv.set_bits' and 'mikv.layers' need KV config version 2; "
                          'set "version": 2.')
    if version < 3 and data.get("scale_dtype") == "8bit":
        raise ConfigError('scale_dtype "8bit" needs KV config version 3; set "version": 3.')
    if version < 2 and data.get("fp_dtype") == "float8_e4m3fn":
        raise ConfigError('fp_dtype float8_e4m3fn needs KV config version 2; set "version": 2.')
    balancers: dict[int, tuple[tuple[float, ...], ...]] = {}
    for key, value in (data.get("balancers") or {}).items():
        idx = _index(key, "balancers")
        if not isinstance(value, list) or not value or not all(
                isinstance(r, list) and r and all(isinstance(v, (int, float))
                                                   and math.isfinite(v) and v > 0 for v in r)
                for r in value):
            raise ConfigError(f"balancers.{key} must be a list (one per KV head) of lists of "
                              "positive finite numbers (one per channel).")
        balancers[idx] = tuple(tuple(float(v) for v in r) for r in value)
    model = data.get("model")
    if model is not None and not (isinstance(model, Mapping) and all(
            isinstance(v, int) for v in model.values())):
        raise ConfigError("'model' must be an object of integers (num_layers, head_dim, "
                          "num_key_value_heads).")
    return KVConfig(name=data.get("name") or "", default=default, layers=layers, mikv=mikv,
                    balancers=balancers, scale_dtype=data.get("scale_dtype", "float16"),
                    description=data.get("description", ""), model=model,
                    fp_dtype=data.get("fp_dtype", "float16"),
                    rotation_seed=data.get("rotation_seed"),
                    kv_scales=_kv_scales(data.get("kv_scales")), gear=gear)


def _kv_scales(raw: Any) -> dict[int, dict[str, tuple[float, ...]]]:
    out: dict[int, dict[str, tuple[float, ...]]] = {}
    if raw is None:
        return out
    if not isinstance(raw, Mapping):
        raise ConfigError("'kv_scales' must map layer indices to {\"key\": [...], \"value\": "
                          "[...]}.")
    for key, entry in raw.items():
        idx = _index(key, "kv_scales")
        if not isinstance(entry, Mapping) or set(entry) - {"key", "value"} or not all(
                isinstance(v, list) and v and all(
                    isinstance(s, (int, float)) and not isinstance(s, bool)
                    and math.isfinite(s) and s > 0 for s in v) for v in entry.values()):
            raise ConfigError(f"kv_scales.{key} must be {{\"key\": [s, ...], \"value\": "
                              "[s, ...]}} with positive finite scales (one per layer, or one "
                              "per KV head).")
        out[idx] = {t: tuple(float(s) for s in v) for t, v in entry.items()}
    return out


def _section(data: Mapping, name: str, keys: tuple[str, ...], cls):
    """An optional settings object (``mikv``, ``gear``): ``None`` when absent or null."""
    raw = data.get(name)
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) - set(keys):
        raise ConfigError(f"'{name}' must be an object with keys {', '.join(keys)}.")
    return cls(**raw)


def _index(key: Any, where: str) -> int:
    try:
        idx = int(key)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key!r} is not a layer index (an integer >= 0).") from None
    if idx < 0:
        raise ConfigError(f"{where}: layer index {idx} is negative.")
    return idx


def load_config(path: str | Path) -> KVConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read KV config {path}: {exc.strerror or exc}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}).") from None
    return config_from_dict(data)


def save_config(config: KVConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
