"""MiKV's importance set in the cache, a research set policy (``kvlens.cache.sets``) read from
the config key ``importance`` (``kvlens.config.extension``), with the ``mikv-*`` presets.

``heavy_fraction`` > 0: besides the first ``sink_tokens``, each global compressed layer keeps
``ceil(heavy_fraction * held)`` of its quantized tokens per KV head, those with the largest
accumulated attention (H2O), chosen again at every flush among the set and the flushed block;
the set's packed copies are masked (parts ``masks`` and ``accumulators``). ``set_bits`` 4 or 8
stores each set token as per-token integer codes (``set_spec``, float16 scale and zero per
group; ``set_bytes_per_token``), ``None`` at ``fp_dtype``. ``layers``: the compressed layers that
keep it (``None``: every one); the others keep the sinks alone (``KVConfig.protect_for``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from kvlens.cache.sets import SetPolicy, SetRows, first_positions, sinks_held
from kvlens.config import KVConfig, LayerKV, ProtectSettings
from kvlens.config.extension import register
from kvlens.config.presets import add_preset
from kvlens.errors import ConfigError, is_int
from kvlens.quant import (
    QTensor,
    QuantSpec,
    dequantize,
    pack_codes,
    packed_length,
    quantize,
    unpack_codes,
)

SET_BITS = (4, 8)  # integer widths of the importance set (None: fp_dtype)
SET_GROUP = 32
SCALE_DTYPE = torch.float16
#: why the fused decode kernel cannot serve a layer choosing heavy hitters
KERNEL_PROBLEM = ("MiKV heavy hitters: their selection needs attention probabilities, which the "
                  "kernel does not return (torch path)")


# -- the set's codes -------------------------------------------------------------------------------

def set_spec(bits: int, head_dim: int) -> QuantSpec:
    """How a set token is quantized: per-token, groups of 32 channels (or the head)."""
    return QuantSpec(bits, "per-token", SET_GROUP if head_dim % SET_GROUP == 0 else None)


def set_bytes_per_token(bits: int, head_dim: int) -> int:
    """Bytes one token of one tensor (key or value) of the set holds at ``bits``."""
    spec = set_spec(bits, head_dim)
    groups = head_dim // (spec.group_size or head_dim)
    return packed_length(head_dim, bits) + 2 * groups * SCALE_DTYPE.itemsize


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[B, H, K, D]`` -> ``(codes uint8 [B, H, K, ceil(D/P)], scale, zero float16
    [B, H, K, D/G])``: each row quantized on its own (so rows can be gathered later)."""
    q = quantize(x.float(), set_spec(bits, x.shape[-1]))
    return pack_codes(q.codes, bits, dim=3), q.scale.to(SCALE_DTYPE), q.zero.to(SCALE_DTYPE)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    head_dim: int) -> torch.Tensor:
    """Inverse of ``quantize_rows`` -> float32 ``[B, H, K, D]``."""
    spec = set_spec(bits, head_dim)
    c = unpack_codes(codes, bits, head_dim, dim=3)
    shape = (*c.shape[:3], head_dim)
    return dequantize(QTensor(c, scale.float(), zero.float(), spec, shape))


class CodedRows(SetRows):
    """Set rows stored as per-token ``bits``-bit codes: ``parts`` = (codes, scale, zero)."""

    def __init__(self, bits: int, head_dim: int):
        super().__init__(None, head_dim)
        self.bits = bits

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize_rows(x, self.bits)

    def read(self) -> torch.Tensor:
        return dequantize_rows(*self.parts, self.bits, self.head_dim)


# -- the policy ------------------------------------------------------------------------------------

class HeavyHitters(SetPolicy):
    """The cache's ``SetPolicy`` for an ``ImportanceSet``: the sinks plus ``ceil(f * held)``
    heavy hitters (``f`` = 0: the sinks alone, as a prefix), rows at ``set_bits``."""

    kernel_problem = KERNEL_PROBLEM

    def __init__(self, heavy_fraction: float, sink_tokens: int, set_bits: int | None):
        self.heavy_fraction = heavy_fraction
        self.sink_tokens = sink_tokens
        self.set_bits = set_bits
        self.masked = self.needs_attention_probs = heavy_fraction > 0
        self.acc: torch.Tensor | None = None  # [B, Hkv, N] accumulated attention (H2O)
        self.mask: torch.Tensor | None = None  # [B, Hkv, q_end] bool: the set's packed copies

    @property
    def empty(self) -> bool:
        return self.heavy_fraction + self.sink_tokens == 0

    def size(self, q_start: int, q_end: int) -> int:
        held = q_end - q_start
        if held == 0:
            return 0
        sinks = sinks_held(self.sink_tokens, q_start, q_end)
        return min(held, math.ceil(self.heavy_fraction * held) + sinks)

    def new_rows(self, dtype: torch.dtype | None, head_dim: int) -> SetRows:
        return SetRows(dtype, head_dim) if self.set_bits is None else \
            CodedRows(self.set_bits, head_dim)

    def row_bytes(self, head_dim: int, fp_bytes: int) -> int:
        return head_dim * fp_bytes if self.set_bits is None else \
            set_bytes_per_token(self.set_bits, head_dim)

    def observe(self, colsum: torch.Tensor) -> None:
        n = colsum.shape[-1]
        if self.acc is None or self.acc.shape[-1] < n:  # exactly the held positions
            acc = colsum.new_zeros(*colsum.shape[:2], n)
            if self.acc is not None:
                acc[..., :self.acc.shape[-1]] = self.acc
            self.acc = acc
        self.acc[..., :n] += colsum

    def choose(self, cand_pos: torch.Tensor, keep: int, end: int) -> torch.Tensor:
        if not self.masked:  # sinks: the first positions, no attention needed
            return first_positions(cand_pos, keep)
        b, h = cand_pos.shape[:2]
        acc = self.acc[..., :end] if self.acc is not None else \
            torch.zeros(b, h, end, device=cand_pos.device)
        score = acc.float().gather(-1, cand_pos.long())
        score = torch.where(cand_pos < self.sink_tokens, torch.inf, score)
        idx = score.topk(keep, dim=-1).indices
        self.mask = torch.zeros(b, h, end, dtype=torch.bool, device=cand_pos.device)
        self.mask.scatter_(-1, cand_pos.gather(-1, idx).long(), True)
        return idx

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(part, t) for part, t in (("masks", self.mask), ("accumulators", self.acc))
                if t is not None]

    def select_batch(self, index: torch.Tensor) -> None:
        self.acc = None if self.acc is None else self.acc[index]
        self.mask = None if self.mask is None else self.mask[index]

    def state_bytes(self, rows: int, q_held: int, held: int) -> dict[str, int]:
        if not self.masked:
            return {}
        return {"masks": rows * q_held, "accumulators": rows * held * 4}


# -- the settings ------------------------------------------------------------------------------------

@register
@dataclass(frozen=True)
class ImportanceSet:
    """MiKV's set settings (module docstring: what each field means)."""

    key: ClassVar[str] = "importance"

    heavy_fraction: float = 0.2
    set_bits: int | None = None  # None: the set is stored at fp_dtype; 4 or 8: integer codes
    layers: tuple[int, ...] | None = None  # None: every compressed layer keeps heavy hitters

    def __post_init__(self) -> None:
        f = self.heavy_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ConfigError(f"Invalid importance.heavy_fraction {f!r}; allowed: 0.0-1.0.")
        b = self.set_bits
        if b is not None and (isinstance(b, bool) or b not in SET_BITS):
            raise ConfigError(f"Unsupported importance.set_bits {b!r}; allowed: null (the set at "
                              f"fp_dtype), {', '.join(map(str, SET_BITS))}.")
        layers = self.layers
        if layers is not None:
            if not (isinstance(layers, (list, tuple)) and all(is_int(x, 0) for x in layers)) \
                    or len(set(layers)) != len(layers):
                raise ConfigError(f"Invalid importance.layers {layers!r}; allowed: null (every "
                                  "compressed layer) or a list of distinct layer indices >= 0.")
            object.__setattr__(self, "layers", tuple(sorted(layers)))
            if not f > 0:
                raise ConfigError("importance.layers lists the layers that keep heavy hitters, but "
                                  "importance.heavy_fraction is 0; allowed: null (every compressed "
                                  "layer) or a heavy_fraction > 0 with the list.")

    @classmethod
    def from_dict(cls, data: Any) -> ImportanceSet | None:
        """The ``importance`` object (``None``: a heavy fraction of 0 with nothing else asks
        for nothing)."""
        fields = ("heavy_fraction", "set_bits", "layers")
        if not isinstance(data, Mapping):
            raise ConfigError(f"'importance' must be an object with keys {', '.join(fields)}.")
        unknown = sorted(set(data) - set(fields), key=str)
        if unknown:
            raise ConfigError(f"importance: unknown keys {unknown}; allowed: "
                              f"{', '.join(fields)}.")
        if not data.get("heavy_fraction") and data.get("set_bits") is None \
                and data.get("layers") is None:
            return None
        return cls(**{"heavy_fraction": 0.0} | dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if k == "layers" else v for k, v in asdict(self).items()
                if v is not None}

    def applies_to(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def check_model(self, num_layers: int) -> None:
        bad = [i for i in (self.layers or ()) if i >= num_layers]
        if bad:
            raise ConfigError(f"importance.layers {bad}: the model has {num_layers} layers; "
                              f"allowed indices: 0-{num_layers - 1}.")

    def policy(self, sink_tokens: int) -> HeavyHitters:
        return HeavyHitters(self.heavy_fraction, sink_tokens, self.set_bits)


def mikv_settings(heavy_fraction: float = 0.2, sink_tokens: int = 4, balancer: str = "off",
                  balancer_exponent: float = 0.5, set_bits: int | None = None,
                  layers=None) -> ProtectSettings:
    """A ``protect`` section with MiKV's importance set (the sinks and balancer fields, then the
    set's); ``heavy_fraction`` 0 with no ``set_bits``: the sinks alone."""
    importance = ImportanceSet.from_dict({"heavy_fraction": heavy_fraction, "set_bits": set_bits,
                                          "layers": layers})
    return ProtectSettings(sink_tokens, balancer, balancer_exponent, importance)


# -- the presets -------------------------------------------------------------------------------------

def _mikv(bits: int, set_bits: int | None = None) -> KVConfig:
    """MiKV's preset: the set at full precision, or at ``set_bits`` (name ``-int<set_bits>``)."""
    held = "at full precision" if set_bits is None else f"stored at INT{set_bits} (per-token G32)"
    return KVConfig(f"mikv-{bits}" + (f"-int{set_bits}" if set_bits else ""),
                    LayerKV(QuantSpec(bits, "per-token", 32), QuantSpec(bits, "per-token", 32), 32),
                    protect=mikv_settings(0.2, 4, "online", set_bits=set_bits),
                    description=f"MiKV: 20% heavy-hitter + 4 sink tokens {held}, rest {bits}-bit "
                                "per-token G32 with an online channel balancer")


for _config in (_mikv(2), _mikv(4), _mikv(2, 4), _mikv(2, 8)):
    add_preset(_config)
