"""``fake_quantize``: what a consumer of the cache reads back for a tensor under one ``QuantSpec``,
with the group metadata stored in float32 (``kvlens.quant.reference``) or in 8 bits
(``kvlens.quant.meta8``). Analysis, recommend and the transforms call this one function."""

from __future__ import annotations

import torch

from kvlens.quant.meta8 import fake_quantize_meta8
from kvlens.quant.reference import dequantize, quantize
from kvlens.quant.spec import QuantSpec


def fake_quantize(x: torch.Tensor, spec: QuantSpec, scale_dtype: str = "float32"
                  ) -> torch.Tensor:
    """``dequantize(quantize(x, spec))`` in ``x``'s dtype, with 8-bit group metadata when
    ``scale_dtype="8bit"``, else the float32 scales and zeros."""
    if scale_dtype == "8bit":
        return fake_quantize_meta8(x, spec)
    return dequantize(quantize(x, spec), dtype=x.dtype)
