"""Engine settings of the block-float KV caches (a part of the one engine-setting vocabulary,
``kvlens.config.engine``, which parses them): ``--kv-cache-dtype nvfp4`` (vLLM, SGLang),
SGLang's ``fp4_e2m1`` (now spelled ``fp4_mx_block16``) and ``mxfp8``, TensorRT-LLM's
``KvCacheConfig(dtype="nvfp4")``. Each stores every layer in a ``kvlens.layouts`` block-float
layout (``NvFp4``, ``Fp4E2M1``, ``MxFp8``) with no full-precision window, scales computed as
each token is written; NVFP4's per-tensor global scale is the checkpoint's ``k_scale`` /
``v_scale`` (``BlockFloatSetting.global_scale``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlens.config.schema import KVConfig, LayerKV
from kvlens.errors import ConfigError, is_int
from kvlens.layouts.blockfloat import Fp4E2M1, MxFp8, NvFp4

#: the block-float dtypes of each engine, as the engine spells them
BLOCKFLOAT_DTYPES = {"vllm": ("nvfp4",), "sglang": ("nvfp4", "fp4_mx_block16", "mxfp8"),
                     "trtllm": ("nvfp4",)}
#: older spellings an engine still documents -> the canonical one
BLOCKFLOAT_ALIASES = {"fp4_e2m1": "fp4_mx_block16"}
#: what ``BlockFloatSetting.layout`` builds for each dtype (nvfp4 takes its global scale)
_LAYOUTS = {"fp4_mx_block16": Fp4E2M1, "mxfp8": MxFp8}
#: how each engine is told the dtype (``KVConfig.description``)
ENGINE_FLAG = {"vllm": "vllm --kv-cache-dtype {}", "sglang": "sglang --kv-cache-dtype {}",
        "trtllm": "TensorRT-LLM KvCacheConfig(dtype=\"{}\")"}


def number_name(x: float) -> str:
    """``x`` as it reads back exactly: ``1`` for 1.0, else the shortest round-trip form."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def skip_layers(engine: str, skip: tuple[int, ...]) -> tuple[int, ...]:
    if skip and engine != "vllm":
        raise ConfigError(f":skip= is vLLM's --kv-cache-dtype-skip-layers; {engine} has none.")
    if not all(is_int(i, 0) for i in skip):
        raise ConfigError(f"Invalid skip layers {skip!r}; allowed: layer indices >= 0.")
    return tuple(sorted(set(skip)))


def is_blockfloat(engine: str, dtype: str) -> bool:
    return BLOCKFLOAT_ALIASES.get(dtype, dtype) in BLOCKFLOAT_DTYPES.get(engine, ())


@dataclass(frozen=True)
class BlockFloatSetting:
    """``engine`` storing every layer in block-float ``dtype`` (module docstring).
    ``global_scale``: NVFP4's fixed per-tensor scale (``:sS``; ``None``: the engines' 1.0, or
    calibrated per layer when the command has a capture); ``skip``: layers kept at f16 (vLLM's
    ``--kv-cache-dtype-skip-layers``)."""

    engine: str
    dtype: str
    global_scale: float | None = None
    skip: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", BLOCKFLOAT_ALIASES.get(self.dtype, self.dtype))
        allowed = BLOCKFLOAT_DTYPES.get(self.engine)
        if allowed is None or self.dtype not in allowed:
            raise ConfigError(f"{self.engine} block-float KV-cache dtypes here are "
                              f"{', '.join(allowed or ())}; got {self.dtype!r}.")
        g = self.global_scale
        if g is not None and (self.dtype != "nvfp4" or not math.isfinite(g) or g <= 0):
            raise ConfigError(f":s{g} fixes NVFP4's global scale: nvfp4 only, a finite number "
                              "> 0.")
        object.__setattr__(self, "skip", skip_layers(self.engine, self.skip))

    @property
    def name(self) -> str:
        out = f"{self.engine}:{self.dtype}"
        if self.global_scale is not None:
            out += f":s{number_name(self.global_scale)}"
        return out + (f":skip={','.join(map(str, self.skip))}" if self.skip else "")

    @property
    def calibrates(self) -> bool:
        """NVFP4 without a fixed scale: its global scales come from a capture when the command
        has one."""
        return self.dtype == "nvfp4" and self.global_scale is None

    def layout(self, global_scale: float | None = None):
        """The layout spec of one tensor (``global_scale``: a calibrated NVFP4 scale)."""
        if self.dtype == "nvfp4":
            return NvFp4(global_scale or self.global_scale or 1.0)
        return _LAYOUTS[self.dtype]()

    def kvconfig(self, label: str, scales: dict[int, tuple[float, float]] | None = None
                 ) -> KVConfig:
        """Every layer in ``layout()``, no window; ``scales``: calibrated NVFP4 global scales
        ``{layer: (key, value)}``; skipped layers as ``f16`` engine layers."""
        layers = {i: LayerKV(self.layout(k), self.layout(v)) for i, (k, v) in
                  (scales or {}).items()}
        layers.update({i: LayerKV(key_format="f16", value_format="f16") for i in self.skip})
        spec = self.layout()
        return KVConfig(label, LayerKV(spec, spec), layers, fp_dtype="float16",
                        description=ENGINE_FLAG[self.engine].format(self.dtype))
