"""The vLLM / SGLang KV-cache formats with float32 scales: static-scale fp8 and the dynamic
per-token-head formats; the one place their quantize/dequantize semantics live (plain torch;
tensors are ``[B, H, T, D]``).

- ``FP8Format`` with a *static* scale (vLLM/SGLang ``--kv-cache-dtype fp8_e4m3/fp8_e5m2``):
  ``x_hat = fp8(clamp(x / s, +-fp8_max)) * s`` with one float32 ``s`` per layer and tensor
  (``scope="tensor"``) or per KV head (``scope="head"``), calibrated from captured data by
  ``calibrate_scale``: ``s = absmax / fp8_max`` or ``s = percentile_p(|x|) / fp8_max``
  (values beyond it saturate, as the engines' saturating casts do), or a fixed ``s``
  (``fp8_e4m3:s1`` is vLLM's default scale 1.0 when the checkpoint carries none).
  ``rounding``: how a value becomes fp8. ``"nearest"`` (ties to even) is torch's cast and the
  GPU writers' (vLLM's ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)``). ``"truncate"``
  (names ``...:trunc``) is vLLM's CPU writer (``float_to_fp8e4m3_scalar`` /
  ``float_to_fp8e5m2_scalar``, ``csrc/cpu/cpu_attn_fp8.hpp`` @0f25e05): ``v = x * (1/s)``
  with the reciprocal in float32 (``cpu_attn.cpp`` @0a2c686), clamped to ``+-fp8_max``, then
  the mantissa bits fp8 cannot hold dropped: toward zero, a nonzero value that truncates to
  zero keeping its sign. Below e4m3's normal range the writer's ``v * 2^-120`` lands among
  float32 subnormals and rounds to nearest there (at ``2^-29`` in ``v``'s units) before the
  truncation; e5m2 reads ``v``'s own bits (``truncate_fp8``).
- ``TokenHeadFormat`` (vLLM's per-token-head int8/int4/fp8): a *dynamic* scale per token and
  KV head (all ``D`` channels of one token of one head), ``s = absmax / qmax`` with
  ``qmax = 127`` (int8), ``7`` (int4) or ``448`` (fp8 e4m3). The integer variants are the
  reference's symmetric per-token grid (``kvlens.quant.reference``, ``QuantSpec(bits,
  "per-token", symmetric=True)``, round-half-to-even); scales are counted as float32. vLLM's
  ``int4_per_token_head`` is a different, non-uniform codebook format (sign + 8 magnitudes,
  fp16 scales per channel group) that kvlens does not reproduce: ``int4@token-head`` is a
  uniform int4 stand-in at the same granularity, not that format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlens.errors import ConfigError, InputError
from kvlens.quant.packing import pack_codes, unpack_codes
from kvlens.quant.reference import quantize
from kvlens.quant.spec import QuantSpec

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {k: float(torch.finfo(v).max) for k, v in FP8_DTYPES.items()}  # 448, 57344
STATIC_SCOPES = ("tensor", "head")
FP8_ROUNDINGS = ("nearest", "truncate")
SCALE_BITS = 32  # float32 scales for fp8 / per-token-head formats
TOKEN_HEAD_KINDS = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class FP8Format:
    """fp8 cache with a static float32 scale (module docstring): ``fp8`` ``"e4m3"`` (max 448)
    or ``"e5m2"`` (max 57344); ``scope`` ``"tensor"`` (one scale for one layer's keys, or
    values) or ``"head"`` (one per KV head); ``percentile`` ``None`` (absmax) or ``p`` in ``(0,
    100)``; ``fixed_scale`` instead of calibration (excludes ``percentile``); ``rounding``
    ``"nearest"`` or ``"truncate"``."""

    fp8: str = "e4m3"
    scope: str = "tensor"
    percentile: float | None = None
    fixed_scale: float | None = None
    rounding: str = "nearest"

    family = "fp8"
    code_bits = 8

    def __post_init__(self) -> None:
        if self.fp8 not in FP8_DTYPES:
            raise ConfigError(f"Unknown fp8 type {self.fp8!r}; allowed: {', '.join(FP8_DTYPES)}.")
        if self.scope not in STATIC_SCOPES:
            raise ConfigError(
                f"Unknown static fp8 scale scope {self.scope!r}; allowed: "
                f"{', '.join(STATIC_SCOPES)} (or token-head for the dynamic variant)."
            )
        p = self.percentile
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 100.0
        ):
            raise ConfigError(f"Invalid percentile {p!r}; allowed: 0 < p < 100, e.g. 99.9.")
        f = self.fixed_scale
        if f is not None:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < math.inf:
                raise ConfigError(f"Invalid fixed scale {f!r}; allowed: a positive number.")
            if p is not None:
                raise ConfigError(
                    "A static fp8 scale is either calibrated (absmax or a percentile) or fixed, "
                    "not both; allowed: :pP or :sS."
                )
        if self.rounding not in FP8_ROUNDINGS:
            raise ConfigError(
                f"Unknown fp8 rounding {self.rounding!r}; allowed: {', '.join(FP8_ROUNDINGS)}."
            )

    @property
    def name(self) -> str:
        base = f"fp8_{self.fp8}" + ("" if self.scope == "tensor" else f"@{self.scope}")
        if self.fixed_scale is not None:
            base += f":s{self.fixed_scale:g}"
        elif self.percentile is not None:
            base += f":p{self.percentile:g}"
        return base + (":trunc" if self.rounding == "truncate" else "")

    @property
    def calibration(self) -> str:
        if self.fixed_scale is not None:
            return f"fixed scale {self.fixed_scale:g}"
        return "absmax" if self.percentile is None else f"percentile {self.percentile:g}"

    @property
    def shares_scale(self) -> str:
        what = "one layer's whole tensor" if self.scope == "tensor" else "one KV head of a layer"
        how = ", truncated to fp8" if self.rounding == "truncate" else ""
        return f"static float32 scale per {what} ({self.calibration}{how})"

    def bits_per_element(self, shape: Sequence[int]) -> float:
        """8 bits plus the static scales amortized over one sequence of ``shape`` [B,H,T,D]
        (one scale per layer, or per KV head)."""
        _, h, t, d = (int(s) for s in shape)
        per = h * t * d if self.scope == "tensor" else t * d
        return 8 + SCALE_BITS / per


@dataclass(frozen=True)
class TokenHeadFormat:
    """Dynamic per-token-head quantization (module docstring) of ``kind`` ``"int8"``,
    ``"int4"`` or ``"fp8"``."""

    kind: str = "int8"

    family = "token-head"

    def __post_init__(self) -> None:
        if self.kind not in TOKEN_HEAD_KINDS:
            raise ConfigError(
                f"Unknown per-token-head type {self.kind!r}; allowed: "
                f"{', '.join(TOKEN_HEAD_KINDS)}."
            )

    @property
    def name(self) -> str:
        return f"{self.kind}@token-head"

    @property
    def code_bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    @property
    def shares_scale(self) -> str:
        return "all channels of one token of one KV head (dynamic float32 scale)"

    def bits_per_element(self, shape: Sequence[int]) -> float:
        return self.code_bits + SCALE_BITS / int(shape[-1])


def truncate_fp8(v: torch.Tensor, fp8: str) -> torch.Tensor:
    """Float32 ``v`` (already scaled) as vLLM's CPU writer stores it in fp8 ``fp8`` (module
    docstring), as float32 values on the fp8 grid; an exact zero stored as +0. Computed without
    float32 subnormals, so a flush-to-zero mode cannot change it."""
    top = FP8_MAX[fp8]
    v = v.float().clamp(-top, top)
    drop = 23 - {"e4m3": 3, "e5m2": 2}[fp8]  # float32 mantissa bits fp8 does not hold
    normal = (v.view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)
    a = v.abs()
    if fp8 == "e4m3":  # subnormals: multiples of 2^-9; v * 2^-120 first rounds at 2^-29
        steps = torch.floor(torch.round(a * 2.0**29) * 2.0**-20)
        small, step = a < 2.0**-6, 2.0**-9
    else:  # e5m2 subnormals: multiples of 2^-16, truncated from v's bits directly
        steps = torch.floor(a * 2.0**16)
        small, step = a < 2.0**-14, 2.0**-16
    sub = torch.copysign(steps * step, v)
    out = torch.where(small, sub, normal)
    return torch.where(v == 0, torch.zeros_like(out), out)


def fp8_encode(x: torch.Tensor, scale: torch.Tensor, fp8: str,
               rounding: str = "nearest") -> torch.Tensor:
    """The fp8 codes (``torch.float8_e4m3fn`` / ``float8_e5m2``) a cache writes for ``x`` with
    ``scale`` (broadcast against ``x``; a zero scale is replaced by 1 here, ``fp8_decode``
    reads zeros), rounded to nearest or truncated (module docstring)."""
    dtype, top = FP8_DTYPES[fp8], FP8_MAX[fp8]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if rounding == "truncate":  # the float32 reciprocal, then values already on the fp8 grid
        return truncate_fp8(x.float() * (1.0 / safe.float()), fp8).to(dtype)
    return (x.float() / safe).clamp(-top, top).to(dtype)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``codes`` times their ``scale``, float32; zeros where the scale is 0."""
    y = codes.float() * torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, y, torch.zeros_like(y))


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor, fp8: str,
                   rounding: str = "nearest") -> torch.Tensor:
    """``fp8_decode(fp8_encode(...))``: what a cache reads back, float32."""
    return fp8_decode(fp8_encode(x, scale, fp8, rounding), scale)


def calibrate_scale(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Static fp8 scale(s) from captured ``x`` ``[B, H, T, D]``: float32 ``[1, 1, 1, 1]``
    (scope tensor) or ``[1, H, 1, 1]`` (scope head), ``absmax / fp8_max`` or
    ``percentile_p(|x|) / fp8_max`` over every sample, token and channel of the scope
    (the percentile is the order statistic at rank ``ceil(p/100 * n)``, no interpolation)."""
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if fmt.fixed_scale is not None:
        n = 1 if fmt.scope == "tensor" else x.shape[1]
        return torch.full((1, n, 1, 1), float(fmt.fixed_scale), dtype=torch.float32)
    a = x.detach().float().abs().transpose(0, 1).reshape(x.shape[1], -1)  # [H, B*T*D]
    if fmt.scope == "tensor":
        a = a.reshape(1, -1)
    if fmt.percentile is None:
        level = a.amax(dim=1)
    else:
        rank = max(1, math.ceil(fmt.percentile / 100 * a.shape[1]))
        level = a.kthvalue(rank, dim=1).values
    return (level / FP8_MAX[fmt.fp8]).reshape(1, -1, 1, 1)


def quantize_token_head(x: torch.Tensor, fmt: TokenHeadFormat
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` a cache holds for ``x`` ``[B, H, T, D]``: fp8 codes with ``s = absmax
    / 448``, or the integer codes of the reference's symmetric per-token grid packed along
    channels; float32 scales ``[B, H, T, 1]``."""
    x = x.detach().float()
    if fmt.kind == "fp8":
        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX["e4m3"]
        return fp8_encode(x, scale, "e4m3"), scale
    q = quantize(x, QuantSpec(fmt.code_bits, "per-token", None, True))
    return pack_codes(q.codes, fmt.code_bits), q.scale


def dequantize_token_head(codes: torch.Tensor, scales: torch.Tensor, fmt: TokenHeadFormat,
                          head_dim: int) -> torch.Tensor:
    """float32 ``[B, H, T, D]`` of ``quantize_token_head``'s codes: the reference's ``code *
    scale + zero`` with ``zero = -qmax * scale`` for the integer kinds."""
    if fmt.kind == "fp8":
        return fp8_decode(codes, scales)
    qmax = (1 << (fmt.code_bits - 1)) - 1
    return unpack_codes(codes, fmt.code_bits, head_dim).float() * scales + (-qmax * scales)
