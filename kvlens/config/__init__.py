"""The generation config: what every layer of the compressed cache stores.

- ``schema``: the frozen dataclasses (``LayerKV``, ``ProtectSettings``, ``KVConfig``) and
  their validation; ``model_check``: ``validate_for``, whether a config fits a loaded model.
- ``io``: the versioned JSON form (``config_from_dict``, ``load_config``, ``save_config``);
  ``versions``: its ``FORMAT`` string and its one ``VERSION``.
- ``presets``: the named presets and ``resolve`` (a preset name or a config file).
- ``extension``: a research set policy's own config key (``register``).
- ``engine``: the engine-setting vocabulary (``llamacpp:q4_0``, ``vllm:fp8_e4m3:s1`` ...) every
  command reads and ``recommend --target`` prints; ``blockfloat``: its block-float settings
  (``vllm:nvfp4``, ``sglang:mxfp8``, ``trtllm:nvfp4`` ...).
The storage layouts a config's ``key``/``value`` name, and their rules, are ``kvlens.layouts``.
"""

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
    FP_BYTES,
    FP_DTYPES,
    SCALE_DTYPES,
    KVConfig,
    LayerKV,
    ProtectSettings,
)
from kvlens.config.versions import FORMAT, VERSION

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
