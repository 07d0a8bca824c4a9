"""Building the compressed cache for a model, installing its attention, and measuring its bytes.

Use::

    with compressed_attention(model, config, backend="auto") as session:
        cache = session.new_cache()
        model.generate(ids, **{cache_argument_name(model): cache}, ...)
        print(memory_report(cache))

``compressed_attention`` validates ``config`` against the model, chooses the backend (recorded
in ``session.backend_reason``, together with every reason a call still took the torch path), registers kvlens' attention function (and the original mask
function) for the duration of the block, and, for pre-RoPE keys, hooks the attention modules
to read each layer's RoPE tables. Everything is undone on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from kvlens.errors import ConfigError
from kvlens.kvconfig import KVConfig, validate_for


@dataclass
class CompressionSession:
    model: object
    config: KVConfig
    info: object
    backend: str
    selection_reason: str
    active: bool = False
    rope: dict = field(default_factory=dict)
    #: With the triton backend: attention calls that took the torch path, counted per reason.
    torch_path_calls: dict = field(default_factory=dict)

    def note_torch_path(self, reason: str) -> None:
        self.torch_path_calls[reason] = self.torch_path_calls.get(reason, 0) + 1

    @property
    def backend_reason(self) -> str:
        """Why this backend, plus (triton) why some attention calls used the torch path."""
        if not self.torch_path_calls:
            return self.selection_reason
        parts = ", ".join(f"{why} ({n} calls)" for why, n in self.torch_path_calls.items())
        return f"{self.selection_reason}; torch path for: {parts}"

    def new_cache(self):
        """A fresh ``transformers.Cache`` of ``CompressedLayer`` s for this model."""
        from transformers.cache_utils import Cache

        from kvlens.cache.layer import CompressedLayer

        windows = _sliding_windows(self.model, self.info.num_layers)
        layers = []
        for idx in range(self.info.num_layers):
            bal = self.config.balancers.get(idx)
            mikv = self.config.mikv
            if bal is not None and mikv is not None and mikv.balancer == "fixed":
                bal = torch.tensor(bal, dtype=torch.float32, device=_device(self.model))
            else:
                bal = None
            layers.append(CompressedLayer(self.config.layer(idx), idx, self.info.head_dim,
                                          scale_dtype=self.config.scale_dtype, mikv=mikv,
                                          balancer=bal, sliding_window=windows[idx],
                                          session=self))
        return Cache(layers=layers)


def _device(model):
    return next(model.parameters()).device


def _sliding_windows(model, num_layers: int) -> list[int | None]:
    config = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    out = []
    for t in types[:num_layers]:
        if t in ("sliding_attention", "chunked_attention"):
            if t == "chunked_attention":
                raise ConfigError("Chunked attention layers are not supported by the kvlens "
                                  "compressed cache.")
            out.append(int(window))
        elif t == "full_attention":
            out.append(None)
        else:
            raise ConfigError(f"Layer type {t!r} is not supported by the kvlens compressed "
                              "cache; supported: full_attention, sliding_attention.")
    return out


@contextmanager
def compressed_attention(model, config: KVConfig, backend: str = "auto"
                         ) -> Iterator[CompressionSession]:
    from kvlens.architecture import describe
    from kvlens.cache.attention import make_attention_fn, select_backend
    from kvlens.hf import attention_override, rope_tables

    info = describe(model)
    validate_for(config, info)
    name, reason = select_backend(backend, _device(model))
    session = CompressionSession(model, config, info, name, reason)
    with ExitStack() as stack:
        stack.enter_context(attention_override(model, make_attention_fn(name)))
        if any(config.layer(i).pre_rope_keys for i in range(info.num_layers)):
            session.rope = stack.enter_context(rope_tables(model))
        session.active = True
        try:
            yield session
        finally:
            session.active = False


def memory_report(cache) -> dict:
    """KV bytes measured from the cache's tensors, beside the fp16 equivalent.

    ``kv_bytes``: filled bytes of every buffer (packed codes, scales, zeros, residual window,
    high-precision set and its positions, balancers); ``kv_bytes_fp16``: the same tokens as fp16
    K and V; ``bits_per_element``: ``8 * kv_bytes / (elements of K and V)``."""
    parts = {"packed": 0, "residual": 0, "high_precision": 0, "balancer": 0}
    fp16 = 0
    allocated = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        for key, value in layer.used_bytes().items():
            parts[key] += value
        b, h, _, d = layer.res_k.buf.shape
        fp16 += 2 * b * h * layer.cumulative_length * d * 2
        allocated += sum(s.allocated_bytes() for s in (layer.kstore, layer.vstore, layer.res_k,
                                                        layer.res_v))
    total = sum(parts.values())
    return {"kv_bytes": total, "kv_bytes_fp16": fp16,
            "bits_per_element": 16.0 * total / fp16 if fp16 else 0.0,
            "kv_bytes_allocated": allocated, "breakdown": parts}
