"""The generation config (``schema``, its JSON form ``io``, ``presets``, the research key
``extension``, ``model_check``) and the engine-setting vocabulary (``engine``, ``blockfloat``,
``hqq``): docs/internals/architecture.md says what each module owns."""

from kvlens.config.blockfloat import BlockFloatSetting
from kvlens.config.engine import (
    CacheDtypeSetting,
    LlamaCppSetting,
    QuantoSetting,
    TurboQuantSetting,
    allowed_settings,
    is_engine_setting,
    parse_engine_setting,
)
from kvlens.config.hqq import HqqSetting
from kvlens.config.io import config_from_dict, load_config, save_config
from kvlens.config.model_check import validate_for
from kvlens.config.presets import PRESETS, preset, resolve
from kvlens.config.schema import (
    BALANCER_MODES,
    FORMAT,
    FP_BYTES,
    FP_DTYPES,
    SCALE_DTYPES,
    VERSION,
    KVConfig,
    LayerKV,
    ProtectSettings,
)

__all__ = [
    "BALANCER_MODES",
    "FORMAT",
    "FP_BYTES",
    "FP_DTYPES",
    "PRESETS",
    "SCALE_DTYPES",
    "VERSION",
    "BlockFloatSetting",
    "CacheDtypeSetting",
    "HqqSetting",
    "KVConfig",
    "LayerKV",
    "LlamaCppSetting",
    "ProtectSettings",
    "QuantoSetting",
    "TurboQuantSetting",
    "allowed_settings",
    "config_from_dict",
    "is_engine_setting",
    "load_config",
    "parse_engine_setting",
    "preset",
    "resolve",
    "save_config",
    "validate_for",
]
