"""Engine settings: the one vocabulary for "what an engine user deploys", read by every command
(``generate --preset`` / ``--compare``, ``compare-axes --formats``) and printed by ``recommend
--target``, so that what one prints the others accept. Names are case-insensitive; their grammar
is ``setting_forms()`` (each form with its allowed values) and ``SETTING_OPTIONS`` (what its
options mean): ``--help``, error messages and docs print that text, never a copy. What each
setting means for its engine: docs/deploy/README.md and the engine's page beside it.

``parse_engine_setting`` reads a name into one of the ``EngineSettingName`` classes;
``setting.name`` writes the canonical spelling back (``parse(s.name) == s``) and
``setting.kvconfig(label)`` is the ``KVConfig`` that simulates it (engine cache types,
``kvlens.quant.cachetypes``, or a kvlens layout), calibrated from a capture by
``kvlens.deploy.presets``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from kvlens.config.blockfloat import (
    BLOCKFLOAT_DTYPES,
    ENGINE_FLAG,
    BlockFloatSetting,
    is_blockfloat,
    number_name,
    skip_layers,
)
from kvlens.config.hqq import HqqSetting
from kvlens.config.quantized_layer import QuantizedLayerSetting
from kvlens.config.schema import KVConfig, LayerKV
from kvlens.errors import ConfigError, is_int
from kvlens.quant import CodebookSpec, QuantSpec, RotationSpec
from kvlens.quant.ds_mla import DS_MLA
from kvlens.quant.formats import parse_format
from kvlens.quant.fp8 import TOKEN_HEAD_KINDS
from kvlens.quant.ggml import GGML_FORMATS

ENGINES = ("llamacpp", "vllm", "sglang", "trtllm", "transformers")
ENGINE_ALIASES = {"llama.cpp": "llamacpp"}

LLAMACPP_FLOAT_TYPES = ("f32", "f16", "bf16")
LLAMACPP_TYPES = (*LLAMACPP_FLOAT_TYPES, *GGML_FORMATS)  # llama.cpp's -ctk/-ctv types

STATIC_FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # fp8 is vLLM's alias of fp8_e4m3
# vLLM's per-token-head dtypes (kvlens shorthand and vLLM's own spelling) -> cache type
PER_TOKEN_HEAD = {**{f"{k}-pth": f"{k}@token-head" for k in TOKEN_HEAD_KINDS},
                  **{f"{k}_per_token_head": f"{k}@token-head" for k in TOKEN_HEAD_KINDS}}
DS_MLA_DTYPE = DS_MLA.name  # vLLM's cache of an MLA model's latent row (kvlens.quant.ds_mla)
CACHE_DTYPES = {"vllm": (*STATIC_FP8_DTYPES, *(f"{k}-pth" for k in TOKEN_HEAD_KINDS)),
                "sglang": ("fp8_e4m3", "fp8_e5m2"),
                "trtllm": ("fp8",)}  # KvCacheConfig(dtype="fp8"): e4m3, one scale per layer
#: the cache types `recommend --target T` measures and searches, by target: llama.cpp's every
#: K x V pair of f16 and each quantized type (f32 and bf16 cost as much as f16 or more and are no
#: more accurate); vLLM's and SGLang's calibrated e4m3, e4m3 and e5m2 at the default scale 1.0
#: and nvfp4 at the default global scale 1.0; vLLM's CPU build's fp8, truncated (it runs no
#: nvfp4); TensorRT-LLM's e4m3 at scale 1.0 (a checkpoint without KV scales) and nvfp4, every
#: layer or mixed per layer (kvlens.deploy.exports)
_GPU_SEARCH_TYPES = ("fp8_e4m3", "fp8_e4m3:s1", "fp8_e5m2:s1", "nvfp4")
SEARCH_TYPES = {"llama.cpp": ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0"),
                "vllm": _GPU_SEARCH_TYPES, "sglang": _GPU_SEARCH_TYPES,
                "vllm:cpu": ("fp8_e4m3:trunc", "fp8_e4m3:s1:trunc", "fp8_e5m2:s1:trunc"),
                "trtllm": ("fp8_e4m3:s1", "nvfp4")}

# vLLM's turboquant_* dtypes: (key bits, value bits, norm correction), vLLM's TQ_PRESETS
# (vllm/model_executor/layers/quantization/turboquant/config.py)
TURBOQUANT_PRESETS = {"turboquant_k8v4": (8, 4, False), "turboquant_4bit_nc": (4, 4, True),
                      "turboquant_k3v4_nc": (3, 4, True), "turboquant_3bit_nc": (3, 3, True)}
TURBOQUANT_TYPES = tuple(TURBOQUANT_PRESETS)
TURBOQUANT_BOUNDARY = 2  # first and last layers vLLM keeps uncompressed (get_boundary_skip_layers)

QUANTO_BITS = (2, 4)
QUANTO_AXES = (0, -1)

_NUMBER = r"[0-9.]+(?:e[+-]?[0-9]+)?"
_OPTION = re.compile(rf"skip=(?P<skip>[0-9]+(?:,[0-9]+)*)|p(?P<percentile>{_NUMBER})"
                     rf"|s(?P<fixed_scale>{_NUMBER})|(?P<cpu>cpu)")


def setting_forms() -> tuple[str, ...]:
    """Every accepted form of an engine setting with its allowed values: the one spelling of
    the grammar that ``--help``, the error messages and the docs print (module docstring)."""
    pth = tuple(f"{k}-pth" for k in TOKEN_HEAD_KINDS)
    return (
        "llamacpp:K/V[:norot|:rot][:nofa][:noarith] (K, V: " + ", ".join(LLAMACPP_TYPES) + ")",
        "llamacpp:T (= llamacpp:T/T)",
        "vllm:D[@head][:pP|:sS][:cpu][:skip=L,L] (D: " + ", ".join(STATIC_FP8_DTYPES) + ")",
        "vllm:D[:skip=L,L] (D: " + ", ".join(pth) + "; also spelled "
        + ", ".join(k for k in PER_TOKEN_HEAD if not k.endswith("-pth")) + ")",
        "vllm:T (T: " + ", ".join(TURBOQUANT_TYPES) + ")",
        f"vllm:{DS_MLA_DTYPE}[:skip=L,L] (MLA models: the latent row, fp8 tiles + bf16 RoPE)",
        "sglang:D[@head][:pP|:sS] (D: " + ", ".join(CACHE_DTYPES["sglang"]) + ")",
        "trtllm:fp8[:pP|:sS]",
        "vllm:nvfp4[:sS][:skip=L,L] (4-bit floats, E4M3 scale per 16 channels)",
        "sglang:D[:sS] (D: " + ", ".join(BLOCKFLOAT_DTYPES["sglang"])
        + "; fp4_e2m1 = fp4_mx_block16; :sS for nvfp4)",
        "trtllm:nvfp4[:sS]",
        *(f"transformers:{c.backend}-B[:axis_key=A][:axis_value=A][:group=G][:residual=R] (B: "
          + ", ".join(map(str, c.bit_widths)) + "; A: " + ", ".join(map(str, c.axes)) + ")"
          for c in TRANSFORMERS_BACKENDS.values()),
    )


#: What each option of ``setting_forms`` means (``--help`` prints it under the forms).
SETTING_OPTIONS = (
    ":norot / :rot: llama.cpp's Hadamard rotation off / forced; :nofa: without flash "
    "attention; :noarith: the model's float attention instead of llama.cpp's CPU arithmetic; "
    "@head: one fp8 scale per KV head; :pP: scales calibrated at percentile P of a capture "
    "(--calibration); :sS: a fixed scale S (:s1 the engines' default); :cpu: vLLM's CPU build, "
    "which truncates to fp8 (no @head); :skip=L,L: layers kept at f16; G: group size; R: "
    "residual tokens. Names are case-insensitive; llama.cpp: is llamacpp:.")


def allowed_settings() -> str:
    """Every accepted form, with its allowed values, on one line (for error messages)."""
    return "; ".join(setting_forms())


def setting_grammar() -> str:
    """The grammar as ``--help`` prints it: one form per line, then what the options mean."""
    return "\n".join(f"  {form}" for form in setting_forms()) + "\n" + SETTING_OPTIONS


def _bad(name: str, why: str) -> ConfigError:
    return ConfigError(f"Unknown engine setting {name!r} ({why}); allowed: {allowed_settings()}.")


# llama.cpp's rotation -> (its name option, its cache-type suffix, its description)
_ROTATION = {"auto": ("", "", ""), "off": (":norot", "+norot", " with LLAMA_ATTN_ROT_DISABLE=1"),
             "on": (":rot", "+rot", " with the rotation forced on")}


# -- the settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppSetting:
    """llama.cpp ``-ctk key -ctv value``. rotation: ``"auto"`` (llama.cpp's rule), ``"off"``
    (``:norot``), ``"on"`` (``:rot``). flash_attention: False for ``:nofa``. arithmetic:
    False for ``:noarith`` (the model's float attention instead of llama.cpp's CPU one)."""

    key: str
    value: str
    rotation: str = "auto"
    flash_attention: bool = True
    arithmetic: bool = True

    engine: ClassVar[str] = "llamacpp"

    def __post_init__(self) -> None:
        for t in (self.key, self.value):
            if t not in LLAMACPP_TYPES:
                raise ConfigError(f"Unknown llama.cpp cache type {t!r}; allowed: "
                                  f"{', '.join(LLAMACPP_TYPES)}.")
        if self.rotation not in _ROTATION:
            raise ConfigError(f"Unknown llama.cpp rotation {self.rotation!r}; allowed: auto, "
                              "off (:norot), on (:rot).")

    @property
    def name(self) -> str:
        return (f"llamacpp:{self.key}/{self.value}{_ROTATION[self.rotation][0]}"
                + ("" if self.flash_attention else ":nofa")
                + ("" if self.arithmetic else ":noarith"))

    @property
    def engine_attention(self) -> str | None:
        """``KVConfig.engine_attention`` of this setting."""
        if not self.arithmetic:
            return None
        return "llamacpp-cpu-fa" if self.flash_attention else "llamacpp-cpu-nofa"

    @property
    def quantized(self) -> tuple[str, ...]:
        return tuple(t for t in (self.key, self.value) if t not in LLAMACPP_FLOAT_TYPES)

    def cache_type(self, t: str) -> str:
        """The ``kvlens.quant.cachetypes`` name type ``t`` is stored as (with the rotation)."""
        if t in LLAMACPP_FLOAT_TYPES:
            return t
        return t + _ROTATION[self.rotation][1]

    def kvconfig(self, label: str) -> KVConfig:
        return KVConfig(label, LayerKV(key_format=self.cache_type(self.key),
                                       value_format=self.cache_type(self.value)),
                        fp_dtype="float16", engine_attention=self.engine_attention,
                        description=f"llama.cpp -ctk {self.key} -ctv {self.value}"
                                    + _ROTATION[self.rotation][2])


@dataclass(frozen=True)
class CacheDtypeSetting:
    """vLLM / SGLang / TensorRT-LLM's ``--kv-cache-dtype dtype``: ``scope`` ``"tensor"`` or
    ``"head"`` (``@head``), ``:pP`` / ``:sS``, ``:skip=`` layers kept at f16 (vLLM); ``cpu``
    (``:cpu``): vLLM's CPU build, whose cache writer truncates to fp8 where the GPU writers
    round to nearest (cache types ``...:trunc``, ``kvlens.quant.fp8``)."""

    engine: str
    dtype: str
    scope: str = "tensor"
    percentile: float | None = None
    fixed_scale: float | None = None
    skip: tuple[int, ...] = field(default=())
    cpu: bool = False

    def __post_init__(self) -> None:
        if self.engine not in CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype settings are vllm, sglang and trtllm, not "
                              f"{self.engine!r}.")
        allowed = CACHE_DTYPES[self.engine]
        if self.dtype not in allowed and not (self.engine == "vllm" and (
                self.dtype in PER_TOKEN_HEAD or self.dtype == DS_MLA_DTYPE)):
            raise ConfigError(f"{self.engine} KV-cache dtypes here are {', '.join(allowed)}"
                              f"{f', {DS_MLA_DTYPE}' if self.engine == 'vllm' else ''}; "
                              f"got {self.dtype!r}.")
        if self.dynamic and (self.scope != "tensor" or self.percentile is not None
                             or self.fixed_scale is not None):
            raise ConfigError(f"per-token-head dtypes and {DS_MLA_DTYPE} take no @scope, :pP "
                              "or :sS (their scales are dynamic).")
        if self.scope not in ("tensor", "head"):
            raise ConfigError(f"scale scope @{self.scope}; allowed: none (per tensor) or @head.")
        if self.scope == "head" and self.engine == "trtllm":
            raise ConfigError("TensorRT-LLM loads one fp8 scale per layer; drop @head.")
        object.__setattr__(self, "skip", skip_layers(self.engine, self.skip))
        # vLLM's CPU attention backend (CPUAttentionBackend): static fp8, one float k_scale /
        # v_scale per layer (_k_scale_float)
        if self.cpu and self.engine != "vllm":
            raise ConfigError(f":cpu is vLLM's CPU build; {self.engine} has no CPU setting here.")
        if self.cpu and self.dtype not in STATIC_FP8_DTYPES:
            raise ConfigError(f"vLLM's CPU build runs {', '.join(STATIC_FP8_DTYPES)} caches "
                              f"(supported_kv_cache_dtypes), not {self.dtype}; drop :cpu.")
        if self.cpu and self.scope == "head":
            raise ConfigError("vLLM's CPU build reads one scale per layer (k_scale, v_scale); "
                              "drop @head.")
        parse_format(self.cache_type(calibrated=True))  # percentile / scale ranges

    @property
    def per_token_head(self) -> bool:
        return self.dtype in PER_TOKEN_HEAD

    @property
    def dynamic(self) -> bool:
        """Scales computed as each token is written: per-token-head and ``fp8_ds_mla``."""
        return self.per_token_head or self.dtype == DS_MLA_DTYPE

    @property
    def calibrates(self) -> bool:
        """Static fp8 whose scales come from a capture when the command has one."""
        return not self.dynamic and self.fixed_scale is None

    @property
    def shared_scale(self) -> bool:
        """One scale per layer (or head) for K and V alike: SGLang's scale file."""
        return self.engine == "sglang"

    @property
    def name(self) -> str:
        out = f"{self.engine}:{self.dtype}" + ("@head" if self.scope == "head" else "")
        if self.percentile is not None:
            out += f":p{number_name(self.percentile)}"
        if self.fixed_scale is not None:
            out += f":s{number_name(self.fixed_scale)}"
        out += ":cpu" if self.cpu else ""  # :skip= stays last (split_setting_list)
        return out + (f":skip={','.join(map(str, self.skip))}" if self.skip else "")

    def cache_type(self, calibrated: bool) -> str:
        """The ``kvlens.quant.cachetypes`` name of every non-skipped layer: with scales
        ``calibrated`` from a capture, else the engine default 1.0 (``:trunc`` on a CPU)."""
        return self._scaled_type(calibrated) + (":trunc" if self.cpu else "")

    def _scaled_type(self, calibrated: bool) -> str:
        if self.per_token_head:
            return PER_TOKEN_HEAD[self.dtype]
        if self.dtype == DS_MLA_DTYPE:
            return DS_MLA_DTYPE
        out = ("fp8_e4m3" if self.dtype == "fp8" else self.dtype) + (
            "@head" if self.scope == "head" else "")
        if self.fixed_scale is not None:
            return out + f":s{number_name(self.fixed_scale)}"
        if not calibrated:
            if self.scope == "head" or self.percentile is not None:
                raise ConfigError(f"{self.name}: calibrated scales (@head, :pP) need a capture: "
                                  "pass --calibration run.h5 (from `kvlens capture`), or drop "
                                  "@head/:pP for the engine default scale 1.0.")
            return out + ":s1"
        return out + ("" if self.percentile is None else f":p{number_name(self.percentile)}")

    def kvconfig(self, label: str, calibrated: bool = False) -> KVConfig:
        fmt = self.cache_type(calibrated)
        return KVConfig(label, LayerKV(key_format=fmt, value_format=fmt),
                        {i: LayerKV(key_format="f16", value_format="f16") for i in self.skip},
                        fp_dtype="float16",
                        description=ENGINE_FLAG[self.engine].format(self.dtype)
                        + (" on vLLM's CPU build (fp8 truncated)" if self.cpu else ""))


@dataclass(frozen=True)
class TurboQuantSetting:
    """vLLM ``--kv-cache-dtype turboquant_*`` (module docstring): ``dtype`` in
    ``TURBOQUANT_TYPES``."""

    dtype: str
    key_bits: int = field(init=False, repr=False, compare=False)  # these three: TQ_PRESETS
    value_bits: int = field(init=False, repr=False, compare=False)
    norm_correction: bool = field(init=False, repr=False, compare=False)

    engine: ClassVar[str] = "vllm"

    def __post_init__(self) -> None:
        if self.dtype not in TURBOQUANT_TYPES:
            raise ConfigError(f"Unknown vLLM TurboQuant dtype {self.dtype!r}; allowed: "
                              f"{', '.join(TURBOQUANT_TYPES)}.")
        for name, x in zip(("key_bits", "value_bits", "norm_correction"),
                           TURBOQUANT_PRESETS[self.dtype]):
            object.__setattr__(self, name, x)

    @property
    def name(self) -> str:
        return f"vllm:{self.dtype}"

    @staticmethod
    def boundary_layers(num_layers: int, hybrid: bool = False) -> tuple[int, ...]:
        """The layers vLLM keeps uncompressed: the first and last ``TURBOQUANT_BOUNDARY``, at most
        ``num_layers // 2`` on each side (``get_boundary_skip_layers``); none in a ``hybrid``
        model (Mamba or linear attention beside attention: vLLM PR #39931)."""
        if not is_int(num_layers, 1):
            raise ConfigError(f"Invalid num_layers {num_layers!r}; allowed: an integer >= 1.")
        if hybrid:
            return ()
        n = min(TURBOQUANT_BOUNDARY, num_layers // 2)
        return tuple(sorted({*range(n), *range(num_layers - n, num_layers)}))

    @property
    def fp8_keys(self) -> bool:
        """``turboquant_k8v4``: keys cast to fp8 e4m3 with no scale, not rotated (no codebook)."""
        return self.key_bits == 8

    def kvconfig(self, label: str, num_layers: int, hybrid: bool = False) -> KVConfig:
        """Keys coded (``k8v4``: the unquantized key store at ``fp_dtype`` float8_e4m3fn),
        values per-token min-max, no window; the boundary layers at float16 (``k8v4``: as
        ``f16`` engine layers, since its ``fp_dtype`` is fp8)."""
        value = QuantSpec(self.value_bits, "per-token")  # one scale and zero per vector
        if self.fp8_keys:
            key, fp, exact = None, "float8_e4m3fn", LayerKV(key_format="f16", value_format="f16")
        else:
            key = CodebookSpec(self.key_bits, "lloyd-max-normal", RotationSpec(),
                               renormalize=self.norm_correction)
            fp, exact = "float16", LayerKV()
        return KVConfig(label, LayerKV(key, value),
                        {i: exact for i in self.boundary_layers(num_layers, hybrid)},
                        fp_dtype=fp, scale_dtype="float16",
                        write_before_attention=True,
                        description=f"vllm --kv-cache-dtype {self.dtype}")


@dataclass(frozen=True)
class QuantoSetting(QuantizedLayerSetting):
    """transformers ``QuantizedCache(backend="quanto", ...)`` (``QuantizedLayerSetting``)."""

    backend: ClassVar[str] = "quanto"
    bit_widths: ClassVar[tuple[int, ...]] = QUANTO_BITS
    axes: ClassVar[tuple[int, ...]] = QUANTO_AXES
    granularity: ClassVar[dict[int, str]] = {0: "per-token", -1: "per-channel"}


EngineSettingName = (LlamaCppSetting | CacheDtypeSetting | TurboQuantSetting | BlockFloatSetting
                     | QuantoSetting | HqqSetting)
#: transformers' QuantizedCache backends, by the name a setting gives (``transformers:hqq-4``)
TRANSFORMERS_BACKENDS = {c.backend: c for c in (QuantoSetting, HqqSetting)}


# -- parsing --------------------------------------------------------------------------------------


def is_engine_setting(name: str) -> bool:
    """``ENGINE:...`` that is not a config file (an unknown engine is then refused by
    ``parse_engine_setting`` with the list)."""
    head = name.split(":", 1)[0].strip()
    return (":" in name and (head.isidentifier() or head.lower() in ENGINE_ALIASES)
            and not (name.endswith(".json") or Path(name).is_file()))


def split_setting_list(text: str | None) -> list[str]:
    """A comma-separated list of settings (and preset names or files) -> the items, keeping the
    commas of a ``:skip=L,L`` list inside its setting (``vllm:fp8:skip=0,2,q8`` -> two)."""
    out: list[str] = []
    for piece in (p.strip() for p in (text or "").split(",")):
        if out and piece.isdigit() and re.search(r":skip=[0-9,]*[0-9]$", out[-1]):
            out[-1] += "," + piece
        elif piece:
            out.append(piece)
    return out


def parse_engine_setting(name: str) -> EngineSettingName:
    """The setting ``name`` spells (module docstring); anything else raises ``ConfigError``
    with the allowed forms."""
    if not isinstance(name, str):
        raise ConfigError(f"An engine setting is a string such as llamacpp:q8_0, got {name!r}.")
    engine, _, rest = name.strip().partition(":")
    engine = ENGINE_ALIASES.get(engine.lower(), engine.lower())
    if engine not in ENGINES:
        raise _bad(name, f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    parts = rest.strip().lower().split(":")
    if not parts[0]:
        raise _bad(name, "no cache type after the engine")
    try:
        if engine == "llamacpp":
            return _llamacpp(parts)
        if engine in ("vllm", "sglang", "trtllm"):
            return _cache_dtype(engine, parts)
        backend = TRANSFORMERS_BACKENDS.get(parts[0].split("-")[0])
        if backend is None:
            raise ConfigError("transformers settings are quanto-B (QuantizedCache, quanto "
                              "backend) and hqq-B (HQQ backend)")
        return backend.parse(parts)
    except ConfigError as exc:  # what the parsers and the settings refuse, with the forms
        raise _bad(name, str(exc).rstrip(".")) from None


def _llamacpp(parts: list[str]) -> LlamaCppSetting:
    types = parts[0].split("/")
    if len(types) == 1:
        types = types * 2
    if len(types) != 2:  # LlamaCppSetting refuses an unknown type
        raise ConfigError(f"llama.cpp cache types are {', '.join(LLAMACPP_TYPES)}, as K/V or one "
                          "type for both")
    opts = parts[1:]
    if set(opts) - {"norot", "rot", "nofa", "noarith"} or len(set(opts)) != len(opts):
        raise ConfigError(f"llama.cpp options are :norot, :nofa and :noarith (and :rot to force "
                          f"the rotation), each once, got {opts}")
    if "norot" in opts and "rot" in opts:
        raise ConfigError(":norot and :rot contradict each other")
    rotation = "off" if "norot" in opts else "on" if "rot" in opts else "auto"
    return LlamaCppSetting(types[0], types[1], rotation, "nofa" not in opts,
                           "noarith" not in opts)


def _cache_dtype(engine: str, parts: list[str]
                 ) -> CacheDtypeSetting | TurboQuantSetting | BlockFloatSetting:
    if engine == "vllm" and parts[0].startswith("turboquant"):
        if len(parts) > 1:
            raise ConfigError(f"vLLM TurboQuant dtypes take no options, got {parts[1:]}")
        return TurboQuantSetting(parts[0])
    dtype, at, scope = parts[0].partition("@")
    kw: dict = {}
    for opt in parts[1:]:
        m = _OPTION.fullmatch(opt)
        key = m.lastgroup if m else None
        if key is None or key in kw or (key == "skip" and engine != "vllm"):
            raise ConfigError(f"unknown or repeated option {opt!r} (vllm: :pP or :sS, :cpu, "
                              ":skip=L,L; sglang: :pP or :sS)")
        if key == "cpu":
            kw[key] = True
            continue
        try:
            kw[key] = tuple(map(int, m[key].split(","))) if key == "skip" else float(m[key])
        except ValueError:
            raise ConfigError(f"{opt!r} is not a number") from None
    if "percentile" in kw and "fixed_scale" in kw:
        raise ConfigError("a scale is calibrated (:pP) or fixed (:sS), not both")
    if is_blockfloat(engine, dtype):
        if "cpu" in kw:
            raise ConfigError("vLLM's CPU build runs fp8 caches only (it accepts nvfp4 and "
                              "computes noise: docs/lab-notes/engines-on-cpu.md); drop :cpu")
        if at or "percentile" in kw:
            raise ConfigError("block-float dtypes take no @scope or :pP (their block scales are "
                              "computed as each token is written)")
        return BlockFloatSetting(engine, dtype, kw.get("fixed_scale"), kw.get("skip", ()))
    return CacheDtypeSetting(engine, dtype, scope if at else "tensor", **kw)


# -- one cache type per setting (compare-axes) and the setting of a cache type -------------------


def setting_for_cache_type(cache_type: str, engine: str | None = None,
                           skip: tuple[int, ...] = ()) -> EngineSettingName:
    """The engine setting that stores keys and values in ``cache_type`` (``q4_0+norot``,
    ``fp8_e4m3@head:p99.9``...): llama.cpp for ggml types, vLLM (or ``engine``) for others."""
    setting = parse_format(cache_type)
    fmt = setting.format
    if fmt.family == "ggml":
        return LlamaCppSetting(fmt.name, fmt.name, setting.rotation)
    if setting.rotation != "auto":
        raise ConfigError(f"{cache_type}: no engine rotates an fp8 or per-token-head cache, so "
                          "a forced rotation has no engine setting.")
    if fmt.family == "token-head":
        return CacheDtypeSetting(engine or "vllm", f"{fmt.kind}-pth", skip=skip)
    if fmt.family == DS_MLA.family:
        return CacheDtypeSetting(engine or "vllm", DS_MLA_DTYPE, skip=skip)
    return CacheDtypeSetting(engine or "vllm", f"fp8_{fmt.fp8}", fmt.scope, fmt.percentile,
                             fmt.fixed_scale, skip, cpu=fmt.rounding == "truncate")


def measured_cache_type(setting: EngineSettingName) -> str:
    """The one cache type ``compare-axes --formats`` measures keys and values in for
    ``setting`` (static fp8 calibrated on its capture), or ``ConfigError`` saying why none."""
    name = setting.name
    instead = f"; run generate --compare {name} --eval kld on the model instead."
    if isinstance(setting, (QuantoSetting, HqqSetting)):
        raise ConfigError(f"{name} is a kvlens layout, not an engine cache type: compare-axes "
                          "sweeps it with --bits and --group-sizes (axis 0 = per-token, "
                          "-1 = per-channel).")
    if isinstance(setting, LlamaCppSetting):
        if setting.key != setting.value:
            raise ConfigError(f"{name}: compare-axes measures one type on keys and values; "
                              f"give each type once (llamacpp:{setting.key}, "
                              f"llamacpp:{setting.value}).")
        if not setting.quantized:
            raise ConfigError(f"{name} keeps keys and values unquantized; nothing to measure.")
        return setting.cache_type(setting.key)
    if isinstance(setting, BlockFloatSetting):
        raise ConfigError(f"{name} is a kvlens storage layout, not an engine cache type: "
                          "compare-axes does not sweep it" + instead)
    if isinstance(setting, TurboQuantSetting):
        raise ConfigError(f"{name} is not one cache type: it codes keys with a codebook and "
                          "values with per-token integers and keeps the boundary layers exact, "
                          "which compare-axes does not model" + instead)
    if setting.dtype == DS_MLA_DTYPE:
        raise ConfigError(f"{name} stores an MLA model's latent row, which compare-axes does "
                          "not measure" + instead)
    if setting.shared_scale and setting.calibrates:
        raise ConfigError(f"{name}: SGLang shares one scale between keys and values, which "
                          "compare-axes does not model (it calibrates each tensor); measure "
                          f"{replace(setting, engine='vllm').name} instead.")
    if setting.skip:
        raise ConfigError(f"{name}: compare-axes measures every layer; drop :skip=.")
    return setting.cache_type(calibrated=True)


def measured_cache_types(text: str | None) -> tuple[str, ...]:
    """``compare-axes --formats``: comma-separated engine settings -> the cache types to sweep
    (``measured_cache_type``; ``""`` / ``"none"`` -> none)."""
    items = split_setting_list(text)
    if items in ([], ["none"]):
        return ()
    out = []
    for item in items:
        head = item.split(":", 1)[0].strip().lower()
        if ":" not in item or head not in (*ENGINES, *ENGINE_ALIASES):
            _refuse_cache_type(item)
        out.append(measured_cache_type(parse_engine_setting(item)))
    return tuple(dict.fromkeys(out))


def _refuse_cache_type(item: str) -> None:
    """Raise the error for ``item``, not an engine setting: a bare cache-type name gets the
    engine setting to write, anything else the allowed forms."""
    try:
        parse_format(item)
    except ConfigError:
        parse_engine_setting(item)  # not a cache type either: raises with the allowed forms
    why = ("--formats takes engine settings, the spelling generate --compare and recommend "
           "--target use")
    try:
        setting = setting_for_cache_type(item)
    except ConfigError as exc:
        raise ConfigError(f"{why}: {exc}") from None
    spelled = setting.name
    if isinstance(setting, LlamaCppSetting):  # one type for K and V: llamacpp:T
        spelled = spelled.replace(f"{setting.key}/{setting.key}", setting.key, 1)
    raise ConfigError(f"{why}: write {spelled} for {item}.")
