"""Layout rules a config must satisfy before a cache can store it: how many tokens are quantized
together (``flush_block``) and whether a spec fits a head (``check_layout``). The cache
(``kvlens.cache.packed``, ``kvlens.cache.codebook``) streams by these rules; configs are
validated with them before any model loads.

A codebook spec (``kvlens.quant.codebook.CodebookSpec``) codes each vector on its own (one norm
per vector, codes along channels): it streams as a per-token spec and fits any window."""

from __future__ import annotations

from kvlens.errors import ConfigError
from kvlens.quant.codebook import CodebookSpec
from kvlens.quant.packing import pack_unit
from kvlens.quant.spec import QuantSpec


def flush_block(spec: QuantSpec | CodebookSpec, residual_tokens: int,
                flush_tokens: int = 0) -> int:
    """``F``: tokens quantized together as one block (see the module docstring):
    ``flush_tokens`` when set (a sliding window), else the whole window."""
    if flush_tokens:
        return flush_tokens
    if isinstance(spec, CodebookSpec) or spec.granularity == "per-token":
        return residual_tokens if residual_tokens else 1
    if residual_tokens < 1:
        raise ConfigError(f"{spec.granularity} quantization groups tokens, so it needs a "
                          f"residual window (residual_tokens > 0, a multiple of the group size); "
                          f"got residual_tokens={residual_tokens}.")
    return residual_tokens


def check_layout(spec: QuantSpec | CodebookSpec, residual_tokens: int,
                 head_dim: int, what: str = "", flush_tokens: int = 0) -> None:
    """Raise ``ConfigError`` unless ``spec`` can be stored in this layout for ``head_dim``."""
    where = f"{what}: " if what else ""
    if isinstance(spec, CodebookSpec):  # per vector: any window (its rotation is the layer's
        return  # key rotation, checked with the others by validate_for)
    if spec.granularity == "per-token" and spec.group_size and head_dim % spec.group_size:
        allowed = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
        raise ConfigError(f"{where}group size {spec.group_size} does not divide head_dim "
                          f"{head_dim}; allowed group sizes: {', '.join(map(str, allowed))}.")
    f = flush_block(spec, residual_tokens, flush_tokens)
    block = f"flush_tokens {f}" if flush_tokens else f"residual window {residual_tokens}"
    if spec.granularity == "per-channel":
        g = spec.group_size or f
        if f % g:
            raise ConfigError(f"{where}per-channel group size {g} must divide the {block} "
                              f"(tokens are quantized {f} at a time); use a multiple of {g}.")
        u, w = pack_unit(spec.bits)
        if f % u:
            raise ConfigError(f"{where}the {block} must be a multiple of {u} for "
                              f"{spec.bits}-bit codes packed along tokens ({u} codes share "
                              f"{w} byte{'s' if w > 1 else ''}).")
