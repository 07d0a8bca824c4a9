"""The engines' block-float layouts and what they share: each token's ``[D]`` vector of one
head is cut into blocks of consecutive channels, each block stored as element bytes (part
``codes``) and one scale byte (part ``scales``), computed as the token is written. Every token
is scaled on its own, so such a layout streams as a per-token layout (any window; ``F = 1``
without one); the torch read path reads it back through ``BlockFloatStore.dequantize_range`` and
the Triton decode kernel does not read it.

- ``NvFp4`` (``{"layout": "nvfp4", "global_scale": 1.0}``): the 4-bit float cache of vLLM,
  SGLang and TensorRT-LLM (``kvlens.quant.fp4.quantize_nvfp4``), 4.5 bits per element. Its
  per-tensor ``global_scale`` is the spec's (the checkpoint's ``k_scale`` / ``v_scale``, which
  the engines load as model parameters), so it is not part of the cache's held bytes.
- ``Fp4E2M1`` (``{"layout": "fp4_e2m1"}``): SGLang's ``fp4_e2m1`` (its newer name
  ``fp4_mx_block16``; ``kvlens.quant.fp4.quantize_fp4_e2m1``), a power-of-two scale per 16
  channels: 4.5 bits per element, no per-tensor scale.
- ``MxFp8`` (``{"layout": "mxfp8"}``): OCP MXFP8, SGLang's ``--kv-cache-dtype mxfp8``
  (``kvlens.quant.mxfp8``), E4M3 elements and an E8M0 scale per 32 channels: 8.25 bits.

A layout subclasses ``BlockFloatLayout`` and says its ``block`` (channels per scale), its
``codes_per_byte`` (2 for 4-bit codes, 1 for 8-bit) and its ``encode`` / ``decode``
(``[..., D]`` float32 <-> ``(codes, scales)`` uint8, defined in ``kvlens.quant``); its dataclass
fields (NVFP4's ``global_scale``) are its JSON keys and reach ``encode`` / ``decode`` as
keywords.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvlens.errors import ConfigError
from kvlens.layouts.protocol import FieldsLayout, TensorStore, register
from kvlens.quant import fp4, mxfp8


class BlockFloatLayout(FieldsLayout):
    """The reference, store and held bytes of a block-float layout (module docstring);
    subclasses are frozen dataclasses that set the class attributes below."""

    kind: str
    block: int  # channels sharing one scale byte
    codes_per_byte: int

    encode: Callable  # staticmethod: (x, **fields) -> (codes, scales)
    decode: Callable  # staticmethod: (codes, scales, **fields) -> x_hat

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(x, **asdict(self))

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self.decode(codes, scales, **asdict(self))

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        if head_dim % self.block:
            where = f"{what}: " if what else ""
            raise ConfigError(f"{where}{self.kind} shares a scale among {self.block} channels, "
                              f"so head_dim must be a multiple of {self.block}; got {head_dim}. "
                              "Use a uniform spec for this model.")

    def reconstruct(self, x: torch.Tensor, block: int, scale_dtype: str = "float16"
                    ) -> torch.Tensor:
        self.check(0, x.shape[-1])
        return self.dequantize(*self.quantize(x))

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16"
                  ) -> BlockFloatStore:
        return BlockFloatStore(self)

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        return {"codes": tokens * head_dim // self.codes_per_byte,
                "scales": tokens * head_dim // self.block}


class BlockFloatStore(TensorStore):
    """Block-float history ``[B, H, length, D]``: element bytes ``codes`` ``[B, H, N, D /
    codes_per_byte]`` and scale bytes ``scales`` ``[B, H, N, D / block]``, uint8."""

    BUFFERS = {"codes": "codes", "scales": "scales"}

    def __init__(self, layout: BlockFloatLayout):
        self.layout = layout
        self.codes = self.scales = None

    def append(self, x: torch.Tensor) -> None:
        self.extend(*self.layout.quantize(x))

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        return self.layout.dequantize(self.codes[:, :, t0:t1], self.scales[:, :, t0:t1])


@dataclass(frozen=True)
class NvFp4(BlockFloatLayout):
    """The NVFP4 layout (module docstring) with its per-tensor ``global_scale``."""

    global_scale: float = 1.0

    kind = "nvfp4"
    bits, block, codes_per_byte = 4, fp4.BLOCK, 2
    encode, decode = staticmethod(fp4.quantize_nvfp4), staticmethod(fp4.dequantize_nvfp4)

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
        return f"NVFP4 (E2M1, E4M3 scale per {fp4.BLOCK} channels{scale})"


@dataclass(frozen=True)
class Fp4E2M1(BlockFloatLayout):
    """SGLang's ``fp4_e2m1`` layout (module docstring); it has no parameters."""

    kind = "fp4_e2m1"
    label = f"FP4 E2M1 (power-of-two scale per {fp4.BLOCK} channels)"
    bits, block, codes_per_byte = 4, fp4.BLOCK, 2
    encode, decode = staticmethod(fp4.quantize_fp4_e2m1), staticmethod(fp4.dequantize_fp4_e2m1)


@dataclass(frozen=True)
class MxFp8(BlockFloatLayout):
    """The MXFP8 layout (module docstring); it has no parameters."""

    kind = "mxfp8"
    label = f"MXFP8 (E4M3, E8M0 scale per {mxfp8.BLOCK} channels)"
    bits, block, codes_per_byte = 8, mxfp8.BLOCK, 1
    encode, decode = staticmethod(mxfp8.quantize_mxfp8), staticmethod(mxfp8.dequantize_mxfp8)


for _layout in (NvFp4, Fp4E2M1, MxFp8):
    register(_layout, _layout.kind, _layout.from_dict)
