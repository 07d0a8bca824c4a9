"""SGLang's ``fp4_e2m1`` history (its newer name ``fp4_mx_block16``; semantics
``kvlens.quant.fp4.quantize_fp4_e2m1``) as a storage layout: per token and KV head, each block of
16 channels stores 16 E2M1 codes (8 bytes, part ``codes``) and one power-of-two scale byte
(``scales``), computed as the token is written: 4.5 bits per element, no per-tensor scale.
JSON: ``{"layout": "fp4_e2m1"}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.layouts.blockfloat import BlockFloatLayout
from kvlens.layouts.protocol import register
from kvlens.quant.fp4 import BLOCK, dequantize_fp4_e2m1, quantize_fp4_e2m1


@dataclass(frozen=True)
class Fp4E2M1(BlockFloatLayout):
    """The ``fp4_e2m1`` layout (module docstring); it has no parameters."""

    kind = "fp4_e2m1"
    label = f"FP4 E2M1 (power-of-two scale per {BLOCK} channels)"
    bits, block, codes_per_byte = 4, BLOCK, 2
    encode, decode = staticmethod(quantize_fp4_e2m1), staticmethod(dequantize_fp4_e2m1)


register(Fp4E2M1, Fp4E2M1.kind, Fp4E2M1.from_dict)
