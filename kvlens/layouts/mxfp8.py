"""MXFP8 history: OCP MXFP8 (E4M3 elements, an E8M0 scale per 32 channels; semantics
``kvlens.quant.mxfp8``), SGLang's ``--kv-cache-dtype mxfp8``, as a storage layout.

Bytes per token and head: ``D`` element bytes (part ``codes``) and ``D / 32`` scale bytes
(``scales``): 8.25 bits per element. JSON: ``{"layout": "mxfp8"}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.layouts.blockfloat import BlockFloatLayout
from kvlens.layouts.protocol import register
from kvlens.quant.mxfp8 import BLOCK, dequantize_mxfp8, quantize_mxfp8


@dataclass(frozen=True)
class MxFp8(BlockFloatLayout):
    """The MXFP8 layout (module docstring); it has no parameters."""

    kind = "mxfp8"
    label = f"MXFP8 (E4M3, E8M0 scale per {BLOCK} channels)"
    bits, block, codes_per_byte = 8, BLOCK, 1
    encode, decode = staticmethod(quantize_mxfp8), staticmethod(dequantize_mxfp8)


register(MxFp8, MxFp8.kind, MxFp8.from_dict)
