"""transformers' own quantized cache layers as baselines in ``kvlens generate --compare``.

Names: ``hf-fp8`` (no extra package; transformers >= 5) and ``hf-`` followed by a
``transformers:`` engine setting without its engine, the real cache that setting simulates:
``hf-quanto-4`` (needs the ``optimum-quanto`` package), ``hf-quanto-2:axis_key=-1:group=32``,
``hf-hqq-4`` (needs ``hqq``), ``hf-hqq-4:axis_key=1`` ... (``kvlens.config.engine``; options
left out take transformers' defaults: group size 64, residual window 128, axes 0). Both extra
packages are the ``hf-caches`` extra. ``hf-layers:FILE`` runs a per-layer cache exported by
``recommend --target transformers`` (``kvlens.deploy.hf_cache``): one layer object per layer.

The cache is ``transformers.cache_utils.Cache(layers=[...])`` with one
``QuantoQuantizedLayer`` / ``HQQQuantizedLayer`` (or ``DynamicLayer``) per decoder layer, what
``QuantizedCache`` builds for a model of full-attention layers only; built this way it also
runs a model with sliding-window layers (their masks are the model's; each layer keeps its
whole history). It dequantizes the whole history at every step and re-quantizes everything
when its window fills (see docs/generate.md). Bytes are measured from its tensors like ours.
"""

from __future__ import annotations

import importlib.util
import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from kvlens.cache import compressed_attention, memory_report
from kvlens.config.engine import parse_engine_setting
from kvlens.errors import ConfigError, InputError

#: backend -> (the module it imports, the pip package holding it); fp8 needs none
_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
# transformers' layer class of each backend (transformers.cache_utils)
LAYER_CLASSES = {"quanto": "QuantoQuantizedLayer", "hqq": "HQQQuantizedLayer",
                 "dynamic": "DynamicLayer"}
BASELINES = ("hf-quanto-2", "hf-quanto-4", "hf-hqq-2", "hf-hqq-4", "hf-fp8")  # in the error message
LAYERS_PREFIX = "hf-layers:"
_FORMS = ("hf-fp8, hf-quanto-B[:option=V...], hf-hqq-B[:option=V...] (the real cache of "
          "transformers:quanto-B / transformers:hqq-B), hf-layers:FILE (a recommend --target "
          "transformers export)")


@dataclass(frozen=True)
class Baseline:
    """A cache of transformers' own layers, used where a ``KVConfig`` would be. ``layers``: one
    ``(backend, kwargs items)`` per decoder layer, or ``()`` for every layer of ``backend`` with
    ``kwargs`` (``nbits`` and the rest of ``QuantizedLayer``'s arguments)."""

    name: str
    backend: str
    nbits: int | None
    kwargs: tuple = ()
    layers: tuple = ()

    compressed = True


def is_baseline(name: str) -> bool:
    low = name.strip().lower()
    return (name in BASELINES or low.startswith(("hf-quanto-", "hf-hqq-"))
            or name.startswith(LAYERS_PREFIX))


def baseline(name: str) -> Baseline:
    """The baseline called ``name`` (module docstring); ``ConfigError`` when unknown or when
    its package is not installed here."""
    if name.startswith(LAYERS_PREFIX):
        layers = read_layers(name[len(LAYERS_PREFIX):])
        for backend in {b for b, _ in layers}:
            _require(name, backend)
        return Baseline(name, "layers", None, layers=layers)
    if name == "hf-fp8":
        _require(name, "fp8")
        return Baseline(name, "fp8", None)
    if not is_baseline(name):
        raise ConfigError(f"Unknown baseline {name!r}; allowed: {', '.join(BASELINES)}, or "
                          f"{_FORMS}.")
    try:
        setting = parse_engine_setting("transformers:" + name.strip()[3:])
    except ConfigError as exc:
        raise ConfigError(f"Baseline {name!r} is hf- followed by a transformers: setting, and "
                          f"that one is refused: {exc}") from None
    _require(name, setting.backend)
    return Baseline(name, setting.backend, setting.bits,
                    tuple(setting.cache_kwargs().items()))


def read_layers(path: str | Path) -> tuple:
    """The per-layer cache a ``recommend --target transformers`` export holds (the file format:
    ``kvlens.deploy.hf_cache``) -> ``((backend, kwargs items), ...)``, one per layer."""
    try:
        doc = json.loads(Path(path).read_text())
        specs = doc["layers"]
        back = {v: k for k, v in LAYER_CLASSES.items()}
        return tuple((back[s["class"]], tuple(sorted(s.get("kwargs", {}).items())))
                     for s in specs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path} is not a transformers cache export (a JSON file with "
                         f"'layers': [{{'class': one of {', '.join(LAYER_CLASSES.values())}, "
                         f"'kwargs': {{...}}}}, ...]): {exc!r}. Write one with kvlens recommend "
                         "--target transformers.") from None


def _require(name: str, backend: str) -> None:
    package, pip_name = _PACKAGES.get(backend, (None, None))
    try:
        missing = package is not None and importlib.util.find_spec(package) is None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        missing = True
    if missing:
        raise ConfigError(f"Baseline {name} needs the {pip_name} package, which is not "
                          f"installed; install it with `pip install {pip_name}` (or the "
                          "kvlens extra: `pip install kvlens[hf-caches]`).")
    try:
        from transformers.cache_utils import QuantizedCache  # noqa: F401
    except ImportError:
        raise ConfigError("This transformers version has no QuantizedCache.") from None


def build_cache(layers, num_layers: int):
    """``transformers.cache_utils.Cache(layers=[...])``: ``layers`` one ``(backend, kwargs
    items)`` per layer (``num_layers`` of them), each layer transformers' own class
    (``LAYER_CLASSES``)."""
    from transformers import cache_utils

    if len(layers) != num_layers:
        raise ConfigError(f"The cache has {len(layers)} layers and the model {num_layers}; "
                          "export it again for this model.")
    objs = []
    for backend, kwargs in layers:
        try:
            objs.append(getattr(cache_utils, LAYER_CLASSES[backend])(**dict(kwargs)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transformers refused a {LAYER_CLASSES[backend]}"
                              f"({dict(kwargs)}): {exc}") from None
    return cache_utils.Cache(layers=objs)


class BaselineSession:
    """Quacks like ``kvlens.cache.CompressionSession`` for the evaluation loop."""

    def __init__(self, model, item: Baseline):
        self.model, self.item = model, item
        self.backend = f"transformers QuantizedCache({item.backend})"
        self.backend_reason = "transformers' own quantized cache (baseline)"

    def new_cache(self):
        from transformers.cache_utils import QuantizedCache

        item = self.item
        if item.backend == "fp8":
            try:
                return QuantizedCache("fp8", self.model.config)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"transformers refused baseline {item.name}: {exc}") from None
        n = self.model.config.get_text_config(decoder=True).num_hidden_layers
        layers = item.layers or ((item.backend, item.kwargs),) * n
        return build_cache(layers, n)


def open_session(model, config, backend: str):
    """The session ``config`` runs in: a baseline's, else kvlens' compressed attention."""
    if isinstance(config, Baseline):
        return nullcontext(BaselineSession(model, config))
    return compressed_attention(model, config, backend)


def held_bytes(config, cache) -> dict:
    """What ``config``'s ``cache`` holds, as a result records it: ``kv_bytes``,
    ``kv_bytes_fp16``, ``bits_per_element``, ``kv_bytes_by_device`` and a hybrid model's
    fixed-size ``state_bytes`` beside its K/V (when it has any)."""
    report = (baseline_memory_report if isinstance(config, Baseline) else memory_report)(cache)
    out = {k: report[k] for k in ("kv_bytes", "kv_bytes_fp16", "bits_per_element")}
    out["kv_bytes_by_device"] = report["by_device"]
    if report.get("state_bytes"):
        out["state_bytes"] = report["state_bytes"]
    return out


def _tensors(obj):
    """Every plain tensor inside ``obj``: tensors, tensor subclasses (quanto's QTensor keeps
    its data in inner tensors), and tuples/lists/dicts of them (hqq and fp8 layers store
    ``(codes, meta)`` pairs)."""
    import torch

    if isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and flatten is not None:
            for name in flatten()[0]:
                yield from _tensors(getattr(obj, name))
        else:
            yield obj


def baseline_memory_report(cache) -> dict:
    """Measured bytes of a QuantizedCache: quantized history + full-precision residual."""
    total = fp16 = 0
    by_device: dict[str, int] = {}
    for layer in cache.layers:
        parts = [getattr(layer, a, None) for a in ("_quantized_keys", "_quantized_values",
                                                  "keys", "values")]
        tensors = [t for p in parts for t in _tensors(p)]
        for t in tensors:
            n = t.numel() * t.element_size()
            total += n
            by_device[str(t.device)] = by_device.get(str(t.device), 0) + n
        shaped = [t for t in tensors if t.dim() == 4]
        if shaped:
            b, h, _, d = shaped[0].shape
            fp16 += 2 * b * h * layer.get_seq_length() * d * 2
    return {"kv_bytes": total, "kv_bytes_fp16": fp16,
            "bits_per_element": 16.0 * total / fp16 if fp16 else 0.0, "by_device": by_device}
