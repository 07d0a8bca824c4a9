"""The uniform integer layout (``kvlens.quant.QuantSpec``) as a ``Layout``: its streaming rules,
reference, store (``kvlens.layouts.packed.PackedTensor``) and bytes.

Rules: a per-token spec quantizes each token on its own (``F = 1`` without a window, else the
window); a per-channel or per-tensor spec groups tokens, so it needs a window, its group must
divide ``F``, and ``F`` must be a whole number of packing units when codes are packed along
tokens (per-channel); a per-token group must divide head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.errors import ConfigError
from kvlens.layouts.packed import SCALE_BYTES, PackedTensor
from kvlens.layouts.protocol import SpecLayout, register
from kvlens.quant import QuantSpec, fake_quantize, packed_length
from kvlens.quant.packing import pack_unit


@dataclass(frozen=True)
class Uniform(SpecLayout):
    """``QuantSpec`` ``spec`` as a ``kvlens.layouts.Layout``."""

    spec: QuantSpec
    kind = "uniform"

    def flush_block(self, residual_tokens: int, flush_tokens: int = 0) -> int:
        if flush_tokens:
            return flush_tokens
        if self.spec.granularity == "per-token":
            return residual_tokens if residual_tokens else 1
        if residual_tokens < 1:
            raise ConfigError(f"{self.spec.granularity} quantization groups tokens, so it needs "
                              "a residual window (residual_tokens > 0, a multiple of the group "
                              f"size); got residual_tokens={residual_tokens}.")
        return residual_tokens

    def check(self, residual_tokens: int, head_dim: int, what: str = "",
              flush_tokens: int = 0) -> None:
        spec, where = self.spec, f"{what}: " if what else ""
        spec.check_group(head_dim, where)
        f = self.flush_block(residual_tokens, flush_tokens)
        block = f"flush_tokens {f}" if flush_tokens else f"residual window {residual_tokens}"
        if spec.granularity != "per-channel":
            return
        g = spec.group_size or f
        if f % g:
            raise ConfigError(f"{where}per-channel group size {g} must divide the {block} "
                              f"(tokens are quantized {f} at a time); use a multiple of {g}.")
        u, w = pack_unit(spec.bits)
        if f % u:
            raise ConfigError(f"{where}the {block} must be a multiple of {u} for "
                              f"{spec.bits}-bit codes packed along tokens ({u} codes share "
                              f"{w} byte{'s' if w > 1 else ''}).")

    def reconstruct(self, x, block: int, scale_dtype: str = "float16"):
        """``fake_quantize`` with each group's scale and zero as the store keeps them. Groups
        along tokens start at token 0, so they fall inside blocks; a per-tensor spec takes one
        scale per block."""
        b, h, t, d = x.shape
        per_block = self.spec.granularity == "per-tensor" and t > block
        if per_block:
            if t % block:
                raise ValueError(f"per-tensor reconstruct needs whole blocks of {block}, got {t}")
            x = x.reshape(b, h, t // block, block, d).transpose(1, 2).reshape(-1, h, block, d)
        out = fake_quantize(x.float(), self.spec, scale_dtype)
        if per_block:
            out = out.reshape(b, t // block, h, block, d).transpose(1, 2).reshape(b, h, t, d)
        return out

    def new_store(self, head_dim: int, block: int, scale_dtype: str = "float16"):
        return PackedTensor.create(self.spec, block, head_dim, scale_dtype, flush_tokens=block)

    def part_bytes(self, tokens: int, head_dim: int, block: int,
                   scale_dtype: str = "float16") -> dict[str, int]:
        """``kvlens.layouts.packed``'s layout: dense codes in whole packing units, whole scale
        groups, a stored zero for every group (symmetric specs too)."""
        spec = self.spec
        if tokens == 0:
            return {}
        if spec.granularity == "per-channel":
            codes = packed_length(tokens, spec.bits) * head_dim  # tokens: whole units
        else:
            codes = tokens * packed_length(head_dim, spec.bits)
        bt, bd = spec.block_shape(block, head_dim)
        groups = tokens // block * -(-block // bt) * (head_dim // bd)
        meta = groups * SCALE_BYTES[scale_dtype]
        return {"codes": codes, "scales": meta, "zeros": meta}


register(QuantSpec, Uniform.kind, QuantSpec.from_dict, Uniform)
