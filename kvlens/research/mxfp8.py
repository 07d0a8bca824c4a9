"""MXFP8: the OCP Microscaling E4M3 format (OCP MX specification v1.0, 2023, sections 5.3 and
6.3) as a storage layout. (SGLang offers an ``mxfp8`` KV-cache type; whether its scale rule and
rounding are these is not checked here: issue #58.)

Each token's ``[D]`` vector of one head is cut into blocks of ``K = 32`` channels. A block stores
a shared scale ``X = 2^e`` as an E8M0 byte (``e + 127``) and 32 E4M3 elements: ``e =
floor(log2(max_i |V_i|)) - 8`` (E4M3's largest normal exponent), clamped to ``[-127, 127]`` (an
all-zero block takes ``-127``); each ``V_i / X`` is rounded to the nearest E4M3 value, ties to
even, and beyond 448 saturates to +-448 (the specification leaves it to the implementation;
saturating never stores NaN). Each token is scaled on its own, so it streams as a per-token
layout; bytes per token and head: ``D`` codes and ``D / 32`` scales. The Triton decode kernel
does not read it.

Research (not a default, not yet checked against an engine): it registers into
``kvlens.layouts.protocol`` when ``kvlens.research`` is imported; nothing stable names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import ConfigError
from kvlens.layouts.protocol import LAYOUT_KEY, register

BLOCK = 32  # channels sharing one E8M0 scale (the MX block size K)
E4M3_EMAX = 8  # exponent of E4M3's largest normal value, 1.75 * 2^8 = 448
E4M3_MAX = 448.0
E8M0_BIAS = 127


def mx_exponents(x: torch.Tensor) -> torch.Tensor:
    """The shared exponent ``e`` per block of ``BLOCK`` channels: ``[..., D]`` float32 ->
    ``[..., D / BLOCK]`` int32."""
    amax = x.unflatten(-1, (-1, BLOCK)).abs().amax(-1)
    e = torch.floor(torch.log2(amax)) - E4M3_EMAX  # log2(0) = -inf: clamped to -127
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(elements, scale bytes)`` of ``x`` ``[..., D]``: E4M3 bytes ``[..., D]`` (uint8) and
    E8M0 bytes ``[..., D / BLOCK]`` (uint8)."""
    x = x.float()
    e = mx_exponents(x)
    scaled = x.unflatten(-1, (-1, BLOCK)) * torch.exp2(-e.float())[..., None]
    p = scaled.clamp(-E4M3_MAX, E4M3_MAX).flatten(-2).to(torch.float8_e4m3fn)
    return p.view(torch.uint8), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``X * P`` from the stored bytes (``quantize_mxfp8``'s)."""
    p = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, BLOCK))
    x = torch.exp2(scales.float() - E8M0_BIAS)[..., None]
    return (p * x).flatten(-2)


@dataclass(frozen=True)
class MxFp8:
    """The MXFP8 layout (module docstring); it has no parameters."""

    kind = "mxfp8"
    bits = 8
    label = "MXFP8 (E4M3, E8M0 scale per 32 channels)"

    def to_dict(self) -> dict[str, Any]:
        return {LAYOUT_KEY: self.kind}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MxFp8:
        extra = sorted(set(data) - {LAYOUT_KEY})
        if extra:
            raise ConfigError(f"Unknown mxfp8 spec keys {extra}; allowed: {LAYOUT_KEY}.")
        return cls()

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        return flush_tokens or residual_tokens or 1

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        if head_dim % BLOCK:
            where = f"{what}: " if what else ""
            raise ConfigError(f"{where}mxfp8 shares a scale among {BLOCK} channels, so head_dim "
                              f"must be a multiple of {BLOCK}; got {head_dim}. Use a uniform "
                              "spec for this model.")

    def reconstruct(self, x: torch.Tensor, block: int, scale_dtype: str = "float16"
                    ) -> torch.Tensor:
        self.check(0, x.shape[-1])
        return dequantize_mxfp8(*quantize_mxfp8(x))

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16") -> MxFp8Store:
        self.check(0, head_dim)
        return MxFp8Store(block)

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        return {"codes": tokens * head_dim, "scales": tokens * head_dim // BLOCK}


class MxFp8Store:
    """MXFP8 history ``[B, H, length, D]``: element bytes ``codes`` ``[B, H, N, D]`` and scale
    bytes ``scales`` ``[B, H, N, D / 32]`` (uint8), grown and shrunk to exactly what is held."""

    def __init__(self, block: int = 1):
        self.block = block
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def append(self, x: torch.Tensor) -> None:
        codes, scales = quantize_mxfp8(x)
        if self.codes is None:
            self.codes, self.scales = codes, scales
        else:
            self.codes = torch.cat((self.codes, codes), dim=2)
            self.scales = torch.cat((self.scales, scales), dim=2)

    def drop_front(self, n: int) -> None:
        if n:
            self.codes = self.codes[:, :, n:].clone()
            self.scales = self.scales[:, :, n:].clone()

    def dequantize_range(self, t0: int, t1: int) -> torch.Tensor:
        return dequantize_mxfp8(self.codes[:, :, t0:t1], self.scales[:, :, t0:t1])

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.codes is None else {"codes": self.codes, "scales": self.scales}

    def select_batch(self, index: torch.Tensor) -> None:
        if self.codes is not None:
            self.codes, self.scales = self.codes[index], self.scales[index]


register(MxFp8, MxFp8.kind, MxFp8.from_dict)
