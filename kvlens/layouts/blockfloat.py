"""What the block-float layouts share (NVFP4, SGLang's ``fp4_e2m1``, OCP MXFP8): each token's
``[D]`` vector of one head is cut into blocks of consecutive channels, each block stored as
element bytes (part ``codes``) and one scale byte (part ``scales``), computed as the token is
written. Every token is scaled on its own, so such a layout streams as a per-token layout (any
window; ``F = 1`` without one); the torch read path reads it back through
``BlockFloatStore.dequantize_range`` and the Triton decode kernel does not read it.

A layout subclasses ``BlockFloatLayout`` and says its ``block`` (channels per scale), its
``codes_per_byte`` (2 for 4-bit codes, 1 for 8-bit) and its ``encode`` / ``decode``
(``[..., D]`` float32 <-> ``(codes, scales)`` uint8, defined in ``kvlens.quant``); one with
parameters overrides ``quantize`` / ``dequantize``, ``to_dict`` and ``from_dict``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlens.errors import ConfigError
from kvlens.layouts.dense import DenseTensor
from kvlens.layouts.protocol import LAYOUT_KEY


class BlockFloatLayout:
    """The streaming rules, reference, store and held bytes of a block-float layout (module
    docstring); subclasses are frozen dataclasses that set the class attributes below."""

    kind: str
    block: int  # channels sharing one scale byte
    codes_per_byte: int

    encode: Callable  # staticmethod: x -> (codes, scales)
    decode: Callable  # staticmethod: (codes, scales) -> x_hat

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(x)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self.decode(codes, scales)

    def to_dict(self) -> dict:
        return {LAYOUT_KEY: self.kind}

    @classmethod
    def from_dict(cls, data) -> BlockFloatLayout:
        """The JSON form of a layout without parameters: ``{"layout": kind}``."""
        extra = sorted(set(data) - {LAYOUT_KEY})
        if extra:
            raise ConfigError(f"Unknown {cls.kind} spec keys {extra}; allowed: {LAYOUT_KEY}.")
        return cls()

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        return flush_tokens or residual_tokens or 1

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
        self.check(0, head_dim)
        return BlockFloatStore(self.quantize, self.dequantize)

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        return {"codes": tokens * head_dim // self.codes_per_byte,
                "scales": tokens * head_dim // self.block}


class BlockFloatStore:
    """Block-float history ``[B, H, length, D]``: element bytes ``codes`` ``[B, H, N, D /
    codes_per_byte]`` and scale bytes ``scales`` ``[B, H, N, D / block]``, each a uint8
    ``DenseTensor`` holding exactly what is held."""

    def __init__(self, quantize: Callable, dequantize: Callable):
        self.quantize, self.dequantize = quantize, dequantize
        self.codes = DenseTensor(torch.uint8, "codes")
        self.scales = DenseTensor(torch.uint8, "scales")

    @property
    def length(self) -> int:
        return self.codes.length

    def append(self, x: torch.Tensor) -> None:
        codes, scales = self.quantize(x)
        self.codes.append(codes)
        self.scales.append(scales)

    def drop_front(self, n: int) -> None:
        self.codes.drop_front(n)
        self.scales.drop_front(n)

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        return self.dequantize(self.codes.view(t0, t1), self.scales.view(t0, t1))

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return self.codes.named_tensors() | self.scales.named_tensors()

    def select_batch(self, index: torch.Tensor) -> None:
        self.codes.select_batch(index)
        self.scales.select_batch(index)
