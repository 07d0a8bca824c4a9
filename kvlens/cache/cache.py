"""Building the compressed cache for a model, installing its attention, and measuring its bytes.

Use::

    with compressed_attention(model, config, backend="auto") as session:
        cache = session.new_cache()
        model.generate(ids, **{cache_argument_name(model): cache}, ...)
        print(memory_report(cache))

``compressed_attention`` validates ``config`` against the model, chooses the backend
(``session.backend_reason``, with every reason a call still took the torch path) and installs
kvlens' attention function and, for pre-RoPE keys, the RoPE hooks; all undone on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from kvlens.cache.attention import make_attention_fn
from kvlens.cache.backend import select_backend
from kvlens.cache.engine import EngineLayer, static_scale
from kvlens.cache.layer import STATE_FIELDS, CompressedLayer, HistoryLayer, with_fixed_state
from kvlens.cache.layout import PARTS
from kvlens.cache.sets import SetPolicy, SetRows
from kvlens.config import KVConfig, validate_for
from kvlens.errors import ConfigError
from kvlens.layouts import Store
from kvlens.model.architecture import describe, text_config
from kvlens.model.hooks import attention_override, rope_frequency_candidates, rope_inputs
from kvlens.model.placement import input_device, layer_devices
from kvlens.quant import engine_rotation, hadamard_rotation


@dataclass
class CompressionSession:
    model: object
    config: KVConfig
    info: object
    backend: str
    selection_reason: str
    active: bool = False
    rope: dict = field(default_factory=dict)  # layer -> (cos, sin, position_ids) of its last call
    rope_candidates: list = field(default_factory=list)  # the model's (inv_freq, scaling) pairs
    #: With the triton backend: attention calls that took the torch path, counted per reason.
    torch_path_calls: dict = field(default_factory=dict)
    #: llama.cpp's rotation matrices of engine-format layers, shared, outside the cache
    rotations: dict = field(default_factory=dict)

    def engine_rotation(self, tensor: str, head_dim: int, device):
        """The ``[D, D]`` float32 rotation llama.cpp applies to ``tensor`` (key or value)."""
        key = (tensor, head_dim, str(device))
        if key not in self.rotations:
            self.rotations[key] = engine_rotation(tensor, head_dim).to(device)
        return self.rotations[key]

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
        """A fresh ``transformers.Cache``: a kvlens layer for each layer with a KV cache,
        transformers' own (exact) layer for the others (a hybrid model's SSM layers...)."""
        from transformers.cache_utils import Cache

        kv = self.info.attention_layers
        # Each layer's stores live where that layer computes (a device map may spread the
        # layers over GPUs); its rotation and balancer are put there too, one rotation copy
        # per device (kvlens.cache.layout counts them).
        devices = layer_devices(self.model)
        rotating = dict.fromkeys(devices[i] for i in kv if self.config.layer(i).rotates)
        rotation = hadamard_rotation(self.info.head_dim, self.config.rotation_seed) if rotating \
            else None
        rotations = {d: rotation.to(d) for d in rotating}
        exact = exact_layers(self.model) if self.info.is_hybrid or self.info.state_layers \
            else {}
        layers = []
        for idx in range(self.info.num_layers):
            if idx not in kv:
                layers.append(exact[idx])
                continue
            states = {"number_of_states": exact[idx].number_of_states} if idx in exact else {}
            if self.config.layer(idx).engine:
                layers.append(self._engine_layer(idx, **states))
            else:
                layers.append(self._compressed_layer(idx, devices[idx],
                                                     rotations.get(devices[idx]), **states))
        return Cache(layers=layers)

    def _compressed_layer(self, idx: int, device, rotation, **states):
        # a fixed balancer (only with protect.balancer "fixed", validated) of a compressed layer
        bal = self.config.balancers.get(idx) if self.config.layer(idx).compressed else None
        if bal is not None:
            bal = torch.tensor(bal, dtype=torch.float32, device=device)
        cls = with_fixed_state(CompressedLayer) if states else CompressedLayer
        return cls(self.config.layer(idx), idx, self.info.head_dim,
                   scale_dtype=self.config.scale_dtype, fp_dtype=self.config.fp_dtype,
                   protect=self.config.protect_for(idx), balancer=bal,
                   sliding_window=self.info.window(idx), rotation=rotation, session=self,
                   write_first=self.config.write_before_attention,
                   kv_shared=self.info.kv_shared, **states)

    def _engine_layer(self, idx: int, **states):
        setting = self.config.layer(idx)
        given = self.config.kv_scales.get(idx, {})
        hkv = self.info.num_key_value_heads
        cls = with_fixed_state(EngineLayer) if states else EngineLayer
        return cls(setting.key_type, setting.value_type, idx, self.info.head_dim,
                   key_scale=static_scale(setting.key_type, hkv, given.get("key")),
                   value_scale=static_scale(setting.value_type, hkv, given.get("value")),
                   sliding_window=self.info.window(idx), session=self,
                   kv_shared=self.info.kv_shared, **states)


def exact_layers(model) -> dict:
    """Per model index, transformers' own cache layer for every layer whose state kvlens leaves
    exact: one without a KV cache (linear attention, SSM...), or a hybrid layer's state."""
    from transformers import cache_utils

    get = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", None)
    if get is None or mapping is None:
        raise ConfigError("This hybrid model's cache needs transformers' per-layer cache types "
                          "(transformers 5.x); upgrade transformers.")
    types, kwargs = get(text_config(model.config))
    return {i: mapping[t](**kw) for i, (t, kw) in enumerate(zip(types, kwargs))
            if t not in ("full_attention", "sliding_attention", "chunked_attention")}


@contextmanager
def compressed_attention(model, config: KVConfig, backend: str = "auto"
                         ) -> Iterator[CompressionSession]:
    """Validate ``config`` against ``model``, choose the backend and install kvlens' attention
    (and, for pre-RoPE keys, the RoPE hooks) for the block (module docstring)."""
    info = describe(model)
    validate_for(config, info)
    name, reason = select_backend(backend, input_device(model))
    session = CompressionSession(model, config, info, name, reason)
    with ExitStack() as stack:
        stack.enter_context(attention_override(model, make_attention_fn(name)))
        if any(config.layer(i).pre_rope_keys for i in info.attention_layers):
            session.rope = stack.enter_context(rope_inputs(model))
            session.rope_candidates = rope_frequency_candidates(model)
        session.active = True
        try:
            yield session
        finally:
            session.active = False


def memory_report(cache) -> dict:
    """The bytes the cache object really holds, by part, beside the fp16 equivalent.

    ``kv_bytes``: every tensor storage reachable from the cache's layers (walked; shared storages
    once, whole storages: capacity, not only the filled part), per device in ``by_device``;
    ``breakdown``: the same bytes by part (``kvlens.cache.layout.PARTS``) from the layers' named
    tensors, ``unaccounted`` what no part names (0 unless a layer keeps something undeclared);
    ``kv_bytes_fp16``: an fp16 K/V cache of the tokens each layer can still attend to;
    ``bits_per_element`` = ``16 * kv_bytes / kv_bytes_fp16``; ``state_bytes``: what a hybrid
    model's layers without a KV cache hold, apart. Python object headers are not counted."""

    parts = dict.fromkeys(PARTS, 0)
    seen: set = set()
    fp16 = 0
    for layer in cache.layers:
        if not isinstance(layer, HistoryLayer) or not getattr(layer, "is_initialized", False):
            continue
        for part, tensor in layer.named_tensors():
            parts[part] += _storage_bytes(tensor, seen)
        b, h, d = layer.kv_dims() if hasattr(layer, "kv_dims") else (
            *layer.res_k.buf.shape[:2], layer.res_k.buf.shape[3])
        w = layer.sliding_window
        visible = layer.cumulative_length if w is None else min(layer.cumulative_length, w - 1)
        fp16 += layer.kv_tensors * b * h * visible * d * 2  # MLA: one latent row per token
    named = sum(parts.values())
    by_device = held_bytes_by_device(cache)
    walked = sum(by_device.values())
    return {"kv_bytes": walked, "kv_bytes_fp16": fp16,
            "bits_per_element": 16.0 * walked / fp16 if fp16 else 0.0,
            "breakdown": parts, "unaccounted": walked - named, "by_device": by_device,
            "state_bytes": state_bytes(cache)}


def state_bytes(cache) -> int:
    """Bytes of the fixed-size states a hybrid model's cache keeps beside its K/V: the layers
    that are not kvlens layers and the ``STATE_FIELDS`` of kvlens' hybrid layers."""
    seen: set = set()
    roots = [v for layer in cache.layers for k, v in vars(layer).items()
             if not isinstance(layer, HistoryLayer) or k in STATE_FIELDS]
    return sum(_storage_bytes(t, seen) for t in _tensors(roots))


def _tensors(roots: list, enter=lambda o: False) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``roots`` through lists, tuples, dicts and the attributes of
    the objects ``enter`` accepts (each once; never a session or a ``STATE_FIELDS`` field)."""
    seen: set = set()
    stack = list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif enter(o):
            stack.extend(v for k, v in vars(o).items()
                         if k != "session" and k not in STATE_FIELDS)


def _storage_bytes(tensor: torch.Tensor, seen: set) -> int:
    storage = tensor.untyped_storage()
    key = (str(storage.device), storage.data_ptr())
    if key in seen or storage.nbytes() == 0:
        return 0
    seen.add(key)
    return storage.nbytes()


def held_bytes_by_device(obj) -> dict[str, int]:
    """Per device (``"cpu"``, ``"cuda:0"``...), bytes of every tensor storage reachable from
    ``obj`` and kvlens' cache objects in it (layers, stores, sets), each storage once on the
    device it lives on: what the cache holds, not the model or the session."""
    seen: set = set()
    total: dict[str, int] = {}
    kinds = (HistoryLayer, Store, SetRows, SetPolicy)
    for t in _tensors([obj], lambda o: o is obj or isinstance(o, kinds)):
        n = _storage_bytes(t, seen)
        if n:
            dev = str(t.untyped_storage().device)
            total[dev] = total.get(dev, 0) + n
    return total
