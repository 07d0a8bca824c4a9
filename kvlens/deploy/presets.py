"""Engine settings as kvlens configs: ``llamacpp:q8_0/q4_0``, ``vllm:fp8_e4m3``, ...

``engine_config(name, calibration=None)`` turns a setting an engine user would deploy into a
``KVConfig`` (engine-format layers, ``kvlens.cache.engine``, or for transformers a kvlens
layout) plus notes to print. Names (case-insensitive)::

    llamacpp:K/V[:norot][:nofa]   K, V in f32 f16 bf16 q8_0 q4_0 q4_1 iq4_nl q5_0 q5_1
    llamacpp:T                    = llamacpp:T/T (-ctk T -ctv T)
    vllm:D[@head][:pP][:skip=0,23]   D in fp8 fp8_e4m3 fp8_e5m2 (static scales),
                                  int8-pth int4-pth fp8-pth (per-token-head, dynamic)
    sglang:D[:pP]                 D in fp8_e4m3 fp8_e5m2 (static per-tensor scales)
    transformers:quanto-B[:axis_key=A][:axis_value=A][:group=G][:residual=R]   B in 2 4

- llama.cpp: one K type and one V type for every layer; the rotation follows llama.cpp's rule
  (``:norot`` = ``LLAMA_ATTN_ROT_DISABLE=1``). A quantized V needs flash attention in
  llama.cpp (``-fa on``; ``auto`` turns it on); ``:nofa`` declares a run without it: simulated
  anyway (the cache reads the same), with a note that llama.cpp refuses it.
- vLLM / SGLang static fp8: scales per layer (``@head``: per KV head, as llm-compressor
  calibrates) from ``calibration`` (a capture file: ``absmax / fp8_max`` over its tokens, or the
  ``:pP`` percentile); without one the engine default scale 1.0 (vLLM and SGLang load 1.0 when
  the checkpoint carries no scales and ``calculate_kv_scales`` is off). ``@head`` needs a
  capture. ``:skip=`` keeps those layers at f16 (``--kv-cache-dtype-skip-layers``).
- transformers ``QuantizedCache`` (quanto backend; its defaults nbits 4, axis 0, group 64,
  residual 128): ``axis=0`` groups ``G`` consecutive channels of one token (kvlens per-token
  ``G``), ``axis=-1`` groups ``G`` tokens of one channel (per-channel ``G``); the residual window
  is kvlens's ``R`` with whole-window flushes. It is a kvlens layout, not transformers' code:
  see ``TRANSFORMERS_DIFFERENCES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvlens.capture.store import open_capture
from kvlens.config import KVConfig, LayerKV
from kvlens.errors import ConfigError
from kvlens.quant import QuantSpec
from kvlens.quant.cachetypes import needs_scales
from kvlens.quant.formats import calibrate_scale, engine_rotation

ENGINES = ("llamacpp", "vllm", "sglang", "transformers")
LLAMACPP_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
VLLM_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8-pth", "int4-pth", "fp8-pth")
SGLANG_DTYPES = ("fp8_e4m3", "fp8_e5m2")
QUANTO_BITS = (2, 4)
QUANTO_AXES = (0, -1)
_PTH = {"int8-pth": "int8@token-head", "int4-pth": "int4@token-head",
        "fp8-pth": "fp8@token-head", "int8_per_token_head": "int8@token-head",
        "int4_per_token_head": "int4@token-head", "fp8_per_token_head": "fp8@token-head"}
TRANSFORMERS_DIFFERENCES = (
    "transformers' QuantizedCache keeps the prompt's own attention exact and quantizes the whole "
    "prompt at once, then re-quantizes the whole history (dequantized) whenever its window "
    "fills; kvlens quantizes each window block once and keeps fewer than R tokens exact. "
    "quanto's axis=-1 groups run over the flattened batch x heads x tokens rows; kvlens groups "
    "tokens of one head.")


@dataclass(frozen=True)
class EngineSetting:
    """A parsed setting: the engine, the config to simulate it and what to print."""

    engine: str
    config: object  # kvlens.config.KVConfig
    notes: tuple[str, ...]


def is_engine_setting(name: str) -> bool:
    """``ENGINE:...`` that is not a config file (unknown engines are refused by
    ``engine_config`` with the list)."""
    from pathlib import Path

    head = name.split(":", 1)[0].strip()
    return (":" in name and (head.isidentifier() or head.lower() == "llama.cpp")
            and not (name.endswith(".json") or Path(name).is_file()))


def allowed_settings() -> str:
    return ("llamacpp:K/V[:norot][:nofa] (K, V: " + ", ".join(LLAMACPP_TYPES) + "), "
            "vllm:D[@head][:pP][:skip=L,L] (D: " + ", ".join(VLLM_DTYPES) + "), "
            "sglang:D[:pP] (D: " + ", ".join(SGLANG_DTYPES) + "), "
            "transformers:quanto-B[:axis_key=A][:axis_value=A][:group=G][:residual=R] "
            "(B: 2, 4; A: 0, -1)")


def _bad(name: str, why: str) -> ConfigError:
    return ConfigError(f"Unknown engine setting {name!r} ({why}); allowed: {allowed_settings()}.")


def engine_config(name: str, calibration: str | None = None) -> EngineSetting:
    """The ``EngineSetting`` for ``name`` (module docstring); ``calibration``: a capture file
    for static fp8 scales. Unknown engines, types or options raise ``ConfigError`` with the
    allowed values."""
    raw = name
    engine, _, rest = name.strip().partition(":")
    engine = engine.lower()
    if engine == "llama.cpp":
        engine = "llamacpp"
    if engine not in ENGINES:
        raise _bad(raw, f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    parts = [p for p in rest.strip().lower().split(":")]
    if not parts or not parts[0]:
        raise _bad(raw, "no cache type after the engine")
    if engine == "llamacpp":
        return _llamacpp(raw, parts)
    if engine in ("vllm", "sglang"):
        return _static_or_pth(raw, engine, parts, calibration)
    return _transformers(raw, parts)


def _llamacpp(raw: str, parts: list[str]) -> EngineSetting:

    types = parts[0].split("/")
    if len(types) == 1:
        types = types * 2
    if len(types) != 2 or any(t not in LLAMACPP_TYPES for t in types):
        raise _bad(raw, f"llama.cpp cache types are {', '.join(LLAMACPP_TYPES)}, as K/V or one "
                        "type for both")
    opts = set(parts[1:])
    if opts - {"norot", "nofa"}:
        raise _bad(raw, f"llama.cpp options are :norot and :nofa, got {sorted(opts)}")
    k, v = types
    quantized = [t for t in types if t not in ("f32", "f16", "bf16")]
    suffix = "+norot" if "norot" in opts else ""
    kf = k + (suffix if k in quantized else "")
    vf = v + (suffix if v in quantized else "")
    notes = []
    if v not in ("f32", "f16", "bf16"):
        if "nofa" in opts:
            notes.append(f"{raw}: llama.cpp refuses a quantized V cache ({v}) without flash "
                         "attention (-fa off); simulated anyway: the cache is read the same way "
                         "(dequantize, then the weighted sum).")
        else:
            notes.append(f"{raw}: a quantized V cache needs flash attention in llama.cpp "
                         "(-fa on, or -fa auto which enables it).")
    if quantized and "norot" not in opts:
        notes.append(f"{raw}: llama.cpp rotates each quantized cache type when head_dim is a "
                     "multiple of 64 (simulated; LLAMA_ATTN_ROT_DISABLE=1 = :norot).")
    cfg = KVConfig(raw, LayerKV(key_format=kf, value_format=vf), fp_dtype="float16",
                   description=f"llama.cpp -ctk {k} -ctv {v}"
                               + (" with LLAMA_ATTN_ROT_DISABLE=1" if suffix else ""))
    return EngineSetting("llamacpp", cfg, tuple(notes))


def _static_or_pth(raw: str, engine: str, parts: list[str], calibration: str | None
                   ) -> EngineSetting:
    from dataclasses import replace


    dtype, _, scope = parts[0].partition("@")
    allowed = VLLM_DTYPES if engine == "vllm" else SGLANG_DTYPES
    if dtype not in allowed and not (engine == "vllm" and dtype in _PTH):
        raise _bad(raw, f"{engine} KV-cache dtypes here are {', '.join(allowed)}")
    skip: tuple[int, ...] = ()
    pct = None
    for opt in parts[1:]:
        m = re.fullmatch(r"skip=([0-9,]+)", opt)
        if m and engine == "vllm":
            skip = tuple(sorted({int(x) for x in m[1].split(",") if x}))
        elif re.fullmatch(r"p[0-9.]+", opt):
            pct = opt
        else:
            raise _bad(raw, f"unknown option {opt!r} (vllm: :pP, :skip=L,L; sglang: :pP)")
    notes = []
    if dtype in _PTH:
        if scope or pct:
            raise _bad(raw, "per-token-head dtypes take no @scope or :pP (dynamic scales)")
        fmt = _PTH[dtype]
        if dtype.startswith("int4"):
            notes.append(f"{raw}: vLLM's int4_per_token_head is a non-uniform codebook format; "
                         "kvlens simulates a uniform int4 per token and head instead.")
    else:
        if scope not in ("", "head"):
            raise _bad(raw, f"scale scope @{scope}; allowed: none (per tensor) or @head")
        if engine == "sglang" and scope:
            notes.append(f"{raw}: SGLang loads one scale per layer (--quantization-param-path); "
                         "per-head scales are simulated anyway, SGLang cannot run them.")
        elif scope:
            notes.append(f"{raw}: vLLM applies per-head scales only with its Flash Attention "
                         "backend and llm-compressor's calibration (vLLM docs).")
        base = "fp8_e4m3" if dtype == "fp8" else dtype
        fmt = base + ("@head" if scope else "")
        if calibration is None:
            if scope or pct:
                raise ConfigError(f"{raw}: calibrated scales (@head, :pP) need a capture: pass "
                                  "--calibration run.h5 (from `kvlens capture`), or drop @head/:pP "
                                  "for the engine default scale 1.0.")
            fmt += ":s1"
            notes.append(f"{raw}: static fp8 scales of 1.0 (the {engine} default without "
                         "calibrated scales); pass --calibration run.h5 for absmax scales.")
        elif pct:
            fmt += ":" + pct
    cfg = KVConfig(raw, LayerKV(key_format=fmt, value_format=fmt), fp_dtype="float16",
                   description=f"{engine} --kv-cache-dtype {dtype}")
    if skip:
        cfg = replace(cfg, layers={i: LayerKV(key_format="f16", value_format="f16")
                                   for i in skip})
    if calibration is not None and ":s" not in fmt and "@token-head" not in fmt:
        cfg = replace(cfg, kv_scales=calibrate_from_capture(calibration, cfg))
        notes.append(f"{raw}: static fp8 scales calibrated from {calibration} "
                     f"({'per KV head' if scope else 'per layer'}, "
                     f"{pct or 'absmax'}).")
    return EngineSetting(engine, cfg, tuple(notes))


def calibrate_from_capture(path: str, config) -> dict[int, dict[str, tuple[float, ...]]]:
    """Static fp8 scales of every engine layer of ``config`` that needs them, from the post-RoPE
    keys and values of a capture (``kvlens.quant.formats.calibrate_scale``)."""

    out: dict[int, dict[str, tuple[float, ...]]] = {}
    with open_capture(path) as cap:
        for idx in cap.layers:
            layer = config.layer(idx)
            if not layer.engine:
                continue
            entry = {}
            for tensor, ct, name in (("key", layer.key_type, "k"),
                                     ("value", layer.value_type, "v")):
                if not needs_scales(ct):
                    continue
                x = cap.layer(idx).read(name)
                if ct.rotates(x.shape[-1]):
                    x = x @ engine_rotation(tensor, x.shape[-1])
                entry[tensor] = tuple(calibrate_scale(x, ct.format).flatten().tolist())
            if entry:
                out[idx] = entry
    return out


def _transformers(raw: str, parts: list[str]) -> EngineSetting:

    m = re.fullmatch(r"quanto-([0-9]+)", parts[0])
    if not m or int(m[1]) not in QUANTO_BITS:
        raise _bad(raw, "transformers settings are quanto-2 and quanto-4 (QuantizedCache, "
                        "quanto backend)")
    bits = int(m[1])
    opts = {"axis_key": 0, "axis_value": 0, "group": 64, "residual": 128}
    for opt in parts[1:]:
        key, _, value = opt.partition("=")
        try:
            opts[key] = int(value) if key in opts else None
        except ValueError:
            raise _bad(raw, f"{opt!r} needs an integer value") from None
        if opts.get(key) is None:
            raise _bad(raw, f"unknown option {key!r}; allowed: axis_key, axis_value, group, "
                            "residual")
    for key in ("axis_key", "axis_value"):
        if opts[key] not in QUANTO_AXES:
            raise _bad(raw, f"{key} must be 0 or -1")

    def spec(axis: int) -> QuantSpec:
        return QuantSpec(bits, "per-token" if axis == 0 else "per-channel", opts["group"])

    cfg = KVConfig(raw, LayerKV(spec(opts["axis_key"]), spec(opts["axis_value"]),
                                opts["residual"]), fp_dtype="float16",
                   description=f"transformers QuantizedCache(backend='quanto', nbits={bits}, "
                               f"axis_key={opts['axis_key']}, axis_value={opts['axis_value']}, "
                               f"q_group_size={opts['group']}, "
                               f"residual_length={opts['residual']})")
    note = f"{raw}: simulated as a kvlens layout. {TRANSFORMERS_DIFFERENCES}"
    return EngineSetting("transformers", cfg, (note,))
