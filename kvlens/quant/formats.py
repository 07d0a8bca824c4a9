"""Engine KV-cache formats: the storage formats llama.cpp, vLLM and SGLang actually run.

Tensors are ``[B, H, T, D]`` at every public function. Each format is a frozen dataclass that
says what shares one scale, the block size, the code width and the storage bytes; this module
is the one place their quantize/dequantize semantics live (plain torch, vectorized).

- ``GGMLBlockFormat`` (llama.cpp ``-ctk/-ctv``): blocks of 32 consecutive channels of one
  token (along ``head_dim``) share an fp16 scale ``d`` (and an fp16 minimum ``m`` for the
  ``_1`` types). Quantization reproduces the ``gguf`` package's numpy quantizers
  (``gguf.quants``) bit for bit; ``to_bytes`` writes the ggml block layout::

      q8_0   [d f16][32 x int8]                          34 B / 32 = 8.5 bits
      q4_0   [d f16][16 B: nibbles, lo = j, hi = j+16]   18 B / 32 = 4.5 bits   x = (q-8) d
      q4_1   [d f16][m f16][16 B nibbles]                20 B / 32 = 5.0 bits   x = q d + m
      q5_0   [d f16][qh 4 B][16 B nibbles]               22 B / 32 = 5.5 bits   x = (q-16) d
      q5_1   [d f16][m f16][qh 4 B][16 B nibbles]        24 B / 32 = 6.0 bits   x = q d + m
      iq4_nl [d f16][16 B nibbles]                       18 B / 32 = 4.5 bits   x = K[q] d

  ``qh`` holds bit 4 of the 32 codes (little-endian ``uint32``, bit ``j`` = element ``j``);
  ``K`` is the iq4_nl non-uniform table ``IQ4_NL_VALUES``. ``gguf`` has no numpy quantizer
  for iq4_nl; kvlens quantizes it as llama.cpp's CUDA ``set_rows`` does
  (``quantize_f32_iq4_nl_block``: nearest table entry at ``d0 = x_absmax_signed / -127``, then a
  least-squares refit of ``d`` with weights ``x^2``); see ``quantize_ggml``.
- ``FP8Format`` with a *static* scale (vLLM/SGLang ``--kv-cache-dtype fp8_e4m3/fp8_e5m2``):
  ``x_hat = fp8(clamp(x / s, +-fp8_max)) * s`` with one float32 ``s`` per layer and tensor
  (``scope="tensor"``) or per KV head (``scope="head"``), calibrated from captured data by
  ``calibrate_scale``: ``s = absmax / fp8_max`` or ``s = percentile_p(|x|) / fp8_max``
  (values beyond it saturate, as the engines' saturating casts do), or a fixed ``s``
  (``fp8_e4m3:s1`` is vLLM's default scale 1.0 when the checkpoint carries none).
- ``TokenHeadFormat`` (vLLM's per-token-head int8/int4/fp8): a *dynamic* scale per token and
  KV head (all ``D`` channels of one token of one head), ``s = absmax / qmax`` with
  ``qmax = 127`` (int8), ``7`` (int4) or ``448`` (fp8 e4m3). The integer variants are the
  reference's symmetric per-token grid (``kvlens.quant.reference``, ``QuantSpec(bits,
  "per-token", symmetric=True)``, round-half-to-even); scales are counted as float32. vLLM's
  ``int4_per_token_head`` is a different, non-uniform codebook format (sign + 8 magnitudes,
  fp16 scales per channel group) that kvlens does not reproduce: ``int4@token-head`` is a
  uniform int4 stand-in at the same granularity, not that format.
- ``FormatSetting``: a format plus the engine's rotation. llama.cpp rotates Q/K/V by an
  orthonormal Walsh-Hadamard matrix when the cache type is quantized and ``head_dim % 64 ==
  0`` (``LLAMA_ATTN_ROT_DISABLE=1`` turns it off): keys by the largest power-of-two block
  dividing ``head_dim`` (block-diagonal), values by 64x64 blocks. ``rotation="auto"`` follows
  that rule for ggml types and never rotates fp8/int formats (vLLM/SGLang do not);
  ``"on"``/``"off"`` force it (names ``q4_0+rot`` / ``q4_0+norot``).

``parse_format`` reads names such as ``q8_0``, ``q4_0+norot``, ``fp8_e4m3``, ``fp8_e4m3@head``,
``fp8_e5m2@head:p99.9``, ``fp8_e4m3:s1``, ``int8@token-head``; unknown names raise ``ConfigError`` listing the
allowed ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import ConfigError, InputError
from kvlens.quant.fake import fake_quantize
from kvlens.quant.rotation import hadamard_rotation
from kvlens.quant.spec import QuantSpec

GGML_BLOCK_SIZE = 32
# the iq4_nl code book (ggml-common.h kvalues_iq4nl; gguf.quants.IQ4_NL.kvalues)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {k: float(torch.finfo(v).max) for k, v in FP8_DTYPES.items()}  # 448, 57344
STATIC_SCOPES = ("tensor", "head")
ROTATIONS = ("auto", "on", "off")
LLAMA_CPP_ROTATION_MULTIPLE = 64
SCALE_BITS = 32  # float32 scales for fp8 / per-token-head formats
FORMAT_VERSION = 1


# -- the formats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGMLBlockFormat:
    """A llama.cpp cache type: ``block_size`` consecutive channels of one token share an fp16
    scale (and an fp16 minimum when ``has_min``).

    name: the ggml type name (``q8_0`` ...). code_bits: bits per code. has_min: ``_1`` types
    store ``m`` and use codes ``0..2^b-1`` (``x = q d + m``); the others are zero-centred.
    nonlinear: iq4_nl's table ``IQ4_NL_VALUES`` instead of a uniform grid."""

    name: str
    code_bits: int
    has_min: bool = False
    nonlinear: bool = False
    block_size: int = GGML_BLOCK_SIZE

    family = "ggml"

    @property
    def block_bytes(self) -> int:
        return 2 + (2 if self.has_min else 0) + self.block_size * self.code_bits // 8

    @property
    def shares_scale(self) -> str:
        return f"{self.block_size} consecutive channels of one token (fp16 d" + (
            ", fp16 m)" if self.has_min else ")"
        )

    def bits_per_element(self, shape: Sequence[int] | None = None) -> float:
        """Storage bits per cached element from the block layout (independent of ``shape``)."""
        return self.block_bytes * 8 / self.block_size

    def check_fits(self, shape: Sequence[int]) -> None:
        d = int(shape[-1])
        if d % self.block_size:
            raise ConfigError(
                f"{self.name} needs head_dim divisible by its block size {self.block_size}, got "
                f"head_dim {d}; llama.cpp refuses such a quantized cache (allowed head_dim: "
                f"multiples of {self.block_size})."
            )


@dataclass(frozen=True)
class FP8Format:
    """fp8 cache with a static float32 scale calibrated from captured data.

    fp8: ``"e4m3"`` (``torch.float8_e4m3fn``, max 448) or ``"e5m2"`` (max 57344).
    scope: what shares one scale: ``"tensor"`` = all heads, tokens and channels of one layer's
        keys (or values); ``"head"`` = all tokens and channels of one KV head.
    percentile: ``None`` = scale from the absolute maximum; ``p`` in ``(0, 100)`` = from the
        ``p``-th percentile of ``|x|`` (larger values saturate at ``+-fp8_max * s``).
    fixed_scale: a given scale instead of calibration (``1.0`` = vLLM's default when no
        scales are loaded or computed); excludes ``percentile``."""

    fp8: str = "e4m3"
    scope: str = "tensor"
    percentile: float | None = None
    fixed_scale: float | None = None

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

    @property
    def name(self) -> str:
        base = f"fp8_{self.fp8}" + ("" if self.scope == "tensor" else f"@{self.scope}")
        if self.fixed_scale is not None:
            return base + f":s{self.fixed_scale:g}"
        return base + ("" if self.percentile is None else f":p{self.percentile:g}")

    @property
    def calibration(self) -> str:
        if self.fixed_scale is not None:
            return f"fixed scale {self.fixed_scale:g}"
        return "absmax" if self.percentile is None else f"percentile {self.percentile:g}"

    @property
    def shares_scale(self) -> str:
        what = "one layer's whole tensor" if self.scope == "tensor" else "one KV head of a layer"
        return f"static float32 scale per {what} ({self.calibration})"

    def bits_per_element(self, shape: Sequence[int]) -> float:
        """8 bits plus the static scales amortized over one sequence of ``shape`` [B,H,T,D]
        (one scale per layer, or per KV head)."""
        _, h, t, d = (int(s) for s in shape)
        per = h * t * d if self.scope == "tensor" else t * d
        return 8 + SCALE_BITS / per


@dataclass(frozen=True)
class TokenHeadFormat:
    """Dynamic per-token-head quantization (vLLM): the ``D`` channels of one token of one KV
    head share a float32 scale ``s = absmax / qmax``; codes are symmetric.

    kind: ``"int8"`` (qmax 127), ``"int4"`` (qmax 7) or ``"fp8"`` (e4m3, qmax 448)."""

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


TOKEN_HEAD_KINDS = ("int8", "int4", "fp8")
GGML_FORMATS = {
    "q8_0": GGMLBlockFormat("q8_0", 8),
    "q4_0": GGMLBlockFormat("q4_0", 4),
    "q4_1": GGMLBlockFormat("q4_1", 4, has_min=True),
    "q5_0": GGMLBlockFormat("q5_0", 5),
    "q5_1": GGMLBlockFormat("q5_1", 5, has_min=True),
    "iq4_nl": GGMLBlockFormat("iq4_nl", 4, nonlinear=True),
}
KVFormat = GGMLBlockFormat | FP8Format | TokenHeadFormat


@dataclass(frozen=True)
class FormatSetting:
    """A cache format as an engine runs it: the format plus the engine's Hadamard rotation.

    rotation: ``"auto"`` = what the engine does (llama.cpp: ggml types rotated when
        ``head_dim % 64 == 0``; fp8/int formats never), ``"on"`` / ``"off"`` = forced (``on``
        needs an even head_dim; ``off`` is llama.cpp's ``LLAMA_ATTN_ROT_DISABLE=1``)."""

    format: KVFormat
    rotation: str = "auto"

    def __post_init__(self) -> None:
        if self.rotation not in ROTATIONS:
            raise ConfigError(
                f"Unknown rotation {self.rotation!r}; allowed: {', '.join(ROTATIONS)}."
            )

    @property
    def name(self) -> str:
        suffix = {"auto": "", "on": "+rot", "off": "+norot"}[self.rotation]
        return self.format.name + suffix

    def rotates(self, head_dim: int) -> bool:
        """Whether this setting rotates a cache of ``head_dim``."""
        if self.rotation == "auto":
            return self.format.family == "ggml" and head_dim % LLAMA_CPP_ROTATION_MULTIPLE == 0
        return self.rotation == "on"

    def bits_per_element(self, shape: Sequence[int]) -> float:
        return self.format.bits_per_element(shape)

    def to_dict(self) -> dict[str, Any]:
        """``{"version": 1, "name": "q4_0+norot"}``: the name carries every field."""
        return {"version": FORMAT_VERSION, "name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FormatSetting:
        """Inverse of ``to_dict``; rejects other versions and unknown keys with ``ConfigError``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"A format must be a JSON object, got {type(data).__name__}.")
        if data.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ConfigError(
                f"Unsupported format version {data.get('version')!r}; this kvlens reads "
                f"version {FORMAT_VERSION}."
            )
        unknown = sorted(set(data) - {"version", "name"})
        if unknown or "name" not in data:
            raise ConfigError(f"Format keys {sorted(data)}; allowed: version, name (required).")
        return parse_format(data["name"])


# -- parsing ----------------------------------------------------------------------------------

_NAME = re.compile(
    r"^(?P<type>[a-z0-9_]+)(?:@(?P<scope>[a-z-]+))?(?::p(?P<pct>[0-9.]+)|:s(?P<fix>[0-9.e-]+))?"
    r"(?:\+(?P<rot>rot|norot))?$"
)


def allowed_format_names() -> tuple[str, ...]:
    """Every accepted base name (see ``parse_format`` for the suffixes)."""
    return (
        *GGML_FORMATS,
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_e4m3@head",
        "fp8_e5m2@head",
        *(f"{k}@token-head" for k in TOKEN_HEAD_KINDS),
    )


def _unknown(text: str, why: str) -> ConfigError:
    return ConfigError(
        f"Unknown KV-cache format {text!r} ({why}); allowed: {', '.join(allowed_format_names())}; "
        "static fp8 takes :pP for a percentile scale (e.g. fp8_e4m3@head:p99.9) or :sS for a "
        "fixed scale (fp8_e4m3:s1 = vLLM's default 1.0), and any format "
        "+rot / +norot to force the Hadamard rotation on or off (default: llama.cpp's rule)."
    )


# vLLM's --kv-cache-dtype spellings of the per-token-head formats
VLLM_ALIASES = {f"{k}_per_token_head": f"{k}@token-head" for k in TOKEN_HEAD_KINDS}


def parse_format(text: str) -> FormatSetting:
    """``"q4_0"``, ``"q4_0+norot"``, ``"fp8"`` (= fp8_e4m3, vLLM's alias), ``"fp8_e5m2@head"``,
    ``"fp8_e4m3@tensor:p99.9"``, ``"int8@token-head"`` (or vLLM's ``"int8_per_token_head"``),
    ``"fp8@token-head"`` -> ``FormatSetting``; anything else raises ``ConfigError`` with the
    allowed names."""
    raw = text
    text = (text or "").strip().lower()
    for alias, name in VLLM_ALIASES.items():
        if text == alias or text.startswith(alias + "+"):
            text = name + text[len(alias) :]
    m = _NAME.match(text)
    if not m:
        raise _unknown(raw, "not of the form TYPE[@SCOPE][:pP][+rot|+norot]")
    kind, scope, pct, fix, rot = m["type"], m["scope"], m["pct"], m["fix"], m["rot"]
    rotation = {"rot": "on", "norot": "off", None: "auto"}[rot]
    try:
        percentile = None if pct is None else float(pct)
        fixed = None if fix is None else float(fix)
    except ValueError:
        raise _unknown(raw, f"{pct or fix!r} is not a number") from None
    static_fp8 = kind in ("fp8", "fp8_e4m3", "fp8_e5m2") and scope != "token-head"
    if (percentile is not None or fixed is not None) and not static_fp8:
        raise _unknown(raw, ":p / :s are options of the static fp8 formats only")
    if kind in GGML_FORMATS:
        if scope is not None:
            raise _unknown(raw, f"{kind} has a fixed layout: no @scope")
        return FormatSetting(GGML_FORMATS[kind], rotation)
    if kind in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        fp8 = "e5m2" if kind == "fp8_e5m2" else "e4m3"
        if scope == "token-head":
            if fp8 != "e4m3":
                raise _unknown(raw, "per-token-head fp8 is e4m3 with a dynamic absmax scale")
            return FormatSetting(TokenHeadFormat("fp8"), rotation)
        if scope not in (None, *STATIC_SCOPES):
            raise _unknown(raw, f"fp8 scope {scope!r}")
        return FormatSetting(FP8Format(fp8, scope or "tensor", percentile, fixed), rotation)
    if kind in ("int8", "int4"):
        if scope not in (None, "token-head"):
            raise _unknown(raw, f"{kind} exists only as a dynamic per-token-head format")
        return FormatSetting(TokenHeadFormat(kind), rotation)
    raise _unknown(raw, f"unknown type {kind!r}")


def parse_format_list(text: str | None) -> tuple[FormatSetting, ...]:
    """``"q8_0, q4_0,fp8_e4m3"`` -> settings (``""`` / ``"none"`` -> ``()``), duplicates
    dropped."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    if items in ([], ["none"]):
        return ()
    return tuple(dict.fromkeys(parse_format(s) for s in items))


# -- ggml blocks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGMLBlocks:
    """A ``[B, H, T, D]`` tensor in ggml blocks.

    codes: uint8 ``[B, H, T, D // 32, 32]``, one code per element as ggml stores it unpacked
        (q8_0: the int8 code's two's-complement byte; q4_0/q5_0: ``q`` with the offset 8/16
        added; iq4_nl: the table index).
    d: float16 ``[B, H, T, D // 32]``. m: float16 like ``d`` for q4_1/q5_1, else None."""

    format: GGMLBlockFormat
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def to_bytes(self) -> torch.Tensor:
        """uint8 ``[B, H, T, D // 32 * block_bytes]``: the exact ggml block bytes per token
        (what ``gguf.quants.quantize`` returns for rows of length ``D``)."""
        fmt, q = self.format, self.codes
        parts = [_f16_bytes(self.d)]
        if fmt.has_min:
            parts.append(_f16_bytes(self.m))
        if fmt.code_bits == 8:
            parts.append(q)
        else:
            half = fmt.block_size // 2
            if fmt.code_bits == 5:
                bit4 = ((q >> 4) & 1).to(torch.int64)
                weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
                qh = (bit4.reshape(*q.shape[:-1], 4, 8) * weights).sum(-1).to(torch.uint8)
                parts.append(qh)
            parts.append((q[..., :half] & 0x0F) | ((q[..., half:] & 0x0F) << 4))
        blocks = torch.cat(parts, dim=-1)
        return blocks.reshape(*blocks.shape[:-2], -1)

    @classmethod
    def from_bytes(cls, data: torch.Tensor, fmt: GGMLBlockFormat, head_dim: int) -> GGMLBlocks:
        """Inverse of ``to_bytes`` for uint8 ``[..., D // 32 * block_bytes]``."""
        nb = head_dim // fmt.block_size
        blocks = data.reshape(*data.shape[:-1], nb, fmt.block_bytes)
        d = _f16_from_bytes(blocks[..., 0:2])
        pos = 2
        m = None
        if fmt.has_min:
            m = _f16_from_bytes(blocks[..., 2:4])
            pos = 4
        if fmt.code_bits == 8:
            codes = blocks[..., pos:].clone()
        else:
            qh = None
            if fmt.code_bits == 5:
                qh = blocks[..., pos : pos + 4]
                pos += 4
            qs = blocks[..., pos:]
            codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
            if qh is not None:
                shifts = torch.arange(8, dtype=torch.uint8)
                bits = ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], 32)
                codes = codes | (bits << 4)
        return cls(fmt, codes, d, m)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 ``[...]`` -> uint8 ``[..., 2]`` little-endian."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _f16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(b.shape[:-1])


def _blocks(x: torch.Tensor, fmt: GGMLBlockFormat) -> torch.Tensor:
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise InputError(f"Expected a floating-point tensor, got {x.dtype}.")
    fmt.check_fits(x.shape)
    b, h, t, d = x.shape
    return x.detach().float().reshape(b, h, t, d // fmt.block_size, fmt.block_size)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``where(d == 0, 0, 1 / d)`` in float32, as ggml and gguf compute ``id``."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / safe)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``, written as ``gguf.quants.np_roundf`` does (exact in float32)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude per block, with its sign (first one on ties)."""
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(blocks, -1, idx)


def quantize_ggml(x: torch.Tensor, fmt: GGMLBlockFormat) -> GGMLBlocks:
    """Quantize ``x`` ``[B, H, T, D]`` into ggml blocks of 32 channels per token.

    q8_0/q4_0/q4_1/q5_0/q5_1 follow ``gguf.quants`` exactly (float32 arithmetic in the same
    order, ``trunc(v + 0.5)`` or ``roundf`` rounding, scales computed in float32 and stored as
    fp16), so ``to_bytes`` matches ``gguf.quants.quantize`` byte for byte. iq4_nl follows
    llama.cpp's CUDA cache writer ``quantize_f32_iq4_nl_block`` (nearest table entry at
    ``d0 = signed_absmax / -127``, then ``d = sum(w q x) / sum(w q^2)`` with ``w = x^2``, the
    sums in float64 here, or ``d0`` when ``sum(w q^2) == 0``); the CPU writer additionally
    searches 15 trial scales, so a CPU llama.cpp may choose other codes."""
    blocks = _blocks(x, fmt)
    m = None
    if fmt.name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(d))
        codes = q.to(torch.int8).view(torch.uint8)
    elif fmt.nonlinear:
        return _quantize_iq4_nl(blocks, fmt)
    elif not fmt.has_min:
        offset = 1 << (fmt.code_bits - 1)  # 8 (q4_0) or 16 (q5_0)
        d = _signed_absmax(blocks) / -offset
        v = torch.trunc(blocks * _inverse(d) + (offset + 0.5))
        codes = v.clamp(0, 2 * offset - 1).to(torch.uint8)
    else:
        levels = (1 << fmt.code_bits) - 1
        hi = blocks.amax(dim=-1, keepdim=True)
        lo = blocks.amin(dim=-1, keepdim=True)
        d = (hi - lo) / levels
        v = torch.trunc((blocks - lo) * _inverse(d) + 0.5)
        codes = v.clamp(0, levels).to(torch.uint8)
        m = lo[..., 0].to(torch.float16)
    return GGMLBlocks(fmt, codes, d[..., 0].to(torch.float16), m)


def _iq4_nearest(al: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml ``best_index_int8``: the nearest table entry, the upper one on an exact tie."""
    mu = torch.searchsorted(values, al.contiguous(), right=True).clamp(1, len(values) - 1)
    lower = values[mu - 1]
    upper = values[mu]
    return torch.where(al - lower < upper - al, mu - 1, mu)


def _quantize_iq4_nl(blocks: torch.Tensor, fmt: GGMLBlockFormat) -> GGMLBlocks:
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    d0 = _signed_absmax(blocks) / IQ4_NL_VALUES[0]
    idx = _iq4_nearest(blocks * _inverse(d0), values)
    q = values[idx].double()
    x = blocks.double()
    w = x * x
    sumqx = (w * q * x).sum(-1, keepdim=True)
    sumq2 = (w * q * q).sum(-1, keepdim=True)
    refit = (sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2))).float()
    d = torch.where(sumq2 > 0, refit, d0)
    return GGMLBlocks(fmt, idx.to(torch.uint8), d[..., 0].to(torch.float16), None)


def dequantize_ggml(blocks: GGMLBlocks) -> torch.Tensor:
    """ggml blocks -> float32 ``[B, H, T, D]`` (as ``gguf.quants.dequantize`` computes:
    ``d * q`` or ``d * q + m`` in float32 with the fp16 ``d``, ``m``)."""
    fmt, c = blocks.format, blocks.codes
    d = blocks.d.float()[..., None]
    if fmt.name == "q8_0":
        q = c.view(torch.int8).float()
    elif fmt.nonlinear:
        q = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[c.long()]
    elif fmt.has_min:
        out = d * c.float() + blocks.m.float()[..., None]
        return out.reshape(*out.shape[:-2], -1)
    else:
        q = c.float() - (1 << (fmt.code_bits - 1))
    out = d * q
    return out.reshape(*out.shape[:-2], -1)


# -- fp8 and per-token-head -------------------------------------------------------------------


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor, fp8: str) -> torch.Tensor:
    """``fp8(clamp(x / s, +-max)) * s`` in float32 (saturating cast, round-to-nearest-even).
    ``scale`` broadcasts against ``x``; a zero scale reads back zeros."""
    dtype, top = FP8_DTYPES[fp8], FP8_MAX[fp8]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x.float() / safe).clamp(-top, top).to(dtype).float() * safe
    return torch.where(scale > 0, y, torch.zeros_like(y))


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


def fake_quantize_token_head(x: torch.Tensor, fmt: TokenHeadFormat) -> torch.Tensor:
    """Dynamic per-token-head round trip, float32 ``[B, H, T, D]``: the integer kinds through
    the reference's symmetric per-token grid, fp8 with ``s = absmax / 448`` per token-head."""
    if fmt.kind == "fp8":
        scale = x.detach().float().abs().amax(dim=-1, keepdim=True) / FP8_MAX["e4m3"]
        return fp8_round_trip(x, scale, "e4m3")

    return fake_quantize(x.detach().float(), QuantSpec(fmt.code_bits, "per-token", None, True))


# -- rotation and the one entry point ---------------------------------------------------------


def engine_rotation(tensor: str, head_dim: int) -> torch.Tensor:
    """The rotation llama.cpp applies to a quantized cache of ``head_dim`` (float32
    ``[D, D]``, orthonormal and symmetric): keys a block-diagonal Walsh-Hadamard with the largest
    power-of-two block dividing ``head_dim``; values 64x64 blocks when ``head_dim % 64 == 0``.
    Forced rotation of other even head_dims uses the key rule for both."""

    if tensor == "value" and head_dim % LLAMA_CPP_ROTATION_MULTIPLE == 0:
        block = hadamard_rotation(LLAMA_CPP_ROTATION_MULTIPLE)
        return torch.block_diag(*([block] * (head_dim // LLAMA_CPP_ROTATION_MULTIPLE)))
    return hadamard_rotation(head_dim)


def rotate_rows(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` in float64, rounded to float32: the same float32 rows whatever the number of
    tokens in the call or the CPU's float32 matmul kernel (a float32 matmul may round
    differently with the batch shape, which would make chunked prefill store other codes than
    token-by-token feeding, or the reference other codes than the cache)."""
    return (x.double() @ r.double().to(x.device)).float()


def fake_quantize_format(
    x: torch.Tensor,
    setting: FormatSetting,
    tensor: str = "key",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What attention reads back from a cache of ``setting``: float32 ``[B, H, T, D]`` in
    ``x``'s own basis (a rotated setting stores ``x R`` and is un-rotated here, which for keys
    equals rotating the query and for values un-rotating the output).

    tensor: ``"key"`` or ``"value"`` (picks llama.cpp's rotation). scale: the static fp8 scale
    from ``calibrate_scale`` (computed on ``x`` itself, in the rotated basis, when None)."""
    fmt = setting.format
    if x.dim() != 4:
        raise InputError(f"Expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}.")
    head_dim = x.shape[-1]
    r = None
    if setting.rotates(head_dim):
        r = engine_rotation(tensor, head_dim).to(x.device)
        x = rotate_rows(x, r)
    if fmt.family == "ggml":
        out = dequantize_ggml(quantize_ggml(x, fmt))
    elif fmt.family == "fp8":
        if scale is None:
            scale = calibrate_scale(x, fmt)
        out = fp8_round_trip(x, scale.to(x.device), fmt.fp8)
    else:
        out = fake_quantize_token_head(x, fmt)
    return rotate_rows(out, r.T) if r is not None else out
