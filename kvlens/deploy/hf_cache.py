"""The transformers per-layer cache export: a kvlens config as a file that stock transformers
loads into ``Cache(layers=[...])``, one of its own layer objects per decoder layer.

The file (``FILE_NAME``, JSON, ``FORMAT`` version ``VERSION``)::

    {"format": "kvlens-transformers-cache", "version": 1, "config": NAME, "num_layers": N,
     "layers": [{"class": "QuantoQuantizedLayer", "kwargs": {"nbits": 4, "axis_key": -1,
                 "axis_value": 0, "q_group_size": 64, "residual_length": 128}},
                {"class": "DynamicLayer", "kwargs": {}}, ...]}

``class`` names a class of ``transformers.cache_utils`` (transformers 5.24) and ``kwargs`` its
constructor's arguments, so ``SNIPPET`` builds the cache with transformers alone; ``kvlens
generate --compare hf-layers:FILE`` runs it (``kvlens.evaluation.baselines``).

A layer maps (``layer_for``) only where transformers' layer stores what the kvlens layer
stores; a config with a layer that does not map is not exported (``export`` returns the
reasons: nothing is rounded silently). What transformers' layers do differently is in
docs/deploy/transformers.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvlens.config import KVConfig, LayerKV
from kvlens.config.engine import TRANSFORMERS_BACKENDS
from kvlens.config.hqq import HQQ_BITS, HqqSetting
from kvlens.deploy.exports import export_path
from kvlens.evaluation.baselines import LAYER_CLASSES, LAYERS_PREFIX
from kvlens.layouts.hqq_strided import HqqStrided
from kvlens.quant import QuantSpec

FORMAT, VERSION = "kvlens-transformers-cache", 1
FILE_NAME = "transformers_cache.json"
SNIPPET = """import json
from transformers import cache_utils
spec = json.load(open({path!r}))
cache = cache_utils.Cache(layers=[getattr(cache_utils, layer["class"])(**layer["kwargs"])
                                  for layer in spec["layers"]])
out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)"""


@dataclass(frozen=True)
class Export:
    """``document``: the file's JSON form (None when a layer does not map, ``problems`` says
    why, a line per layer)."""

    document: dict | None
    problems: tuple[str, ...]

    def text(self) -> str:
        return json.dumps(self.document, indent=2) + "\n"


def _axis(spec) -> tuple[str, int, int, int] | None:
    """``(class, axis, nbits, group)`` of transformers' layer storing a tensor as ``spec``."""
    if isinstance(spec, HqqStrided):  # hqq's axis=0
        ok = spec.bits in HqqSetting.bit_widths
        return (LAYER_CLASSES[HqqSetting.backend], 0, spec.bits, spec.group) if ok else None
    for setting in TRANSFORMERS_BACKENDS.values():
        axes = {g: a for a, g in setting.granularity.items()}
        if isinstance(spec, QuantSpec) and spec.fit == setting.fit \
                and spec.bits in setting.bit_widths and spec.granularity in axes:
            return (LAYER_CLASSES[setting.backend], axes[spec.granularity], spec.bits,
                    spec.group_size)
    return None


def layer_for(layer: LayerKV) -> tuple[str, dict] | str:
    """transformers' layer ``(class, kwargs)`` that stores what ``layer`` stores: one ``nbits``
    and ``q_group_size`` for both tensors, no rotation, pre-RoPE keys or partial flush, min/max
    grids as quanto layers, ``fit="hqq"`` per-token grids and ``hqq-strided`` as HQQ layers,
    unquantized as ``DynamicLayer``; else why none does."""
    if layer.key_format or layer.value_format:
        return f"engine cache types {layer.key_format}/{layer.value_format}"
    if layer.key is None and layer.value is None:
        return "DynamicLayer", {}
    flags = [f for f in ("pre_rope_keys", "rotate_keys", "rotate_values") if getattr(layer, f)]
    if flags or layer.flush_tokens:
        return ", ".join(flags or [f"flush_tokens={layer.flush_tokens}"]) + \
            " (transformers' layers have no such option)"
    k, v = layer.key, layer.value
    strided = isinstance(k, HqqStrided) or isinstance(v, HqqStrided)
    if not strided and not (isinstance(k, QuantSpec) and isinstance(v, QuantSpec)):
        return "keys or values not an integer grid (or one of them unquantized)"
    if not strided and (k.bits != v.bits or k.group_size != v.group_size or k.group_size is None):
        return (f"keys {k.bits} bits G{k.group_size}, values {v.bits} bits G{v.group_size}: "
                "a transformers layer has one nbits and one q_group_size, and groups")
    if not strided and (k.symmetric or v.symmetric or k.fit != v.fit):
        return "a symmetric grid or two fits (transformers' layers: one affine min/max grid)"
    ka, va = _axis(k), _axis(v)
    if strided and (ka is None or va is None or ka[0] != va[0] or ka[2:] != va[2:]):
        return (f"keys {_label(k)}, values {_label(v)}: an HQQ layer has one nbits "
                f"({', '.join(map(str, HQQ_BITS))}) and one q_group_size, each axis 0 "
                "(hqq-strided) or 1 (per-token groups, fit hqq)")
    if ka is None or va is None or ka[0] != va[0]:
        return (f"{k.bits} bits, fit {k.fit}, {k.granularity}/{v.granularity}: quanto takes "
                f"2 or 4 bits with min/max, HQQ {', '.join(map(str, HQQ_BITS))} with fit hqq "
                "per token (its axis=0 is the hqq-strided layout)")
    return ka[0], {"nbits": ka[2], "axis_key": ka[1], "axis_value": va[1],
                   "q_group_size": ka[3], "residual_length": layer.residual_tokens}


def _label(spec) -> str:
    return "unquantized" if spec is None else spec.label


def export(config: KVConfig, num_layers: int) -> Export:
    """``config`` for a model of ``num_layers`` decoder layers (module docstring)."""
    problems = []
    extras = [name for name, on in (("sinks or balancer (protect)", config.protect is not None),
                                    ("balancers", bool(config.balancers)),
                                    ("static fp8 scales", bool(config.kv_scales)),
                                    ("engine attention", config.engine_attention is not None),
                                    ("write_before_attention", config.write_before_attention))
              if on]
    if extras:
        problems.append(f"{config.name}: {', '.join(extras)} (no transformers layer has them)")
    layers = []
    for i in range(num_layers):
        got = layer_for(config.layer(i))
        if isinstance(got, str):
            problems.append(f"layer {i}: {got}")
        else:
            layers.append({"class": got[0], "kwargs": got[1]})
    if problems:
        return Export(None, tuple(problems))
    return Export({"format": FORMAT, "version": VERSION, "config": config.name,
                   "num_layers": num_layers, "layers": layers}, ())


def snippet(path: str) -> str:
    """The Python that loads the export at ``path`` into a cache and generates with it."""
    return SNIPPET.format(path=str(path))


def beside(config: KVConfig, out) -> tuple[object, str]:
    """``(path, text)`` of the export beside a config written to ``out`` (a ``Path``), ``(None,
    why not)`` where it does not map, ``(None, "")`` for a config without a layer count."""
    num_layers = (config.model or {}).get("num_layers")
    if num_layers is None:
        return None, ""
    got = export(config, num_layers)
    if got.document is None:
        more = f" (and {len(got.problems) - 2} more)" if len(got.problems) > 2 else ""
        return None, f"no transformers export: {'; '.join(got.problems[:2])}{more}"
    return export_path(out, FILE_NAME), got.text()


def compare_name(path: str) -> str:
    """The ``generate --compare`` item that runs the export at ``path`` in transformers."""
    return LAYERS_PREFIX + str(path)
