"""What a compressed-KV-cache config means: frozen dataclasses (``LayerKV``, ``ProtectSettings``,
``KVConfig``) that validate themselves on construction. Whether a config fits a loaded model is
``kvlens.config.model_check``; the JSON form ``kvlens.config.io``; the presets
``kvlens.config.presets``. docs/generate.md (config files) says what each field does.

A config is a ``default`` layer setting plus optional per-layer overrides. A layer stores keys
and values as a storage layout spec each (``kvlens.layouts``; ``None``: the model's dtype) with a
full-precision residual window (``flush_tokens``: 0 flushes it whole, KIVI; fewer slide it), or
as an engine's own cache types (``key_format`` / ``value_format``, ``kvlens.quant.cachetypes``;
no window). ``protect`` keeps the attention sinks at ``fp_dtype`` and balances key channels; a
research set policy adds its own key (``kvlens.config.extension``). ``fp_dtype`` is the dtype of
every full-precision part (``exact``: the model's own). A ``CodebookSpec`` key (vLLM
TurboQuant's keys) rotates with the layer's key rotation, so its seed is the config's
``rotation_seed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvlens.errors import ConfigError, is_int
from kvlens.layouts import is_layout_spec, kinds, layout_of
from kvlens.layouts.packed import SCALE_DTYPES
from kvlens.quant import CodebookSpec
from kvlens.quant.cachetypes import DenseType, parse_cache_type
from kvlens.quant.llamacpp_cpu import ENGINE_ATTENTIONS

# The file-format identifier written into every config; it names the module that first
# defined the format and is kept as is so that existing files stay readable.
FORMAT = "kvlens.kvconfig"
VERSION = 1  # the one version this kvlens reads and writes (kvlens.config.io refuses others)
BALANCER_MODES = ("off", "online", "fixed")
#: bytes per element of each dtype the full-precision parts (window, sinks, sets) may be held in
FP_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
#: what a config's ``fp_dtype`` may say: one of those, or ``exact`` (the model's own dtype)
FP_DTYPES = (*FP_BYTES, "exact")
#: why a config that stores a removed research layout is refused (here and by kvlens.config.io)
REMOVED = "removed from kvlens by issue #57 (a negative result, docs/lab-notes/codebooks.md)"


@dataclass(frozen=True)
class LayerKV:
    """How one layer's cache is stored (module docstring)."""

    key: Any = None  # a storage layout spec (kvlens.layouts: QuantSpec, CodebookSpec...)
    value: Any = None
    residual_tokens: int = 0
    pre_rope_keys: bool = False
    flush_tokens: int = 0  # 0: flush the whole window when full (KIVI); F: the oldest F at a time
    rotate_keys: bool = False  # store k R, attend with q R (Hadamard R, kvlens.quant.rotation)
    rotate_values: bool = False  # store v R, un-rotate the attention output by R^T
    # engine cache types (kvlens.quant.cachetypes names, e.g. "q8_0", "f16"): both or neither
    key_format: str | None = None
    value_format: str | None = None

    def __post_init__(self) -> None:
        # the flags' types first: a codebook spec sets its tensor's rotation flag below
        for name in ("pre_rope_keys", "rotate_keys", "rotate_values"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Invalid {name} {getattr(self, name)!r}; allowed: true, "
                                  "false.")
        if self.key_format is not None or self.value_format is not None:
            self._check_engine()
        self._check_codebook()
        r = self.residual_tokens
        if not is_int(r, 0):
            raise ConfigError(f"Invalid residual_tokens {r!r}; allowed: an integer >= 0.")
        f = self.flush_tokens
        if not is_int(f, 0, r) or (f and not r):
            raise ConfigError(f"Invalid flush_tokens {f!r} for residual_tokens {r}; allowed: 0 "
                              f"(flush the whole window) or 1-{max(r, 1)} (needs a window).")
        for name, spec in (("rotate_keys", self.key), ("rotate_values", self.value)):
            if getattr(self, name) and spec is None:
                raise ConfigError(f"{name} is set but that tensor is not quantized, so the "
                                  "rotation would do nothing; set a quantization spec or "
                                  f"{name}: false.")
        if self.rotate_keys and self.pre_rope_keys:
            raise ConfigError("rotate_keys cannot be combined with pre_rope_keys in the cache: "
                              "the Hadamard rotation and RoPE do not commute, so the query "
                              "cannot absorb the rotation (compare-axes measures the "
                              "combination); disable one of them.")

    def _check_codebook(self) -> None:
        for name in ("key", "value"):
            spec = getattr(self, name)
            if spec is not None and not is_layout_spec(spec):
                raise ConfigError(f"Invalid {name} spec {spec!r}; allowed: a storage layout "
                                  f"({', '.join(kinds())}) or None.")
        if isinstance(self.value, CodebookSpec):
            raise ConfigError(f"A codebook value spec ({self.value.label}) was {REMOVED}; "
                              "store values with a QuantSpec.")
        if isinstance(self.key, CodebookSpec) and self.pre_rope_keys:
            raise ConfigError("A codebook key spec cannot be combined with pre_rope_keys in the "
                              "cache: its Hadamard rotation and RoPE do not commute, so the "
                              "query cannot absorb the rotation; use a uniform key spec or "
                              "pre_rope_keys: false.")
        book = self.key_codebook
        if book is None:
            return
        if book.rotation is None:
            if self.rotate_keys is True:
                raise ConfigError("rotate_keys is set but the codebook key spec has no rotation "
                                  "(its rotation is the layer's key rotation); give the "
                                  "codebook a rotation or set rotate_keys: false.")
        else:  # the codebook's rotation is the layer's: window and sets stored rotated too
            object.__setattr__(self, "rotate_keys", True)

    @property
    def key_codebook(self) -> CodebookSpec | None:
        """The key ``CodebookSpec`` (``None``: keys uniform or unquantized)."""
        return self.key if isinstance(self.key, CodebookSpec) else None

    def _check_engine(self) -> None:
        if self.key_format is None or self.value_format is None:
            raise ConfigError("An engine-format layer needs both key_format and value_format "
                              "(use \"f16\" for a tensor the engine keeps unquantized).")
        parse_cache_type(self.key_format)
        parse_cache_type(self.value_format)
        if (self.key is not None or self.value is not None or self.residual_tokens
                or self.pre_rope_keys or self.rotate_keys or self.rotate_values):
            raise ConfigError("key_format/value_format (an engine's cache types) cannot be "
                              "combined with kvlens quantization specs, a residual window, "
                              "pre-RoPE keys or rotate_keys/rotate_values (the "
                              "engine type carries its own rotation: +rot/+norot); set "
                              "key/value to null, "
                              "residual_tokens 0 and the flags false.")

    @property
    def engine(self) -> bool:
        """Stored in engine cache types (``kvlens.cache.engine.EngineLayer``)."""
        return self.key_format is not None

    @property
    def key_type(self):
        return parse_cache_type(self.key_format)

    @property
    def value_type(self):
        return parse_cache_type(self.value_format)

    @property
    def compressed(self) -> bool:
        if self.engine:
            return not (isinstance(self.key_type, DenseType)
                        and isinstance(self.value_type, DenseType))
        return self.key is not None or self.value is not None

    def to_dict(self) -> dict[str, Any]:
        out = {"key": _spec_dict(self.key), "value": _spec_dict(self.value),
               "residual_tokens": self.residual_tokens, "flush_tokens": self.flush_tokens,
               "pre_rope_keys": self.pre_rope_keys, "rotate_keys": self.rotate_keys,
               "rotate_values": self.rotate_values}
        if self.engine:
            out.update(key_format=self.key_format, value_format=self.value_format)
        return out

    @property
    def rotates(self) -> bool:
        return self.rotate_keys or self.rotate_values


@dataclass(frozen=True)
class ProtectSettings:
    """Keep the first ``sink_tokens`` tokens (attention sinks) at ``fp_dtype`` and balance key
    channels (``k*b`` stored, ``q/b`` used). ``importance``: a research set policy's settings
    (``kvlens.config.extension``, its own key of the config) that replaces the sinks-only set on
    the layers it applies to; the others keep the sinks alone (``KVConfig.protect_for``)."""

    sink_tokens: int = 4
    balancer: str = "off"
    balancer_exponent: float = 0.5
    importance: Any = None  # a kvlens.config.extension.SetSettings, or None: the sinks alone

    def __post_init__(self) -> None:
        s = self.sink_tokens
        if not is_int(s, 0):
            raise ConfigError(f"Invalid protect.sink_tokens {s!r}; allowed: an integer >= 0.")
        if self.balancer not in BALANCER_MODES:
            raise ConfigError(f"Unknown protect.balancer {self.balancer!r}; allowed: "
                              f"{', '.join(BALANCER_MODES)}.")
        e = self.balancer_exponent
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ConfigError(f"Invalid protect.balancer_exponent {e!r}; allowed: (0, 1].")

    def to_dict(self) -> dict[str, Any]:
        """The ``protect`` section (the ``importance`` settings are their own key)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "importance"}


@dataclass(frozen=True)
class KVConfig:
    """A whole compressed-cache config (see the module docstring for the JSON form)."""

    name: str
    default: LayerKV
    layers: Mapping[int, LayerKV] = field(default_factory=dict)
    protect: ProtectSettings | None = None
    balancers: Mapping[int, tuple[tuple[float, ...], ...]] = field(default_factory=dict)
    scale_dtype: str = "float16"
    description: str = ""
    model: Mapping[str, int] | None = None
    fp_dtype: str = "float16"
    rotation_seed: int | None = None  # random sign flips of the Hadamard rotation (None: none)
    # static fp8 scales of engine layers: {layer: {"key": (s,) or (s_0..s_H-1), "value": ...}}
    kv_scales: Mapping[int, Mapping[str, tuple[float, ...]]] = field(default_factory=dict)
    # the engine arithmetic engine-format layers attend with (kvlens.quant.llamacpp_cpu
    # ENGINE_ATTENTIONS); None: the model's own float attention over the read-back K/V
    engine_attention: str | None = None
    # vLLM TurboQuant's order: after the first forward, new tokens are coded before attention
    write_before_attention: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("A KV config needs a non-empty string 'name'.")
        if self.engine_attention is not None and self.engine_attention not in ENGINE_ATTENTIONS:
            raise ConfigError(f"Unknown engine_attention {self.engine_attention!r}; allowed: "
                              f"null (the model's attention), {', '.join(ENGINE_ATTENTIONS)}.")
        if not isinstance(self.write_before_attention, bool):
            raise ConfigError(f"Invalid write_before_attention {self.write_before_attention!r}; "
                              "allowed: true, false.")
        if self.write_before_attention:
            self._check_write_first()
        if self.scale_dtype not in SCALE_DTYPES:
            raise ConfigError(f"Unknown scale_dtype {self.scale_dtype!r}; allowed: "
                              f"{', '.join(SCALE_DTYPES)}.")
        r = self.rotation_seed
        if r is not None and not is_int(r, 0):
            raise ConfigError(f"Invalid rotation_seed {r!r}; allowed: null (no sign flips) or "
                              "an integer >= 0.")
        if self.fp_dtype not in FP_DTYPES:
            raise ConfigError(f"Unknown fp_dtype {self.fp_dtype!r}; allowed: "
                              f"{', '.join(FP_DTYPES)}.")
        if self.protect is not None and self.protect.balancer == "fixed" and not self.balancers:
            raise ConfigError("protect.balancer is 'fixed' but the config has no 'balancers'; "
                              "add them or use balancer 'online' or 'off'.")
        if self.balancers and (self.protect is None or self.protect.balancer != "fixed"):
            mode = "no 'protect' section" if self.protect is None else \
                f"protect.balancer {self.protect.balancer!r}"
            raise ConfigError(f"The config gives 'balancers' but has {mode}, which would ignore "
                              "them; set protect.balancer to 'fixed' (allowed: "
                              f"{', '.join(BALANCER_MODES)}) or remove 'balancers'.")
        self._check_codebook_seeds()

    def _check_write_first(self) -> None:
        """``write_before_attention`` codes each forward's tokens at once: no compressed layer
        may keep a residual window (nothing would wait in it) or a set (chosen from the
        attention the tokens receive before they are coded)."""
        if self.protect is not None:
            raise ConfigError("write_before_attention cannot be combined with 'protect' (its "
                              "set is chosen from the attention tokens receive before they are "
                              "coded); remove one of them.")
        for idx, setting in [(None, self.default), *sorted(self.layers.items())]:
            if setting.compressed and not setting.engine and setting.residual_tokens:
                where = "default" if idx is None else f"layer {idx}"
                raise ConfigError(f"{where}: write_before_attention codes every token at once, "
                                  f"so a compressed layer keeps no residual window; got "
                                  f"residual_tokens={setting.residual_tokens}, allowed: 0.")

    def _check_codebook_seeds(self) -> None:
        """A codebook key spec's rotation is its layer's key rotation: its seed must be the
        config's ``rotation_seed``."""
        for idx, setting in [(None, self.default), *sorted(self.layers.items())]:
            book = setting.key_codebook
            if book is not None and book.rotation is not None \
                    and book.rotation.seed != self.rotation_seed:
                where = "default" if idx is None else f"layer {idx}"
                raise ConfigError(f"{where}: the key codebook's rotation seed "
                                  f"{book.rotation.seed!r} is not the config's rotation_seed "
                                  f"{self.rotation_seed!r} (the codebook's rotation is the "
                                  "layer's key rotation); make them equal.")

    def layer(self, idx: int) -> LayerKV:
        return self.layers.get(idx, self.default)

    def protect_for(self, idx: int) -> ProtectSettings | None:
        """The settings layer ``idx`` keeps its set with: ``protect`` itself when its
        ``importance`` set applies to the layer (or there is none), else without it (the sinks
        at ``fp_dtype``, the balancer)."""
        p = self.protect
        if p is None or p.importance is None or p.importance.applies_to(idx):
            return p
        return replace(p, importance=None)

    @property
    def compressed(self) -> bool:
        return self.default.compressed or any(v.compressed for v in self.layers.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "name": self.name,
            "description": self.description, "default": self.default.to_dict(),
            "layers": {str(i): v.to_dict()
                       for i, v in sorted(self.layers.items())},  # overrides merge over default
            "protect": self.protect.to_dict() if self.protect else None,
            "balancers": {str(i): [list(r) for r in b] for i, b in sorted(self.balancers.items())}
            or None,
            "scale_dtype": self.scale_dtype,
            "fp_dtype": self.fp_dtype,
            "rotation_seed": self.rotation_seed,
            "model": dict(self.model) if self.model else None,
        } | ({"kv_scales": {str(i): {t: list(v) for t, v in s.items()}
                            for i, s in sorted(self.kv_scales.items())}}
             if self.kv_scales else {}) | ({"engine_attention": self.engine_attention}
                                          if self.engine_attention else {}) | (
            {"write_before_attention": True} if self.write_before_attention else {}) | (
            {imp.key: imp.to_dict()} if (imp := self.protect and self.protect.importance) else {})


def _spec_dict(spec) -> dict[str, Any] | None:
    return None if spec is None else layout_of(spec).to_dict()
