"""The ``compare-axes`` sweep: every captured layer read once, every variant of its keys and
values (axis x bits x group size x key stage x transform, and each engine format) built with the
reference quantizers, and the errors attention makes of them measured per head.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from kvlens.analysis.compare.config import (
    AXES,
    EXTRA_VARIANTS,
    PLAIN,
    CompareConfig,
)
from kvlens.analysis.compare.predict import (
    PREDICT,
    PredictChain,
    predictor_info,
    uses_prediction,
)
from kvlens.analysis.compare.records import (
    CompareResult,
    Record,
    format_axis,
    format_group_size,
)
from kvlens.analysis.compare.rope_tables import checked_layer_tables
from kvlens.analysis.compare.summary import format_info, summarize
from kvlens.analysis.metrics import Variant, attention_errors_many
from kvlens.capture.store import open_capture
from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant import (
    CodebookSpec,
    QuantSpec,
    RotationSpec,
    apply_balancer,
    fake_quantize,
    fake_quantize_codebook,
    fit_balancer,
    hadamard_block_size,
    hadamard_rotation,
    key_mean,
    quantize_centered,
    quantize_gear,
    quantize_rotated,
    quantize_with_outliers,
)
from kvlens.quant.formats import fake_quantize_format
from kvlens.rope import apply_rope

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class _VariantKey:
    tensor: str
    axis: str
    bits: int
    group_size: int
    stage: str | None
    variant: str
    format: str | None = None


def compare_axes(
    path: str | os.PathLike,
    config: CompareConfig | None = None,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> CompareResult:
    """Sweep ``config`` over the capture at ``path``, one layer in memory at a time.

    threads: torch intra-op threads while sweeping (restored afterwards; None = leave as is).
    The work is many small element-wise passes, where extra threads mostly wait on each other,
    so one thread is the default (the timing: docs/compare-axes.md#memory-and-time).

    Raises ``CaptureFileError`` for a missing/foreign/incomplete file, ``InputError`` or
    ``ConfigError`` for options that do not fit the capture (group size not dividing head_dim,
    ``rotate`` on an odd head_dim, pre-RoPE on a capture without RoPE or with a RoPE the default
    tables cannot reproduce, layers not captured)."""

    config = config or CompareConfig()
    if threads is not None and not is_int(threads, 1):
        raise ConfigError(f"Invalid threads {threads!r}; allowed: a positive integer.")
    started = time.perf_counter()
    records: list[Record] = []
    with open_capture(path) as cap, torch_threads(threads):
        meta = cap.meta
        layers = _resolve_layers(cap, config)
        _check_fits(meta, config)
        n_samples = (
            meta.num_samples if config.samples is None else min(config.samples, meta.num_samples)
        )
        pre = "pre" in _key_stages(config) or config.codebook_pre_rope
        chain = None
        walk = layers
        if uses_prediction(config):
            # a chain runs through every captured layer up to the last one measured: each
            # layer's prediction reads the previous layer's reconstruction
            chain = PredictChain(config, _rope_ok(meta))
            walk = tuple(i for i in cap.layers if i <= max(layers))
        measured = set(layers)
        with ExitStack() as stack:
            cal = None
            if config.predict_calibration is not None:
                cal = stack.enter_context(open_capture(config.predict_calibration))
                _check_calibration(cal.meta, meta, walk)
            for done, layer in enumerate(walk):
                if progress:
                    progress(done, len(walk), f"layer {layer}")
                data = cap.layer(layer)
                cal_data = None if cal is None else _chain_tensors(cal.layer(layer), chain)
                if layer in measured:
                    records.extend(_layer_records(data, config, meta, slice(0, n_samples),
                                                  pre, chain, cal_data))
                else:
                    chain.advance(layer, *_chain_tensors(data, chain, n_samples),
                                  calibration=cal_data)
        if progress:
            progress(len(walk), len(walk), "done")
    capture_info = {
        "path": str(path),
        "model": meta.model,
        "layers": list(layers),
        "num_attention_heads": meta.num_attention_heads,
        "num_key_value_heads": meta.num_key_value_heads,
        "head_dim": meta.head_dim,
        "samples": n_samples,
        "tokens": meta.num_tokens,
        "storage_dtype": meta.storage_dtype,
    }
    summary = summarize(records)
    shape = (meta.num_key_value_heads, meta.num_tokens, meta.head_dim)
    if config.formats or config.codebooks:
        summary["formats"] = format_info(config, *shape)
    if chain is not None:
        summary["predictors"] = predictor_info(
            meta.num_key_value_heads, meta.num_tokens, meta.head_dim)
        summary["predictors"]["fitted_on"] = (
            "leave one sample out" if config.predict_calibration is None
            else f"every sample of {config.predict_calibration}")
        summary["predictors"]["explained_variance"] = [
            e for e in chain.explained if e["layer"] in measured]
    summary = {
        "config": config.to_dict(),
        "capture": capture_info,
        "seconds": round(time.perf_counter() - started, 3),
        **summary,
    }
    return CompareResult(records, summary, config)


@contextmanager
def torch_threads(threads: int | None):
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _resolve_layers(cap, config: CompareConfig) -> tuple[int, ...]:
    if config.layers is None:
        return tuple(cap.layers)
    for layer in config.layers:
        cap.layer(layer)  # raises InputError listing the captured layers
    return config.layers


def _key_stages(config: CompareConfig) -> tuple[str, ...]:
    return config.stages if "key" in config.tensors else ()


def _check_fits(meta, config: CompareConfig) -> None:

    for g in config.group_sizes:
        QuantSpec(2, "per-token", g).check_fits((meta.num_tokens, meta.head_dim))
    for setting in config.format_settings():
        fmt = setting.format
        if fmt.family == "ggml":
            try:
                fmt.check_fits((meta.num_tokens, meta.head_dim))
            except ConfigError as exc:
                raise ConfigError(
                    f"Format {setting.name!r} does not fit {meta.model or 'this'} capture: {exc}"
                ) from None
        if setting.rotates(meta.head_dim):
            try:
                hadamard_block_size(meta.head_dim)
            except ConfigError as exc:
                raise ConfigError(
                    f"Format {setting.name!r} does not fit {meta.model or 'this'} capture: {exc}"
                ) from None
    if "rotate" in config.variants or config.codebooks:
        try:
            hadamard_block_size(meta.head_dim)
        except ConfigError as exc:
            what = ("Variant 'rotate'" if "rotate" in config.variants
                    else "Codebooks (Hadamard-rotated)")
            raise ConfigError(
                f"{what} does not fit {meta.model or 'this'} capture: {exc}"
            ) from None
    used = meta.num_samples if config.samples is None else min(config.samples, meta.num_samples)
    if uses_prediction(config) and used < 2 and config.predict_calibration is None:
        raise InputError(
            "Variant 'predict' needs at least 2 samples: each sample is predicted by a map "
            f"fitted on the others, and {used} of {meta.model or 'this'} capture's "
            f"{meta.num_samples} are used (or fit on another capture: "
            "--predict-calibration)."
        )
    if "pre" in _key_stages(config) or config.codebook_pre_rope:
        if not _rope_ok(meta):
            raise InputError(
                f"Stage 'pre' needs a capture of a model with RoPE, but {meta.model or 'this'} "
                f"capture has none (rope_layout {meta.rope_layout!r}); its keys have no "
                "pre-RoPE form. Use --stages post."
            )


def _rope_ok(meta) -> bool:
    """Whether the capture's keys have a pre-RoPE form the sweep can use."""
    return bool(meta.has_rope) and meta.rope_layout not in ("none", "", "pending")


def _chain_tensors(layer_data, chain: PredictChain, n_samples: int | None = None):
    """``(k, k_pre or None, v)`` of one layer, as the prediction chain reads them (for a layer
    that is not measured, or the calibration capture's layer)."""
    samples = slice(0, n_samples)
    k = layer_data.read("k", samples)
    k_pre = layer_data.read("k_pre", samples) if chain.rope_ok else None
    return k, k_pre, layer_data.read("v", samples)


def _check_calibration(cal_meta, meta, layers) -> None:
    """The calibration capture must hold the same model's shapes and every chained layer."""
    mine = (meta.num_key_value_heads, meta.head_dim, meta.num_layers, _rope_ok(meta))
    theirs = (cal_meta.num_key_value_heads, cal_meta.head_dim, cal_meta.num_layers,
              _rope_ok(cal_meta))
    if mine != theirs:
        raise InputError(
            f"The predict calibration capture ({cal_meta.model}: KV heads, head_dim, layers, "
            f"pre-RoPE keys {theirs}) does not match the measured one ({meta.model}: {mine})."
        )
    missing = sorted(set(layers) - set(cal_meta.layers))
    if missing:
        raise InputError(
            f"The predict calibration capture lacks layers {missing}; the chain needs every "
            f"layer up to the last measured ({', '.join(map(str, layers))})."
        )


def _layer_records(layer_data, config: CompareConfig, meta, samples: slice,
                   pre: bool, chain: PredictChain | None = None,
                   calibration=None) -> list[Record]:
    import torch

    q = layer_data.read("q", samples)
    k = layer_data.read("k", samples)
    v = layer_data.read("v", samples)
    k_pre = tables = None
    if pre or (chain is not None and chain.rope_ok):
        k_pre = layer_data.read("k_pre", samples)
    if pre:
        tables = checked_layer_tables(k, k_pre, meta, layer_data.index, layer_data.rope())
    predicted = ({} if chain is None
                 else chain.advance(layer_data.index, k, k_pre, v, calibration=calibration))
    keys: list[_VariantKey] = []
    variants: list[Variant] = []
    q_pre = None
    if any(b == "weighted" and "pre" in o for _, b, o in config.codebook_settings()):
        q_pre = layer_data.read("q_pre", samples)
    for key, approx in _approximations(q, k, v, k_pre, tables, config, meta.rope_layout, q_pre,
                                       predicted):
        keys.append(key)
        variants.append(Variant(k_hat=approx) if key.tensor == "key" else Variant(v_hat=approx))
    attrs = layer_data.attrs
    exact = None
    if config.sink_tokens:
        t = k.shape[2]
        exact = (torch.arange(t)[None, :] < config.sink_tokens).expand(t, t)
    errors = attention_errors_many(
        q,
        k,
        v,
        variants,
        scaling=attrs.scaling,
        sliding_window=attrs.sliding_window,
        softcap=attrs.logit_softcap,
        sinks=attrs.sinks,
        exact=exact,
    )
    out: list[Record] = []
    for key, err in zip(keys, errors, strict=True):
        if key.tensor == "key":
            per_metric = {
                "reconstruction": err.key_reconstruction,
                "score": err.scores,
                "attention_weights": err.weights,
                "attention_output": err.output,
            }
        else:
            per_metric = {
                "reconstruction": err.value_reconstruction,
                "attention_output": err.output,
            }
        for metric, values in per_metric.items():
            kind = "kv" if metric == "reconstruction" else "query"
            for head, value in enumerate(values.tolist()):
                out.append(
                    Record(
                        attrs.layer_index,
                        head,
                        key.tensor,
                        key.axis,
                        key.bits,
                        key.group_size,
                        key.stage,
                        key.variant,
                        metric,
                        float(value),
                        kind,
                        key.format,
                    )
                )
    return out


def _approximations(q, k, v, k_pre, tables, config: CompareConfig, layout: str, q_pre=None,
                    predicted=None):
    """Yield ``(_VariantKey, approximation)`` for every variant of one layer: keys as the
    post-RoPE ``[B, Hkv, T, D]`` tensor attention sees, values as themselves. ``predicted``:
    the layer's reconstructions along each ``predict`` chain (``PredictChain.advance``)."""

    transforms = (PLAIN, *config.variants)
    # the same R for every layer and head: it depends only on head_dim and the seed
    rotation = (
        hadamard_rotation(k.shape[-1], config.rotation_seed, k.device)
        if "rotate" in config.variants
        else None
    )
    means = {}
    if "key" in config.tensors and ("center" in config.variants or config.codebooks):
        # one mean key per KV head and stage, from the same layer's capture (in-sample)
        means["post"] = key_mean(k)
        if k_pre is not None:
            means["pre"] = key_mean(k_pre)
    balancer = None
    if "key" in config.tensors and "balancer" in config.variants and "post" in config.stages:
        # MiKV fits the balancer per prompt at prefill: one b per sample, KV head and channel.
        balancer = fit_balancer(q, k, per_sample=True)
    for axis in AXES:
        for bits in config.bits:
            for g in config.group_sizes:
                spec = QuantSpec(bits, axis, g)
                if "key" in config.tensors:
                    for stage in config.stages:
                        for name in transforms:
                            if name == "balancer" and stage == "pre":
                                continue  # q/b . k*b = q . k holds only where k is consumed
                            key = _VariantKey("key", axis, bits, g, stage, name)
                            if name == "center":
                                x = k if stage == "post" else k_pre
                                hat = quantize_centered(
                                    x, means[stage], lambda c, s=spec: fake_quantize(c, s))
                                yield key, (hat if stage == "post" else k.float() + apply_rope(
                                    hat - k_pre.float(), *tables, layout))
                            elif name == PREDICT:
                                hat = predicted[("key", axis, bits, g, stage)]
                                yield key, (hat if stage == "post" else k.float() + apply_rope(
                                    hat - k_pre.float(), *tables, layout))
                            elif name == "balancer":
                                _, kb = apply_balancer(q, k, balancer)
                                scale = balancer.float().unsqueeze(-2)
                                yield key, _transform(kb, spec, PLAIN, config, rotation) / scale
                            elif stage == "post":
                                yield key, _transform(k, spec, name, config, rotation)
                            else:
                                # Quantize before RoPE, re-rotate. RoPE is linear, so adding
                                # the rotated error to the stored k gives exactly
                                # rope(k_pre_hat) up to the fp16 rounding of the stored pair.
                                # "rotate" un-rotates by R^T before RoPE (R and RoPE do not
                                # commute), as quantize_pre_rope(..., rotation=R) does.
                                hat = _transform(k_pre, spec, name, config, rotation)
                                err = apply_rope(hat - k_pre.float(), *tables, layout)
                                yield key, k.float() + err
                if "value" in config.tensors:
                    for name in transforms:
                        # the balancer rescales keys against queries; centering is for keys
                        if name not in ("balancer", "center"):
                            yield (
                                _VariantKey("value", axis, bits, g, None, name),
                                predicted[("value", axis, bits, g)] if name == PREDICT
                                else _transform(v, spec, name, config, rotation),
                            )
    yield from _format_approximations(k, v, config)
    yield from _codebook_approximations(q, k, v, config, means, k_pre, tables, layout, q_pre,
                                        predicted)


def codebook_record_name(bits: int, name: str) -> str:
    """``Record.format`` of a codebook variant, e.g. ``"codebook3:fitted+center"``."""
    return f"codebook{bits}:{name}"


def _codebook_approximations(q, k, v, config: CompareConfig, means, k_pre, tables, layout,
                             q_pre, predicted=None):
    """Codebook layouts (``kvlens.quant.codebook``) at every swept bit width: keys (post-RoPE,
    or with ``+pre`` coded before RoPE and re-rotated as the pre stage; optionally centred by
    the layer's mean key of that stage) and values, in the original basis. Fitted codebooks are
    fitted on the same layer's tensor (in-sample), the weighted one with its queries (pre-RoPE
    queries for ``+pre``); ``weighted``, ``+center`` and ``+pre`` are for keys, so values skip
    them."""

    for name, base, opts in config.codebook_settings():
        for bits in config.bits:
            spec = CodebookSpec(bits, base, rotation_spec(config),
                                renormalize="renorm" in opts)
            for tensor, x in (("key", k), ("value", v)):
                if tensor not in config.tensors:
                    continue
                if tensor == "value" and (base == "weighted" or opts & {"center", "pre"}):
                    continue
                stage = None if tensor == "value" else "pre" if "pre" in opts else "post"
                key = _VariantKey(tensor, "per-vector", bits, x.shape[-1], stage, PLAIN,
                                  codebook_record_name(bits, name))
                if stage == "pre":
                    x = k_pre
                queries = None if base != "weighted" else q_pre if stage == "pre" else q

                def code(c, s=spec, queries=queries):
                    return fake_quantize_codebook(c, s, q=queries)

                if PREDICT in opts:  # along the layout's prediction chain
                    hat = predicted[(tensor, name, bits) + ((stage,) if stage else ())]
                elif "center" in opts:
                    hat = quantize_centered(x, means[stage], code)
                else:
                    hat = code(x)
                if stage == "pre":  # re-rotate, as the pre stage of the integer specs
                    hat = k.float() + apply_rope(hat - k_pre.float(), *tables, layout)
                yield key, hat


def rotation_spec(config: CompareConfig) -> RotationSpec:
    """The codebooks' rotation: the sweep's ``rotation_seed`` (None: plain Hadamard)."""
    return RotationSpec(config.rotation_seed)


def _format_approximations(k, v, config: CompareConfig):
    """Engine formats on post-RoPE keys (what an engine caches) and values, in the original
    basis (a rotating format is un-rotated after reading back). Static fp8 scales come from the
    same layer's captured tensor (``fake_quantize_format`` calibrates on its input)."""

    for setting in config.format_settings():
        fmt = setting.format
        g = format_group_size(fmt, k.shape[-1])
        for tensor, x, stage in (("key", k, "post"), ("value", v, None)):
            if tensor in config.tensors:
                key = _VariantKey(
                    tensor, format_axis(fmt), fmt.code_bits, g, stage, PLAIN, setting.name
                )
                yield key, fake_quantize_format(x.float(), setting, tensor)


def _transform(x, spec, name: str, config: CompareConfig, rotation=None):
    """``x_hat`` in ``x``'s own basis (``rotate`` is un-rotated after dequantizing, so every
    metric, reconstruction included, compares against the original tensor)."""

    if name == PLAIN:
        return fake_quantize(x.float(), spec)
    if name == "outliers":
        return quantize_with_outliers(x, spec, config.outlier_fraction)
    if name == "lowrank":
        return quantize_gear(x, spec, config.rank)
    if name == "rotate":
        return quantize_rotated(x, spec, rotation)
    raise ConfigError(f"Unknown variant {name!r}; allowed: {', '.join((PLAIN,) + EXTRA_VARIANTS)}.")
