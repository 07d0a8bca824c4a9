"""Engine KV-cache formats as an engine runs them: the format (``kvlens.quant.ggml`` for
llama.cpp's ggml blocks, ``kvlens.quant.fp8`` for vLLM/SGLang's static fp8 and per-token-head
formats, ``kvlens.quant.ds_mla`` for vLLM's ``fp8_ds_mla`` cache of an MLA latent row) plus
the engine's rotation, their names, and the one entry point that reads a tensor back as the
engine would (``fake_quantize_format``). Tensors are ``[B, H, T, D]``.

- ``FormatSetting``: a format plus the engine's rotation. llama.cpp rotates Q/K/V by an
  orthonormal Walsh-Hadamard matrix when the cache type is quantized and ``head_dim % 64 ==
  0`` (``LLAMA_ATTN_ROT_DISABLE=1`` turns it off): keys by the largest power-of-two block
  dividing ``head_dim`` (block-diagonal), values by 64x64 blocks. ``rotation="auto"`` follows
  that rule for ggml types and never rotates fp8/int formats (vLLM/SGLang do not);
  ``"on"``/``"off"`` force it (names ``q4_0+rot`` / ``q4_0+norot``).

``parse_format`` reads names such as ``q4_0+norot``, ``fp8_e5m2@head:p99.9``,
``fp8_e4m3:s1:trunc`` (vLLM's CPU writer, which truncates: ``kvlens.quant.fp8``),
``int8@token-head``, ``fp8_ds_mla``: the cache-type names a config stores
(``kvlens.quant.cachetypes``); what a user types on the command line is an engine setting
(``kvlens.config.engine``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import ConfigError
from kvlens.quant.ds_mla import DS_MLA, DsMlaFormat, dequantize_ds_mla, quantize_ds_mla
from kvlens.quant.fp8 import (
    STATIC_SCOPES,
    TOKEN_HEAD_KINDS,
    FP8Format,
    TokenHeadFormat,
    calibrate_scale,
    dequantize_token_head,
    fp8_round_trip,
    quantize_token_head,
)
from kvlens.quant.ggml import GGML_FORMATS, GGMLBlockFormat, dequantize_ggml, quantize_ggml
from kvlens.quant.reference import check_tensor
from kvlens.quant.rotation import hadamard_rotation
from kvlens.quant.spec import check_versioned_dict

ROTATIONS = ("auto", "on", "off")
LLAMA_CPP_ROTATION_MULTIPLE = 64
FORMAT_VERSION = 1
KVFormat = GGMLBlockFormat | FP8Format | TokenHeadFormat | DsMlaFormat


@dataclass(frozen=True)
class FormatSetting:
    """A cache format plus the engine's Hadamard rotation (module docstring): ``rotation``
    ``"auto"`` (what the engine does), ``"on"`` (needs an even head_dim) or ``"off"``."""

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
        check_versioned_dict(data, "format", FORMAT_VERSION, ("name",))
        if "name" not in data:
            raise ConfigError("Format is missing 'name'; required: name.")
        return parse_format(data["name"])


# -- parsing ----------------------------------------------------------------------------------

_NAME = re.compile(
    r"^(?P<type>[a-z0-9_]+)(?:@(?P<scope>[a-z-]+))?(?::p(?P<pct>[0-9.]+)|:s(?P<fix>[0-9.e-]+))?"
    r"(?P<trunc>:trunc)?(?:\+(?P<rot>rot|norot))?$"
)


#: the static fp8 type names (``fp8`` is vLLM's alias of ``fp8_e4m3``)
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: every accepted base name (``parse_format`` adds the suffixes)
FORMAT_NAMES = (*GGML_FORMATS, *FP8_NAMES, "fp8_e4m3@head", "fp8_e5m2@head",
                *(f"{k}@token-head" for k in TOKEN_HEAD_KINDS), DS_MLA.name)


def _unknown(text: str, why: str) -> ConfigError:
    return ConfigError(
        f"Unknown KV-cache format {text!r} ({why}); allowed: {', '.join(FORMAT_NAMES)}; "
        "static fp8 takes :pP for a percentile scale (e.g. fp8_e4m3@head:p99.9) or :sS for a "
        "fixed scale (fp8_e4m3:s1 = vLLM's default 1.0), then :trunc to truncate to fp8 as "
        "vLLM's CPU build does (fp8_e4m3:s1:trunc), and any format "
        "+rot / +norot to force the Hadamard rotation on or off (default: llama.cpp's rule)."
    )


# vLLM's --kv-cache-dtype spellings of the per-token-head formats
VLLM_ALIASES = {f"{k}_per_token_head": f"{k}@token-head" for k in TOKEN_HEAD_KINDS}


def parse_format(text: str) -> FormatSetting:
    """A cache-type name (module docstring; ``"fp8"`` is vLLM's alias of ``fp8_e4m3``,
    ``"int8_per_token_head"`` its spelling of ``int8@token-head``) -> ``FormatSetting``."""
    raw = text
    text = (text or "").strip().lower()
    for alias, name in VLLM_ALIASES.items():
        if text == alias or text.startswith(alias + "+"):
            text = name + text[len(alias) :]
    m = _NAME.match(text)
    if not m:
        raise _unknown(raw, "not of the form TYPE[@SCOPE][:pP|:sS][:trunc][+rot|+norot]")
    kind, scope, pct, fix, rot = m["type"], m["scope"], m["pct"], m["fix"], m["rot"]
    rounding = "truncate" if m["trunc"] else "nearest"
    rotation = {"rot": "on", "norot": "off", None: "auto"}[rot]
    try:
        percentile = None if pct is None else float(pct)
        fixed = None if fix is None else float(fix)
    except ValueError:
        raise _unknown(raw, f"{pct or fix!r} is not a number") from None
    static_fp8 = kind in FP8_NAMES and scope != "token-head"
    if (percentile is not None or fixed is not None or m["trunc"]) and not static_fp8:
        raise _unknown(raw, ":p / :s / :trunc are options of the static fp8 formats only")
    if kind in GGML_FORMATS:
        if scope is not None:
            raise _unknown(raw, f"{kind} has a fixed layout: no @scope")
        return FormatSetting(GGML_FORMATS[kind], rotation)
    if kind in FP8_NAMES:
        fp8 = "e5m2" if kind == "fp8_e5m2" else "e4m3"
        if scope == "token-head":
            if fp8 != "e4m3":
                raise _unknown(raw, "per-token-head fp8 is e4m3 with a dynamic absmax scale")
            return FormatSetting(TokenHeadFormat("fp8"), rotation)
        if scope not in (None, *STATIC_SCOPES):
            raise _unknown(raw, f"fp8 scope {scope!r}")
        return FormatSetting(FP8Format(fp8, scope or "tensor", percentile, fixed, rounding),
                             rotation)
    if kind in ("int8", "int4"):
        if scope not in (None, "token-head"):
            raise _unknown(raw, f"{kind} exists only as a dynamic per-token-head format")
        return FormatSetting(TokenHeadFormat(kind), rotation)
    if kind == DS_MLA.name:  # one latent row: no scale to choose, nothing an engine rotates
        if scope is not None or rot is not None:
            raise _unknown(raw, f"{kind} takes no @scope and no +rot / +norot")
        return FormatSetting(DS_MLA)
    raise _unknown(raw, f"unknown type {kind!r}")


def parse_format_list(text: str | None) -> tuple[FormatSetting, ...]:
    """``"q8_0, q4_0,fp8_e4m3"`` -> settings (``""`` / ``"none"`` -> ``()``), duplicates
    dropped."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    if items in ([], ["none"]):
        return ()
    return tuple(dict.fromkeys(parse_format(s) for s in items))


# -- rotation and the one entry point ---------------------------------------------------------


def engine_rotation(tensor: str, head_dim: int) -> torch.Tensor:
    """The rotation llama.cpp applies to ``tensor`` of a quantized cache of ``head_dim``
    (float32 ``[D, D]``, orthonormal and symmetric; module docstring). Forced rotation of other
    even head_dims uses the key rule for both."""
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
    check_tensor(x)
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
        out = fp8_round_trip(x, scale.to(x.device), fmt.fp8, fmt.rounding)
    elif fmt.family == "ds-mla":
        out = dequantize_ds_mla(*quantize_ds_mla(x))
    else:
        out = dequantize_token_head(*quantize_token_head(x, fmt), fmt, x.shape[-1])
    return rotate_rows(out, r.T) if r is not None else out
