"""What kvlens needs of a model's shape, in one record: ``ModelShape``, filled from a loaded
model (``kvlens.model.architecture.describe``), its files before it loads
(``kvlens.model.header``: 0 where they do not say) or a capture
(``kvlens.capture.store.CaptureMeta.shape``). Layers are named by their model index;
``attention_layers`` are those with a KV cache (a hybrid model's others keep a fixed-size state
that kvlens leaves exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlens.model.mla import MlaShape


@dataclass(frozen=True)
class ModelShape:
    """A model's shape: its layers and heads, the layers with a KV cache and their windows."""

    num_layers: int  # decoder layers: model indices 0 .. num_layers - 1
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    #: model indices of the layers with a KV cache; () = every layer (also when it names them all)
    kv_layers: tuple[int, ...] = ()
    #: per model layer: its sliding window (sliding) or chunk (chunked) in tokens, else None;
    #: () = no layer has one (also when every entry is None)
    windows: tuple[int | None, ...] = ()
    #: MLA models (``kvlens.model.mla``): the latent row every layer caches; keys and values
    #: are that one row (one KV head, ``head_dim`` = its width)
    mla: MlaShape | None = None
    architecture: str = ""
    model_type: str = ""
    #: whether the model applies RoPE (assumed before it loads, so that a check against its
    #: files refuses nothing the loaded model would accept)
    has_rope: bool = True
    rope: dict[str, Any] = field(default_factory=dict)  # RoPE parameters, JSON-able values
    dtype_bytes: int = 2  # bytes per element of the model's dtype (2 where not known)
    devices: tuple[str, ...] = ()  # per model layer, where it runs; () = all on one device
    #: per model layer, its kind (``kvlens.model.architecture.LAYER_KINDS``) and the layers
    #: holding a fixed-size (non-KV) state, where the loaded model says (() = every layer
    #: "full"; a header or a capture knows ``kv_layers`` and ``windows`` only)
    layer_kinds: tuple[str, ...] = ()
    state_layers: tuple[int, ...] = ()

    def __post_init__(self):  # one form each: () for every layer, and for no window
        if tuple(self.kv_layers) == tuple(range(self.num_layers)):
            object.__setattr__(self, "kv_layers", ())
        if not any(w is not None for w in self.windows):
            object.__setattr__(self, "windows", ())

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model indices of the layers with a KV cache."""
        return self.kv_layers or tuple(range(self.num_layers))

    @property
    def is_hybrid(self) -> bool:
        """Some layers hold no KV cache."""
        return len(self.attention_layers) < self.num_layers

    @property
    def kv_shared(self) -> bool:
        """Keys and values are one tensor (MLA's latent row)."""
        return self.mla is not None

    @property
    def kv_tensors(self) -> int:
        """Tensors an fp16 cache holds per layer: K and V, or one latent row (MLA)."""
        return 1 if self.kv_shared else 2

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def device(self, layer: int) -> str:
        return self.devices[layer] if self.devices else "all"

    def visible_tokens(self, layer: int, tokens: int) -> int:
        """Tokens an fp16 cache of this layer holds: all, or the last ``W - 1`` (sliding)."""
        w = self.window(layer)
        return tokens if w is None else min(tokens, w - 1)

    def fp16_bytes(self, tokens: int, batch: int = 1) -> int:
        """Bytes of an fp16 K/V cache holding what each layer can still attend to (an MLA
        model's: its latent rows, once, as engines and transformers hold them)."""
        return sum(self.kv_tensors * batch * self.num_key_value_heads
                   * self.visible_tokens(i, tokens) * self.head_dim * 2
                   for i in self.attention_layers)
