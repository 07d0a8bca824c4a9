"""transformers' own ``QuantizedCache`` as a baseline in ``kvlens generate --compare``
(``BASELINES``; the names, their packages and what the cache does: docs/generate.md). Bytes are
measured from its tensors like ours.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass

from kvlens.cache import compressed_attention, memory_report
from kvlens.errors import ConfigError

_PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}
BASELINES = {"hf-quanto-2": ("quanto", 2), "hf-quanto-4": ("quanto", 4),
             "hf-hqq-2": ("hqq", 2), "hf-hqq-4": ("hqq", 4), "hf-fp8": ("fp8", None)}


@dataclass(frozen=True)
class Baseline:
    """A transformers QuantizedCache configuration, used where a ``KVConfig`` would be."""

    name: str
    backend: str
    nbits: int | None

    compressed = True


def is_baseline(name: str) -> bool:
    return name in BASELINES


def baseline(name: str) -> Baseline:
    """The baseline called ``name``; ``ConfigError`` when unknown or not installed here."""
    if name not in BASELINES:
        raise ConfigError(f"Unknown baseline {name!r}; allowed: {', '.join(BASELINES)}.")
    backend, nbits = BASELINES[name]
    package = _PACKAGES[backend]
    if package and _missing(package):
        pip_name = "optimum-quanto" if backend == "quanto" else backend
        raise ConfigError(f"Baseline {name} needs the {pip_name} package, which is not "
                          f"installed; install it with `pip install {pip_name}`.")
    try:
        from transformers.cache_utils import QuantizedCache  # noqa: F401
    except ImportError:
        raise ConfigError("This transformers version has no QuantizedCache.") from None
    return Baseline(name, backend, nbits)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


class BaselineSession:
    """Quacks like ``kvlens.cache.CompressionSession`` for the evaluation loop."""

    def __init__(self, model, item: Baseline):
        self.model, self.item = model, item
        self.backend = f"transformers QuantizedCache({item.backend})"
        self.backend_reason = "transformers' own quantized cache (baseline)"

    def new_cache(self):
        from transformers.cache_utils import QuantizedCache

        kwargs = {} if self.item.nbits is None else {"nbits": self.item.nbits}
        try:
            return QuantizedCache(self.item.backend, self.model.config, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transformers refused baseline {self.item.name}: {exc}") from None


def open_session(model, config, backend: str):
    """The session ``config`` runs in: a baseline's, else kvlens' compressed attention."""
    if isinstance(config, Baseline):
        return nullcontext(BaselineSession(model, config))
    return compressed_attention(model, config, backend)


def held_bytes(config, cache) -> dict:
    """The memory report of ``config``'s ``cache``: the bytes its tensors hold."""
    return (baseline_memory_report if isinstance(config, Baseline) else memory_report)(cache)


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
