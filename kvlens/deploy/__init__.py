"""Deploy targets: engine settings (llama.cpp, vLLM, SGLang, TensorRT-LLM, transformers) as
kvlens configs (``presets``; the names themselves are ``kvlens.config.engine``'s) and the
recommendation of what to deploy on each engine (``targets``)."""

from kvlens.deploy.presets import EngineSetting, engine_config

__all__ = ["EngineSetting", "engine_config"]
