"""Deploy targets: engine settings (llama.cpp, vLLM, SGLang, transformers) as kvlens configs
(``presets``) and the recommendation of what to deploy on each engine (``targets``)."""

from kvlens.deploy.presets import (
    ENGINES,
    EngineSetting,
    allowed_settings,
    engine_config,
    is_engine_setting,
)

__all__ = ["ENGINES", "EngineSetting", "allowed_settings", "engine_config", "is_engine_setting"]
