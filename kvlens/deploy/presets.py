"""Engine settings as kvlens configs, calibrated and explained: ``engine_config(name)`` turns a
setting an engine user would deploy (``llamacpp:q8_0/q4_0``, ``vllm:fp8_e4m3``, ...; the
vocabulary is ``kvlens.config.engine``) into a ``KVConfig`` plus notes to print: static fp8
scales calibrated from a capture (``calibrate_from_capture``), and what the user should read
(llama.cpp's flash-attention and rotation rules, vLLM's per-head scales, the int4 stand-in,
how a simulation differs from the engine's own code).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvlens.capture.store import open_capture
from kvlens.config import KVConfig
from kvlens.config.blockfloat import BlockFloatSetting
from kvlens.config.engine import (
    TURBOQUANT_BOUNDARY,
    CacheDtypeSetting,
    LlamaCppSetting,
    QuantoSetting,
    TurboQuantSetting,
    parse_engine_setting,
)
from kvlens.config.hqq import HqqSetting
from kvlens.quant.cachetypes import needs_scales
from kvlens.quant.formats import engine_rotation
from kvlens.quant.fp4 import E4M3_MAX
from kvlens.quant.fp8 import calibrate_scale

#: a calibrated NVFP4 global scale is ``absmax / NVFP4_SCALE_BOUND``: ModelOpt's KV scale, the same
#: definition as its fp8 scale (``kv_cache_max_bound``), which the engines read from a checkpoint
NVFP4_SCALE_BOUND = E4M3_MAX

TRANSFORMERS_DIFFERENCES = (
    "transformers' QuantizedCache keeps the prompt's own attention exact and quantizes the whole "
    "prompt at once, then re-quantizes the whole history (dequantized) whenever its window "
    "fills; kvlens quantizes each window block once (hqq's axis=0: the whole history again, as "
    "transformers does) and keeps fewer than R tokens exact. "
    "quanto's axis=-1 groups run over the flattened batch x heads x tokens rows; kvlens groups "
    "tokens of one head.")


@dataclass(frozen=True)
class EngineSetting:
    """A parsed setting: the engine, the config to simulate it and what to print.
    ``per_model``: the config depends on the model's layer count (vLLM TurboQuant's boundary
    layers): rebuild it with ``engine_config(name, num_layers=L)`` once the model is known."""

    engine: str
    config: KVConfig
    notes: tuple[str, ...]
    per_model: bool = False


def engine_config(name: str, calibration: str | None = None,
                  num_layers: int | None = None, hybrid: bool = False) -> EngineSetting:
    """The ``EngineSetting`` for ``name``; ``calibration``: a capture file for static scales;
    ``num_layers`` and ``hybrid`` (some layers hold no KV cache): the model's, which a
    TurboQuant setting's config depends on (``EngineSetting.per_model``)."""
    setting = parse_engine_setting(name)
    if isinstance(setting, TurboQuantSetting):
        return _turboquant(name, setting, num_layers, hybrid)
    if isinstance(setting, LlamaCppSetting):
        return EngineSetting(setting.engine, setting.kvconfig(name), _llamacpp_notes(name, setting))
    if isinstance(setting, (QuantoSetting, HqqSetting)):
        notes = (f"{name}: simulated as a kvlens layout. {TRANSFORMERS_DIFFERENCES}",)
        return EngineSetting(setting.engine, setting.kvconfig(name), notes)
    if isinstance(setting, BlockFloatSetting):
        return _blockfloat(name, setting, calibration)
    return _cache_dtype(name, setting, calibration)


def _blockfloat(raw: str, s: BlockFloatSetting, calibration: str | None) -> EngineSetting:
    """NVFP4's global scales: calibrated per layer from a capture (``absmax / 448`` of the
    layer's keys, and of its values, as ModelOpt writes them into a checkpoint's ``k_scale`` /
    ``v_scale``) when the command has one and no ``:sS``, else 1.0 (or ``S``)."""
    if not (s.calibrates and calibration is not None):
        notes = ((f"{raw}: NVFP4 global scales of 1.0 (the engines' default without "
                  "checkpoint k_scale/v_scale); pass --calibration run.h5 for absmax "
                  "scales."),) if s.calibrates else ()
        return EngineSetting(s.engine, s.kvconfig(raw), notes)
    scales = {}
    with open_capture(calibration) as cap:
        for idx in cap.layers:
            k, v = (float(cap.layer(idx).read(t).abs().max()) / NVFP4_SCALE_BOUND for t in "kv")
            scales[idx] = (k or 1.0, v or 1.0)
    note = (f"{raw}: NVFP4 global scales calibrated from {calibration} (per layer, absmax / "
            f"{NVFP4_SCALE_BOUND:g}, keys and values apart, as ModelOpt writes them).")
    return EngineSetting(s.engine, s.kvconfig(raw, scales), (note,))


def _llamacpp_notes(raw: str, s: LlamaCppSetting) -> tuple[str, ...]:
    notes = []
    if s.value in s.quantized:
        if not s.flash_attention:
            notes.append(f"{raw}: llama.cpp refuses a quantized V cache ({s.value}) without "
                         "flash attention (-fa off); simulated anyway: the cache is read the "
                         "same way (dequantize, then the weighted sum).")
        else:
            notes.append(f"{raw}: a quantized V cache needs flash attention in llama.cpp "
                         "(-fa on, or -fa auto which enables it).")
    if s.quantized and s.rotation == "auto":
        notes.append(f"{raw}: llama.cpp rotates each quantized cache type when head_dim is a "
                     "multiple of 64 (simulated; LLAMA_ATTN_ROT_DISABLE=1 = :norot).")
    if s.quantized and s.rotation == "on":
        notes.append(f"{raw}: the rotation is forced on for every head_dim (a what-if: "
                     "llama.cpp rotates only when head_dim is a multiple of 64).")
    return tuple(notes)


TURBOQUANT_DIFFERENCES = (
    "attention in the model's float precision over the coded cache (or kvlens' fused decode "
    "kernel with --backend triton), not vLLM's Triton decode kernel (nor its fp16 "
    "dequantize-then-flash-attention path for chunks over 128 tokens); "
    "as in vLLM, a first forward attends exact and every later one reads its own tokens back "
    "compressed. docs/deploy/vllm.md.")


def _turboquant(raw: str, s: TurboQuantSetting, num_layers: int | None,
                hybrid: bool = False) -> EngineSetting:
    if num_layers is None:  # every layer coded until the model (its layer count) is known
        cfg = replace(s.kvconfig(raw, 1), layers={})
        where = "resolved when the model is loaded"
    else:
        cfg = s.kvconfig(raw, num_layers, hybrid)
        where = f"layers {', '.join(map(str, s.boundary_layers(num_layers, hybrid))) or 'none'}"
    keys = "keys cast to fp8 e4m3 (no scale, not rotated)" if s.fp8_keys else (
        f"keys {s.key_bits}-bit Lloyd-Max codes of the Hadamard-rotated normalised key plus an "
        f"fp16 norm{' (centroids renormalised)' if s.norm_correction else ''}")
    note = (f"{raw}: {keys}, values {s.value_bits}-bit min-max per token (fp16 scale and "
            f"zero); the first and last {TURBOQUANT_BOUNDARY} layers exact ({where}). "
            "Differences: " + TURBOQUANT_DIFFERENCES)
    return EngineSetting(s.engine, cfg, (note,), per_model=True)


def _cache_dtype(raw: str, s: CacheDtypeSetting, calibration: str | None) -> EngineSetting:
    notes = []
    if s.per_token_head and s.dtype.startswith("int4"):
        notes.append(f"{raw}: vLLM's int4_per_token_head is a non-uniform codebook format; "
                     "kvlens simulates a uniform int4 per token and head instead.")
    if s.scope == "head" and s.engine == "sglang":
        notes.append(f"{raw}: SGLang loads one scale per layer (--quantization-param-path); "
                     "per-head scales are simulated anyway, SGLang cannot run them.")
    elif s.scope == "head":
        notes.append(f"{raw}: vLLM applies per-head scales only with its Flash Attention "
                     "backend and llm-compressor's calibration (vLLM docs).")
    calibrated = calibration is not None and s.calibrates
    cfg = s.kvconfig(raw, calibrated=calibration is not None)
    if s.calibrates and calibration is None:
        notes.append(f"{raw}: static fp8 scales of 1.0 (the {s.engine} default without "
                     "calibrated scales); pass --calibration run.h5 for absmax scales.")
    if calibrated:
        cfg = replace(cfg, kv_scales=calibrate_from_capture(calibration, cfg, s.shared_scale))
        notes.append(f"{raw}: static fp8 scales calibrated from {calibration} "
                     f"({'per KV head' if s.scope == 'head' else 'per layer'}"
                     f"{', one for K and V' if s.shared_scale else ''}, "
                     f"{'absmax' if s.percentile is None else f'p{s.percentile:g}'}).")
    return EngineSetting(s.engine, cfg, tuple(notes))


def calibrate_from_capture(path: str, config: KVConfig, shared: bool = False
                           ) -> dict[int, dict[str, tuple[float, ...]]]:
    """Static fp8 scales of every engine layer of ``config`` that needs them, from the post-RoPE
    keys and values of a capture (``static_scales``)."""
    out: dict[int, dict[str, tuple[float, ...]]] = {}
    with open_capture(path) as cap:
        for idx in cap.layers:
            layer = config.layer(idx)
            types = {"key": layer.key_type, "value": layer.value_type} if layer.engine else {}
            if any(map(needs_scales, types.values())):
                kv = {"key": cap.layer(idx).read("k"), "value": cap.layer(idx).read("v")}
                out[idx] = {t: tuple(x.flatten().tolist())
                            for t, x in static_scales(kv, types, shared).items()}
    return out


def static_scales(kv: dict, types: dict, shared: bool = False) -> dict:
    """``{tensor: scale}`` of each of ``kv``'s tensors (``"key"`` / ``"value"``, ``[B, H, T,
    D]``) whose cache type in ``types`` is static fp8 (``kvlens.quant.fp8.calibrate_scale``, in
    the engine's rotated basis where the type rotates). ``shared``: one scale for K and V alike,
    the larger of the two (SGLang's scale file)."""
    import torch

    out = {}
    for tensor, ct in types.items():
        if needs_scales(ct):
            x = kv[tensor]
            if ct.rotates(x.shape[-1]):
                x = x @ engine_rotation(tensor, x.shape[-1])
            out[tensor] = calibrate_scale(x, ct.format)
    if shared and len(out) == 2:
        out = dict.fromkeys(out, torch.maximum(out["key"], out["value"]))
    return out
