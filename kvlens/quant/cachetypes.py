"""Engine cache types: what one tensor (K or V) of one layer is stored as in an engine's cache.

A cache type is either an engine format (``kvlens.quant.formats.FormatSetting``: ggml blocks,
static fp8, dynamic per-token-head, vLLM's ``fp8_ds_mla``) or a plain float type
(``DenseType``: llama.cpp's ``f16``, ``bf16``, ``f32``; vLLM's ``auto``/skipped layers are
``f16``). Configs store the name (``KVConfig`` ``key_format`` / ``value_format``).

Static fp8 types calibrated from data (``fp8_e4m3``, ``fp8_e5m2@head:p99.9``: no ``:sS``) need
their scales from a capture (``KVConfig.kv_scales``); ``needs_scales`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.errors import ConfigError
from kvlens.quant.formats import FormatSetting, parse_format
from kvlens.quant.rotation import hadamard_block_size

DENSE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}


@dataclass(frozen=True)
class DenseType:
    """A tensor kept unquantized at ``name`` (``f16``, ``bf16`` or ``f32``)."""

    name: str

    family = "dense"

    def __post_init__(self) -> None:
        if self.name not in DENSE_BYTES:
            raise ConfigError(f"Unknown float cache type {self.name!r}; allowed: "
                              f"{', '.join(DENSE_BYTES)}.")

    @property
    def element_bytes(self) -> int:
        return DENSE_BYTES[self.name]

    @property
    def torch_dtype(self) -> str:
        return {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[self.name]

    def rotates(self, head_dim: int) -> bool:
        return False  # llama.cpp rotates quantized cache types only


CacheType = FormatSetting | DenseType


def parse_cache_type(text: str) -> CacheType:
    """``"f16"`` / ``"bf16"`` / ``"f32"`` -> ``DenseType``; any ``parse_format`` name (``q4_0``,
    ``q4_0+norot``, ``fp8_e4m3:s1``, ``int8@token-head`` ...) -> ``FormatSetting``. Unknown names
    raise ``ConfigError`` listing both."""
    name = (text or "").strip().lower() if isinstance(text, str) else text
    if not isinstance(name, str):
        raise ConfigError(f"A cache type must be a string, got {type(text).__name__}.")
    if name in DENSE_BYTES:
        return DenseType(name)
    try:
        return parse_format(name)
    except ConfigError as exc:
        raise ConfigError(f"{exc} Unquantized cache types: {', '.join(DENSE_BYTES)}.") from None


def needs_scales(ct: CacheType) -> bool:
    """A static fp8 type whose scale comes from calibration (not a fixed ``:sS``)."""
    fmt = getattr(ct, "format", None)
    return getattr(fmt, "family", None) == "fp8" and fmt.fixed_scale is None


def scale_count(ct: CacheType, kv_heads: int) -> int:
    """Static scales this type holds per layer (0 for all but static fp8)."""
    fmt = getattr(ct, "format", None)
    if getattr(fmt, "family", None) != "fp8":
        return 0
    return 1 if fmt.scope == "tensor" else kv_heads


def check_engine_layer(layer, head_dim: int, kv_heads: int, scales, where: str) -> None:
    """Raise ``ConfigError`` unless an engine-format ``layer`` (``kvlens.config.schema.LayerKV``)
    fits a model with ``head_dim`` and ``kv_heads``, with its static fp8 ``scales``
    (``{"key": (...), "value": (...)}`` or None) where the types need them."""

    scales = scales or {}
    ds_mla = [getattr(getattr(ct, "format", None), "family", None) == "ds-mla"
              for ct in (layer.key_type, layer.value_type)]
    if any(ds_mla) and not all(ds_mla):
        raise ConfigError(f"{where}: fp8_ds_mla stores an MLA model's one latent row, keys and "
                          "values alike; set key_format and value_format both to fp8_ds_mla.")
    for tensor, ct in (("key", layer.key_type), ("value", layer.value_type)):
        fmt = getattr(ct, "format", None)
        if fmt is not None and fmt.family in ("ggml", "ds-mla"):
            try:
                fmt.check_fits((1, 1, 1, head_dim))
            except ConfigError as exc:
                raise ConfigError(f"{where} {tensor}: {exc}") from None
        if ct.rotates(head_dim) and ct.rotation == "on":
            try:
                hadamard_block_size(head_dim)
            except ConfigError as exc:
                raise ConfigError(f"{where} {tensor} ({ct.name}): {exc}") from None
        n = scale_count(ct, kv_heads)
        got = scales.get(tensor)
        if needs_scales(ct):
            if got is None:
                raise ConfigError(
                    f"{where}: {tensor} type {ct.name} is a static fp8 scale calibrated from "
                    "data, but the config has no kv_scales for it; calibrate from a capture "
                    "(generate --calibration run.h5, or recommend --target) or use the engine "
                    f"default scale 1.0 ({ct.format.name.split(':')[0]}:s1).")
            if len(got) != n:
                raise ConfigError(f"{where}: kv_scales.{tensor} has {len(got)} scales but "
                                  f"{ct.name} needs {n} ({'one per layer' if n == 1 else 'one per KV head'}).")
        elif got is not None:
            raise ConfigError(f"{where}: kv_scales.{tensor} is given but {ct.name} does not "
                              "use calibrated static scales; remove it.")
