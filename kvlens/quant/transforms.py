"""Transforms around the quantizer: pre-RoPE keys (KVQuant), the MiKV channel balancer and
dense-and-sparse outliers (KVQuant); every quantization goes through ``kvlens.quant.reference``.
Tensors are ``[B, H, T, D]`` unless stated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError, InputError
from kvlens.quant.meta8 import fake_quantize
from kvlens.quant.rotation import quantize_rotated, quantizer
from kvlens.quant.spec import QuantSpec
from kvlens.rope import LAYOUTS, RopeFrequencies, apply_rope

# -- pre-RoPE keys ------------------------------------------------------------------------


def rope_tables_for(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
                    rotary_dim: int | None = None, layout: str = "half"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (Llama-style, unscaled) RoPE ``cos, sin`` tables ``[B, T, R]`` for ``positions``
    ``[T]`` (``B = 1``) or ``[B, T]``, ``R = rotary_dim`` (even, default ``head_dim``):
    ``inv_freq[i] = theta^(-2i/R)``, angles repeated ``[f, f]`` (``"half"``) or ``[f0, f0, f1, f1,
    ...]`` (``"interleaved"``), in float32 as transformers' default rotary embedding."""
    r = head_dim if rotary_dim is None else rotary_dim
    if r < 2 or r % 2 or r > head_dim:
        raise ConfigError(f"Invalid rotary_dim {r}; allowed: an even number from 2 to head_dim "
                          f"{head_dim}.")
    if layout not in LAYOUTS:
        raise ConfigError(f"Unknown RoPE layout {layout!r}; allowed: {', '.join(LAYOUTS)}.")
    pos = positions if positions.dim() == 2 else positions.unsqueeze(0)
    exponents = torch.arange(0, r, 2, dtype=torch.int64, device=pos.device).float() / r
    return RopeFrequencies(1.0 / theta**exponents, 1.0, layout).tables(pos)


def quantize_pre_rope(k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec,
                      layout: str = "half", rotation: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """KVQuant-style keys: quantize ``k_pre`` (before RoPE), dequantize, then apply RoPE with the
    layer's ``[B, T, R]`` tables: the post-RoPE key the model would see, float32. With ``rotation``
    the stored form is ``k_pre R``, un-rotated before RoPE (they do not commute). ``spec``: a
    ``QuantSpec`` or a function ``x -> x_hat`` (a layout's reference)."""
    if rotation is None:
        hat = quantizer(spec)(k_pre.float())
    else:
        hat = quantize_rotated(k_pre, spec, rotation)
    return apply_rope(hat, cos, sin, layout)


# -- MiKV channel balancer ----------------------------------------------------------------


def fit_balancer(q: torch.Tensor, k: torch.Tensor, exponent: float = 0.5,
                 per_sample: bool = False) -> torch.Tensor:
    """MiKV balancer ``b = (max|q_c| / max|k_c|)^exponent`` per KV head and channel.

    q: ``[B, Hq, T, D]``, k: ``[B, Hkv, T, D]``; a KV head's query maximum runs over its GQA
    query heads (``repeat_kv``) and the tokens, and over the batch (``[Hkv, D]``) unless
    ``per_sample`` (MiKV's per-prompt ``[B, Hkv, D]``). A channel with a zero or non-finite
    maximum gets ``b = 1``."""
    groups = _gqa_groups(q, k)
    b, hkv, _, d = k.shape
    q_max = q.detach().float().abs().amax(dim=2).reshape(b, hkv, groups, d).amax(dim=2)
    k_max = k.detach().float().abs().amax(dim=2)
    if not per_sample:
        q_max, k_max = q_max.amax(dim=0), k_max.amax(dim=0)
    ratio = q_max / k_max
    usable = (q_max > 0) & (k_max > 0) & torch.isfinite(ratio)
    return torch.where(usable, ratio, torch.ones_like(ratio)).pow(exponent)


def apply_balancer(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q / b, k * b)`` with ``b`` from ``fit_balancer`` (``[Hkv, D]`` or ``[B, Hkv, D]``),
    expanded to the query heads by the GQA mapping; every ``q_h . k_{h // groups}`` is
    unchanged. Returned in float32."""
    groups = _gqa_groups(q, k)
    bk = b.float().unsqueeze(-2)  # [..., Hkv, 1, D] broadcasts over tokens
    bq = bk.repeat_interleave(groups, dim=-3)
    return q.float() / bq, k.float() * bk


def _gqa_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise InputError(f"Expected q [B, Hq, T, D] and k [B, Hkv, T, D], got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}.")
    if q.shape[1] % k.shape[1]:
        raise InputError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads.")
    return q.shape[1] // k.shape[1]


# -- dense-and-sparse outliers ------------------------------------------------------------

@dataclass(frozen=True)
class SparseOutliers:
    """Full-precision outliers kept beside a quantized tensor: int64 ``indices`` along ``dim``
    (ascending; ``x``'s shape with ``dim`` of size k) and their original ``values``."""

    indices: torch.Tensor
    values: torch.Tensor
    dim: int

    def scatter_into(self, dense: torch.Tensor) -> torch.Tensor:
        """``dense`` with the outlier positions *overwritten* by the stored values."""
        return dense.scatter(self.dim, self.indices, self.values.to(dense.dtype))


def outlier_count(length: int, fraction: float) -> int:
    """Outliers kept per vector of ``length``: ``ceil(fraction * length)`` (at least the asked
    fraction; rounded to 9 decimals first so 0.07 * 100 gives 7, not 8)."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"Invalid outlier fraction {fraction!r}; allowed: 0 <= fraction < 1 "
                          "(e.g. 0.01 for 1%).")
    return math.ceil(round(fraction * length, 9))


def split_outliers(x: torch.Tensor, fraction: float, dim: int = -1
                   ) -> tuple[torch.Tensor, SparseOutliers]:
    """Keep the ``outlier_count(n, fraction)`` largest-magnitude entries of every vector along
    ``dim`` (``-1``: each token's channels; ``-2``: each channel's tokens) in full precision.

    Returns ``(dense, outliers)``: ``dense`` is ``x`` with those entries set to zero, so they no
    longer stretch the quantization range; ``outliers.scatter_into`` puts them back."""
    dim = dim % x.dim()
    k = outlier_count(x.shape[dim], fraction)
    if k == 0:
        empty = x.new_zeros(*x.shape[:dim], 0, *x.shape[dim + 1 :])
        return x, SparseOutliers(empty.long(), empty, dim)
    idx = x.abs().topk(k, dim=dim).indices.sort(dim=dim).values
    values = x.gather(dim, idx)
    dense = x.scatter(dim, idx, torch.zeros_like(values))
    return dense, SparseOutliers(idx, values, dim)


def quantize_with_outliers(x: torch.Tensor, spec: QuantSpec, fraction: float) -> torch.Tensor:
    """Dense-and-sparse reconstruction ``[B, H, T, D]`` float32: outliers (``fraction`` of each
    vector ``spec`` groups along: a channel's tokens per-channel, else a token's channels)
    exact, the rest quantized with ``spec``. Outlier positions hold their exact values (not
    value + quantized zero)."""
    dim = -2 if spec.granularity == "per-channel" else -1
    dense, outliers = split_outliers(x.float(), fraction, dim)
    return outliers.scatter_into(fake_quantize(dense, spec))
