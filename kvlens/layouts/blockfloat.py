"""What the block-float layouts share (NVFP4, SGLang's ``fp4_e2m1``, OCP MXFP8): each token's
``[D]`` vector of one head is cut into blocks of consecutive channels, each block stored as
element bytes (part ``codes``) and one scale byte (part ``scales``), computed as the token is
written. Every token is scaled on its own, so such a layout streams as a per-token layout (any
window; ``F = 1`` without one); the torch read path reads it back through
``BlockFloatStore.dequantize_range`` and the Triton decode kernel does not read it.

A layout subclasses ``BlockFloatLayout`` and says its ``block`` (channels per scale), its
``codes_per_byte`` (2 for 4-bit codes, 1 for 8-bit) and its ``encode`` / ``decode``
(``[..., D]`` float32 <-> ``(codes, scales)`` uint8, defined in ``kvlens.quant``); its dataclass
fields (NVFP4's ``global_scale``) are its JSON keys and reach ``encode`` / ``decode`` as
keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from kvlens.errors import ConfigError
from kvlens.layouts.protocol import FieldsLayout, TensorStore


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
