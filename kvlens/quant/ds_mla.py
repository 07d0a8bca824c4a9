"""vLLM's ``fp8_ds_mla`` KV-cache format (its sparse MLA backends: FlashMLA, DeepSeek V3.2), the one
place its quantize/dequantize semantics live (plain torch; rows ``[..., D]``; the format and its
sources: docs/engine-formats.md).

Per token, as vLLM's ``concat_and_cache_ds_mla_kernel`` writes it: the row rounded to bfloat16;
the latent in tiles of ``TILE`` channels, each with a float32 scale ``s = max(amax(|x|) / 448,
FLT_MIN)`` and fp8 e4m3 codes ``fp8(x / s)`` (saturating, round-to-nearest-even); the RoPE
channels kept as bfloat16. Read back: ``bf16(code * s)``. kvlens's latent row is ``[k_pe ; c]``
(``kvlens.model.mla``), so the leading ``D mod TILE`` channels are the RoPE part. vLLM's
``[codes][scales][rope]`` bytes are held as three tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError

TILE = 128  # latent channels sharing one scale
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # the kernel's scale divisor
FLT_MIN = float(torch.finfo(torch.float32).tiny)  # the smallest scale the kernel stores
SCALE_BYTES = 4  # float32 scales
ROPE_BYTES = 2  # bfloat16 RoPE channels


@dataclass(frozen=True)
class DsMlaFormat:
    """vLLM's ``fp8_ds_mla`` (module docstring): meaningful only for an MLA model's latent row,
    which the model check (``kvlens.config.model_check``) makes sure of."""

    family = "ds-mla"
    name = "fp8_ds_mla"
    code_bits = 8

    @property
    def shares_scale(self) -> str:
        return (f"{TILE} latent channels of one token (dynamic float32 scale); the RoPE channels "
                "are kept in bfloat16")

    def split(self, head_dim: int) -> tuple[int, int]:
        """``(rope, latent)`` channels of a row of ``head_dim``: the leading ``head_dim % TILE``
        and the rest; ``ConfigError`` unless the latent is a positive multiple of ``TILE``."""
        rope = head_dim % TILE
        if head_dim < TILE:
            raise ConfigError(
                f"fp8_ds_mla needs an MLA latent row of RoPE channels (fewer than {TILE}) then a "
                f"latent of a positive multiple of {TILE} channels (vLLM runs 64 + 512); a row "
                f"of {head_dim} channels has no latent tile.")
        return rope, head_dim - rope

    def check_fits(self, shape: Sequence[int]) -> None:
        self.split(int(shape[-1]))

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one token's row holds: fp8 codes, a float32 scale per tile, bf16 RoPE."""
        rope, latent = self.split(head_dim)
        return latent + SCALE_BYTES * (latent // TILE) + ROPE_BYTES * rope

    def bits_per_element(self, shape: Sequence[int]) -> float:
        d = int(shape[-1])
        return 8 * self.row_bytes(d) / d


DS_MLA = DsMlaFormat()


def quantize_ds_mla(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[..., D]`` (any float dtype) -> what vLLM's kernel writes for them, ``(codes,
    scales, rope)``: uint8 fp8-e4m3 bit patterns ``[..., latent]``, float32 ``[..., latent /
    TILE]``, bfloat16 ``[..., rope]``."""
    rope_dim, latent = DS_MLA.split(x.shape[-1])
    lead = tuple(x.shape[:-1])
    row = x.detach().to(torch.bfloat16)  # the kernel's input dtype
    tiles = row[..., rope_dim:].float().reshape(*lead, latent // TILE, TILE)
    # float32 division, then the kernel's floor (an all-zero tile gets FLT_MIN, codes 0)
    scales = torch.clamp_min(tiles.abs().amax(dim=-1) / FP8_MAX, FLT_MIN)
    codes = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(*lead, latent), scales, row[..., :rope_dim].contiguous()


def dequantize_ds_mla(codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor
                      ) -> torch.Tensor:
    """float32 ``[..., D]`` of ``quantize_ds_mla``'s rows: the RoPE channels as stored, then
    ``bf16(code * scale)``."""
    lead = tuple(codes.shape[:-1])
    n = scales.shape[-1]
    latent = codes.view(torch.float8_e4m3fn).float().reshape(*lead, n, TILE)
    latent = (latent * scales[..., None]).to(torch.bfloat16).float()
    return torch.cat((rope.float(), latent.reshape(*lead, n * TILE)), dim=-1)
