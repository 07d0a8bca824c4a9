"""NVFP4 history: the 4-bit float KV cache of vLLM, SGLang and TensorRT-LLM (``nvfp4``) as a
block-float layout (semantics: ``kvlens.quant.fp4.quantize_nvfp4``): 4.5 bits per element. The
per-tensor ``global_scale`` is the spec's (the checkpoint's ``k_scale`` / ``v_scale``, which the
engines load as model parameters), so it is not part of the cache's held bytes. JSON:
``{"layout": "nvfp4", "global_scale": 1.0}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlens.errors import ConfigError
from kvlens.layouts.blockfloat import BlockFloatLayout
from kvlens.layouts.protocol import register
from kvlens.quant.fp4 import BLOCK, dequantize_nvfp4, quantize_nvfp4


@dataclass(frozen=True)
class NvFp4(BlockFloatLayout):
    """The NVFP4 layout (module docstring) with its per-tensor ``global_scale``."""

    global_scale: float = 1.0

    kind = "nvfp4"
    bits, block, codes_per_byte = 4, BLOCK, 2
    encode, decode = staticmethod(quantize_nvfp4), staticmethod(dequantize_nvfp4)

    def __post_init__(self) -> None:
        g = self.global_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                or g <= 0:
            raise ConfigError(f"Invalid nvfp4 global_scale {g!r}; allowed: a finite number "
                              "> 0 (the checkpoint's k_scale / v_scale; 1.0 without one).")
        object.__setattr__(self, "global_scale", float(g))

    @property
    def label(self) -> str:
        scale = "" if self.global_scale == 1.0 else f", global scale {self.global_scale:g}"
        return f"NVFP4 (E2M1, E4M3 scale per {BLOCK} channels{scale})"


register(NvFp4, NvFp4.kind, NvFp4.from_dict)
