"""Analytic storage accounting: bits per element of one quantized ``[T, D]`` matrix.

A library formula for analysis (it also prices dense-and-sparse outliers and low-rank terms,
which the cache does not store); no command budgets with it. The bytes the compressed cache
really holds (whole packing units, the window buffer, sets, positions, sliding layers) are
described by ``kvlens.cache.layout``, which ``memory_report`` and ``recommend`` use.

Counted per ``[T, D]`` matrix of one (batch, head), so the result does not depend on ``B, H``;
partial groups are counted as whole groups (they still store a scale and a zero). With
``N = T_q * D`` quantized elements, where ``T_q = T - residual_tokens``::

    codes    = bits                      (codes are packed densely: kvlens.quant.packing)
    scales   = n_groups * scale_bits / N                     n_groups = spec.num_groups(T_q, D)
    zeros    = n_groups * zero_bits  / N                     (0 when symmetric: zero = -qmax*scale)
    outliers = k * (outlier_value_bits + outlier_index_bits) / n      per vector of length n,
               k = outlier_count(n, outlier_fraction)        (n = D per-token, T_q per-channel)
    lowrank  = lowrank_rank * (T_q + D) * lowrank_bits / N   (factors [T_q, r] and [r, D])

These are then weighted by the quantized share ``T_q / T``, and the full-precision residual
window adds ``residual = residual_tokens / T * residual_bits``. ``total`` is the sum: average
bits per cached element over the whole ``[T, D]`` matrix. Example: 2-bit per-channel ``G=32``
with fp16 scale and zero on ``T=128``: ``2 + 16/32 + 16/32 = 3.0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvlens.errors import ConfigError, is_int
from kvlens.quant.spec import QuantSpec
from kvlens.quant.transforms import default_outlier_scope, outlier_count, scope_dim


@dataclass(frozen=True)
class StorageBreakdown:
    """Average bits per cached element, by component (see the module docstring)."""

    codes: float
    scales: float
    zeros: float
    outliers: float
    lowrank: float
    residual: float

    @property
    def total(self) -> float:
        return self.codes + self.scales + self.zeros + self.outliers + self.lowrank + self.residual

    def compression_vs(self, reference_bits: float = 16.0) -> float:
        """How many times smaller than ``reference_bits`` per element (fp16 by default)."""
        return reference_bits / self.total

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def bits_per_element(
    spec: QuantSpec,
    shape: Sequence[int],
    *,
    scale_bits: int = 16,
    zero_bits: int = 16,
    outlier_fraction: float = 0.0,
    outlier_value_bits: int = 16,
    outlier_index_bits: int = 16,
    outlier_scope: str | None = None,
    lowrank_rank: int = 0,
    lowrank_bits: int = 16,
    residual_tokens: int = 0,
    residual_bits: int = 16,
) -> StorageBreakdown:
    """Exact storage of ``spec`` on a tensor of ``shape`` (``[B, H, T, D]`` or ``(T, D)``).

    outlier_scope: vectors the outlier fraction applies to (default: the quantizer's axis, as
        ``kvlens.quant.transforms.quantize_with_outliers`` does).
    residual_tokens: newest tokens kept in full precision (KIVI's window) at ``residual_bits``.
    """
    if len(shape) < 2:
        raise ConfigError(f"Expected a shape [B, H, T, D] or (T, D), got {tuple(shape)}.")
    t, d = int(shape[-2]), int(shape[-1])
    for name, value in (
        ("scale_bits", scale_bits),
        ("zero_bits", zero_bits),
        ("outlier_value_bits", outlier_value_bits),
        ("outlier_index_bits", outlier_index_bits),
        ("lowrank_bits", lowrank_bits),
        ("residual_bits", residual_bits),
        ("lowrank_rank", lowrank_rank),
        ("residual_tokens", residual_tokens),
    ):
        if not is_int(value, 0):
            raise ConfigError(f"Invalid {name} {value!r}; allowed: a non-negative integer.")
    if residual_tokens > t:
        raise ConfigError(
            f"residual_tokens {residual_tokens} exceeds the {t} tokens; allowed: 0-{t}."
        )
    t_q = t - residual_tokens
    residual = residual_tokens / t * residual_bits
    if t_q == 0:
        return StorageBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, residual)
    spec.check_fits((t_q, d))
    n = t_q * d
    groups = spec.num_groups(t_q, d)
    share = t_q / t
    codes = spec.bits
    scales = groups * scale_bits / n
    zeros = 0.0 if spec.symmetric else groups * zero_bits / n
    scope = outlier_scope or default_outlier_scope(spec)
    length = d if scope_dim(scope) == -1 else t_q
    outliers = (
        outlier_count(length, outlier_fraction) * (outlier_value_bits + outlier_index_bits) / length
    )
    lowrank = min(lowrank_rank, t_q, d) * (t_q + d) * lowrank_bits / n
    return StorageBreakdown(
        codes * share, scales * share, zeros * share, outliers * share, lowrank * share, residual
    )
