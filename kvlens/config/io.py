"""The KV config's JSON form: ``config_from_dict`` (parse and validate, every problem a
``ConfigError`` saying where), ``load_config`` / ``save_config``. Every file says ``"version":
1``, the one version (``kvlens.config.schema.VERSION``). The form is documented in docs/generate.md
(config files), the meaning of each field in ``kvlens.config.schema``; a research set policy's
own top-level key is read through ``kvlens.config.extension``. A file that stores what issue
#57 removed is refused with the reason before its version is read (``_refuse_removed``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvlens.config.extension import read_settings
from kvlens.config.schema import (
    FORMAT,
    REMOVED,
    VERSION,
    KVConfig,
    LayerKV,
    ProtectSettings,
)
from kvlens.errors import ConfigError, is_int
from kvlens.layouts import layout_from_dict

__all__ = ["FORMAT", "VERSION", "config_from_dict", "load_config", "save_config"]

_LAYER_KEYS = tuple(f.name for f in fields(LayerKV))
_TOP_KEYS = ("format", "version", *(f.name for f in fields(KVConfig)))
_PROTECT_KEYS = tuple(f.name for f in fields(ProtectSettings) if f.name != "importance")
#: the top-level keys read as they are, each absent one the field's default
_PLAIN_KEYS = ("scale_dtype", "fp_dtype", "rotation_seed", "engine_attention",
               "write_before_attention")
#: the sinks-and-balancer section's name before issue #57 gave it a neutral one
OLD = "mikv"
_MODEL_KEYS = ("num_layers", "head_dim", "num_key_value_heads")


def _spec(value: Any, where: str):
    """A storage layout spec from its JSON form (``kvlens.layouts``): ``"layout"`` names it;
    without it, a codebook spec (version 5 files) or the uniform integer spec."""
    if value is None:
        return None
    try:
        default = "codebook" if isinstance(value, Mapping) and "codebook" in value else "uniform"
        return layout_from_dict(value, default)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _layer(data: Any, base: LayerKV | None, where: str) -> LayerKV:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object with keys {', '.join(_LAYER_KEYS)}.")
    # "center_keys": false (written by older versions) is the only behaviour left: ignored
    _no_unknown({k: v for k, v in data.items() if k != "center_keys"}, _LAYER_KEYS, where)
    base = base or LayerKV()
    kwargs = {name: _spec(data[name], f"{where}.{name}") if name in ("key", "value")
              else data[name] for name in _LAYER_KEYS if name in data}
    try:
        return replace(base, **kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def config_from_dict(data: Any) -> KVConfig:
    """Parse and validate the JSON form; every problem is a ``ConfigError`` saying where."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"A KV config must be a JSON object, got {type(data).__name__}.")
    if data.get("format", FORMAT) != FORMAT:
        raise ConfigError(f"Not a kvlens KV config: format {data.get('format')!r} (expected "
                          f"{FORMAT!r}).")
    _refuse_removed(data)
    version = data.get("version")
    if not is_int(version, VERSION, VERSION):
        raise ConfigError(f"Unsupported KV config version {version!r}; this kvlens reads "
                          f"version {VERSION} (a file of the development builds before 0.1.0, "
                          f"versions 2-6, reads once it says \"version\": {VERSION}).")
    # "gear": null and the old section null (development builds wrote them) ask for nothing
    importance = read_settings({k: v for k, v in data.items() if k not in ("gear", OLD)},
                               _TOP_KEYS)
    raw_layers = _indexed(data, "layers", "an object mapping layer indices to overrides")
    if "default" not in data:
        raise ConfigError("KV config is missing 'default' (the setting for every layer).")
    default = _layer(data["default"], None, "default")
    layers = {idx: _layer(value, default, f"layers.{idx}") for idx, value in raw_layers.items()}
    protect = _protect(data.get("protect"), importance)
    description = data.get("description")
    if description is not None and not isinstance(description, str):
        raise ConfigError(f"'description' must be a string, got {type(description).__name__}.")
    return KVConfig(name=data.get("name", ""), default=default, layers=layers, protect=protect,
                    balancers=_balancers(data), description=description or "",
                    model=_model(data.get("model")), kv_scales=_kv_scales(data),
                    **{k: data[k] for k in _PLAIN_KEYS if k in data})


def _refuse_removed(data: Mapping) -> None:
    """Refuse a config that stores a layout issue #57 removed (a negative result each, its lab
    note named) or the sinks-and-balancer section under its old name (``OLD``), before an
    "unknown key" or version error; ``"gear": null`` and ``"center_keys": false`` ask for
    nothing removed. What is not the expected shape is left to the parser."""
    if data.get("gear") is not None:
        raise ConfigError("This config stores GEAR ('gear': outliers and low-rank factors); GEAR "
                          "was removed from kvlens by issue #57 (a negative result, "
                          "docs/lab-notes/gear-mikv.md). Make a new config without it, e.g. "
                          "with kvlens recommend.")
    settings = [data.get("default")]
    if isinstance(data.get("layers"), Mapping):
        settings += list(data["layers"].values())
    settings = [s for s in settings if isinstance(s, Mapping)]
    specs = [s.get(t) for s in settings for t in ("key", "value")]
    specs = [x for x in specs if isinstance(x, Mapping)]
    if "coupled_codebooks" in data or any("channels" in x for x in specs):
        raise ConfigError("This config stores coupled (CQ) keys or values ('coupled_codebooks' "
                          "or a spec with \"channels\"); coupled layouts were removed from "
                          "kvlens (a negative result, docs/lab-notes/coupled.md). Make a new "
                          "config without them, e.g. with kvlens recommend.")
    found = [what for what, present in (
        ("centred keys ('key_means')", "key_means" in data),
        ("centred keys ('center_keys': true)", any(s.get("center_keys", False) is not False
                                                   for s in settings)),
        ("fitted codebook centroids ('codebooks')", "codebooks" in data),
        ("a codebook value spec", any(isinstance(s.get("value"), Mapping)
                                      and "codebook" in s["value"] for s in settings)),
        ("a fitted codebook spec", any("codebook" in x and x["codebook"] in ("fitted", "weighted")
                                       for x in specs))) if present]
    if found:
        raise ConfigError(f"This config stores {', '.join(found)}, {REMOVED}. Make a new config "
                          "without them, e.g. with kvlens recommend.")
    if data.get(OLD) is not None:
        raise ConfigError(f"The '{OLD}' section was renamed 'protect' (sink_tokens, balancer, "
                          "balancer_exponent); a research set policy's keys are its own key (the "
                          "importance set's: 'importance'). Rename the section.")


def _no_unknown(data: Mapping, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(allowed), key=str)
    if unknown:
        what = "Unknown KV config keys" if where == "KV config" else f"{where}: unknown keys"
        raise ConfigError(f"{what} {unknown}; allowed: {', '.join(allowed)}.")


def _indexed(data: Mapping, name: str, what: str) -> dict[int, Any]:
    """The optional object ``data[name]`` keyed by layer index (``{}`` when absent or null),
    its keys as ints; refuses another type, keys that are not indices, an index twice."""
    raw = data.get(name)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'{name}' must be {what}, got {type(raw).__name__}.")
    out: dict[int, Any] = {}
    for key, value in raw.items():
        idx = _index(key, name)
        if idx in out:
            raise ConfigError(f"{name}: layer {idx} is given twice; give each layer once.")
        out[idx] = value
    return out


def _balancers(data: Mapping) -> dict[int, tuple[tuple[float, ...], ...]]:
    out = {}
    for idx, value in _indexed(data, "balancers", "an object mapping layer indices to "
                                                  "balancers").items():
        if not isinstance(value, list) or not value or not all(
                isinstance(r, list) and r and all(_positive(v) for v in r) for r in value):
            raise ConfigError(f"balancers.{idx} must be a list (one per KV head) of lists of "
                              "positive finite numbers (one per channel).")
        out[idx] = tuple(tuple(float(v) for v in r) for r in value)
    return out


def _kv_scales(data: Mapping) -> dict[int, dict[str, tuple[float, ...]]]:
    out = {}
    for idx, entry in _indexed(data, "kv_scales", 'an object mapping layer indices to '
                                                  '{"key": [...], "value": [...]}').items():
        if not isinstance(entry, Mapping) or set(entry) - {"key", "value"} or not all(
                isinstance(v, list) and v and all(_positive(s) for s in v)
                for v in entry.values()):
            raise ConfigError(f"kv_scales.{idx} must be {{\"key\": [s, ...], \"value\": "
                              "[s, ...]}} with positive finite scales (one per layer, or one "
                              "per KV head).")
        out[idx] = {t: tuple(float(s) for s in v) for t, v in entry.items()}
    return out


def _positive(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0)


def _model(raw: Any) -> dict[str, int] | None:
    if raw is None:
        return None
    if not (isinstance(raw, Mapping) and set(raw) <= set(_MODEL_KEYS)
            and all(is_int(v, 1) for v in raw.values())):
        raise ConfigError(f"'model' must be an object of positive integers with keys "
                          f"{', '.join(_MODEL_KEYS)} (the model the config was made for).")
    return dict(raw) or None


def _protect(raw: Any, importance: Any) -> ProtectSettings | None:
    """The ``protect`` section (``None`` when absent or null) with a registered research set
    policy's settings (``kvlens.config.extension``) as its ``importance``."""
    if raw is None:
        if importance is not None:
            raise ConfigError(f"'{importance.key}' needs a 'protect' section (its sink_tokens); "
                              "add one.")
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'protect' must be an object with keys {', '.join(_PROTECT_KEYS)}.")
    _no_unknown(raw, _PROTECT_KEYS, "protect")
    return ProtectSettings(**raw, importance=importance)


def _index(key: Any, where: str) -> int:
    """A layer index: a JSON key of decimal digits (or an int from Python)."""
    if is_int(key, 0):
        return key
    if not (isinstance(key, str) and key.isascii() and key.isdigit()):
        raise ConfigError(f"{where}: {key!r} is not a layer index (an integer >= 0, written "
                          "in decimal digits).")
    return int(key)


def load_config(path: str | Path) -> KVConfig:
    """The config in JSON file ``path``; an unreadable file, bytes that are not UTF-8 JSON, or a
    malformed config raise ``ConfigError`` naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"Cannot read KV config {path}: {exc.strerror or exc}.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); a KV "
                          "config is a UTF-8 JSON file.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}).") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a KV config.") from None
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def save_config(config: KVConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
