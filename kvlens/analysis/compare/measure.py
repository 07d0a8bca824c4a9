"""The ``compare-axes`` sweep: every captured layer read once, every variant of its keys and
values (axis x bits x group size x key stage x transform, and each engine format) built with the
reference quantizers, and the errors attention makes of them measured per head.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

from kvlens.analysis.compare.config import AXES, EXTRA_VARIANTS, PLAIN, CompareConfig
from kvlens.analysis.compare.records import CompareResult, Record, format_axis, format_group_size
from kvlens.analysis.compare.rope_tables import checked_layer_tables
from kvlens.analysis.compare.summary import format_info, summarize
from kvlens.analysis.metrics import Variant, attention_errors_many
from kvlens.capture.store import open_capture
from kvlens.errors import ConfigError, InputError, is_int
from kvlens.layouts import reference
from kvlens.quant import (
    QuantSpec,
    apply_balancer,
    fit_balancer,
    hadamard_block_size,
    hadamard_rotation,
    quantize_rotated,
    quantize_with_outliers,
)
from kvlens.quant.formats import fake_quantize_format
from kvlens.rope import apply_rope

Progress = Callable[[int, int, str], None]


def compare_axes(path: str | os.PathLike, config: CompareConfig | None = None,
                 progress: Progress | None = None, threads: int | None = 1) -> CompareResult:
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
        layers = tuple(cap.layers) if config.layers is None else config.layers
        for layer in config.layers or ():
            cap.layer(layer)  # raises InputError listing the captured layers
        _check_fits(meta, config)
        n_samples = min(config.samples or meta.num_samples, meta.num_samples)
        pre = "pre" in _key_stages(config)
        for done, layer in enumerate(layers):
            if progress:
                progress(done, len(layers), f"layer {layer}")
            records.extend(_layer_records(cap.layer(layer), config, meta, slice(0, n_samples),
                                          pre))
        if progress:
            progress(len(layers), len(layers), "done")
    shape = meta.shape
    capture_info = {"path": str(path), "model": meta.model, "layers": list(layers),
                    "num_attention_heads": shape.num_attention_heads,
                    "num_key_value_heads": shape.num_key_value_heads,
                    "head_dim": shape.head_dim, "samples": n_samples, "tokens": meta.num_tokens,
                    "storage_dtype": meta.storage_dtype}
    summary = summarize(records)
    if config.formats:
        summary["formats"] = format_info(config, shape.num_key_value_heads, meta.num_tokens,
                                         shape.head_dim)
    summary = {"config": config.to_dict(), "capture": capture_info,
               "seconds": round(time.perf_counter() - started, 3), **summary}
    return CompareResult(records, summary)


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


def _key_stages(config: CompareConfig) -> tuple[str, ...]:
    return config.stages if "key" in config.tensors else ()


def _check_fits(meta, config: CompareConfig) -> None:
    head_dim = meta.shape.head_dim
    for g in config.group_sizes:
        QuantSpec(2, "per-token", g).check_fits((meta.num_tokens, head_dim))
    checks = []
    for s in config.format_settings():
        if s.format.family == "ggml":
            checks.append((f"Format {s.name!r}", s.format.check_fits, (meta.num_tokens, head_dim)))
        if s.rotates(head_dim):
            checks.append((f"Format {s.name!r}", hadamard_block_size, head_dim))
    if "rotate" in config.variants:
        checks.append(("Variant 'rotate'", hadamard_block_size, head_dim))
    for what, check, arg in checks:
        try:
            check(arg)
        except ConfigError as exc:
            raise ConfigError(
                f"{what} does not fit {meta.model or 'this'} capture: {exc}") from None
    rope = meta.shape.has_rope and meta.rope_layout not in ("none", "", "pending")
    if "pre" in _key_stages(config) and not rope:  # no pre-RoPE form to quantize
        raise InputError(
            f"Stage 'pre' needs a capture of a model with RoPE, but {meta.model or 'this'} "
            f"capture has none (rope_layout {meta.rope_layout!r}); its keys have no "
            "pre-RoPE form. Use --stages post."
        )


def _layer_records(layer_data, config: CompareConfig, meta, samples: slice,
                   pre: bool) -> list[Record]:
    import torch

    q, k, v = (layer_data.read(name, samples) for name in ("q", "k", "v"))
    k_pre = tables = None
    if pre:
        k_pre = layer_data.read("k_pre", samples)
        tables = checked_layer_tables(k, k_pre, meta, layer_data.index, layer_data.rope())
    keys: list[tuple] = []  # what names a variant: Record's fields from tensor to variant, format
    variants: list[Variant] = []
    for key, approx in _approximations(q, k, v, k_pre, tables, config, meta.rope_layout):
        keys.append(key)
        variants.append(Variant(k_hat=approx) if key[0] == "key" else Variant(v_hat=approx))
    attrs = layer_data.attrs
    exact = None
    if config.sink_tokens:
        t = k.shape[2]
        exact = (torch.arange(t)[None, :] < config.sink_tokens).expand(t, t)
    errors = attention_errors_many(q, k, v, variants, scaling=attrs.scaling,
                                   sliding_window=attrs.sliding_window,
                                   softcap=attrs.logit_softcap, sinks=attrs.sinks, exact=exact)
    out: list[Record] = []
    for (tensor, axis, bits, g, stage, variant, fmt), err in zip(keys, errors, strict=True):
        if tensor == "key":
            per_metric = {"reconstruction": err.key_reconstruction, "score": err.scores,
                          "attention_weights": err.weights, "attention_output": err.output}
        else:
            per_metric = {"reconstruction": err.value_reconstruction,
                          "attention_output": err.output}
        for metric, values in per_metric.items():
            kind = "kv" if metric == "reconstruction" else "query"
            out += [Record(attrs.layer_index, head, tensor, axis, bits, g, stage, variant, metric,
                           float(value), kind, fmt) for head, value in enumerate(values.tolist())]
    return out


def _approximations(q, k, v, k_pre, tables, config: CompareConfig, layout: str):
    """Yield ``((tensor, axis, bits, group_size, stage, variant, format), approximation)`` for
    every variant of one layer: keys as the post-RoPE ``[B, Hkv, T, D]`` tensor attention sees,
    values as themselves."""
    transforms = (PLAIN, *config.variants)
    # the same R for every layer and head: it depends only on head_dim and the seed
    rotation = hadamard_rotation(k.shape[-1], config.rotation_seed, k.device) \
        if "rotate" in config.variants else None
    balancer = None
    if "key" in config.tensors and "balancer" in config.variants and "post" in config.stages:
        # MiKV fits the balancer per prompt at prefill: one b per sample, KV head and channel.
        balancer = fit_balancer(q, k, per_sample=True)
    for axis, bits, g in itertools.product(AXES, config.bits, config.group_sizes):
        spec = QuantSpec(bits, axis, g)
        for stage, name in itertools.product(_key_stages(config), transforms):
            if name == "balancer" and stage == "pre":
                continue  # q/b . k*b = q . k holds only where k is consumed
            key = ("key", axis, bits, g, stage, name, None)
            if name == "balancer":
                _, kb = apply_balancer(q, k, balancer)
                scale = balancer.float().unsqueeze(-2)
                yield key, _transform(kb, spec, PLAIN, config, rotation) / scale
            elif stage == "post":
                yield key, _transform(k, spec, name, config, rotation)
            else:
                # Quantize before RoPE, re-rotate. RoPE is linear, so adding the rotated error
                # to the stored k gives exactly rope(k_pre_hat) up to the fp16 rounding of the
                # stored pair. "rotate" un-rotates by R^T before RoPE (R and RoPE do not
                # commute), as quantize_pre_rope(..., rotation=R) does.
                hat = _transform(k_pre, spec, name, config, rotation)
                yield key, k.float() + apply_rope(hat - k_pre.float(), *tables, layout)
        if "value" in config.tensors:
            for name in transforms:
                if name != "balancer":  # it rescales keys against queries
                    yield (("value", axis, bits, g, None, name, None),
                           _transform(v, spec, name, config, rotation))
    yield from _format_approximations(k, v, config)


def _format_approximations(k, v, config: CompareConfig):
    """Engine formats on post-RoPE keys (what an engine caches) and values, in the original
    basis (a rotating format is un-rotated after reading back). Static fp8 scales come from the
    same layer's captured tensor (``fake_quantize_format`` calibrates on its input)."""
    for setting in config.format_settings():
        fmt = setting.format
        g = format_group_size(fmt, k.shape[-1])
        for tensor, x, stage in (("key", k, "post"), ("value", v, None)):
            if tensor in config.tensors:
                key = (tensor, format_axis(fmt), fmt.code_bits, g, stage, PLAIN, setting.name)
                yield key, fake_quantize_format(x.float(), setting, tensor)


def _transform(x, spec, name: str, config: CompareConfig, rotation=None):
    """``x_hat`` in ``x``'s own basis (``rotate`` is un-rotated after dequantizing, so every
    metric, reconstruction included, compares against the original tensor)."""
    if name == PLAIN:  # the layout's reference (kvlens.layouts), float32 group metadata
        return reference(spec, "float32")(x.float())
    if name == "outliers":
        return quantize_with_outliers(x, spec, config.outlier_fraction)
    if name == "rotate":
        return quantize_rotated(x, reference(spec, "float32"), rotation)
    raise ConfigError(f"Unknown variant {name!r}; allowed: {', '.join((PLAIN,) + EXTRA_VARIANTS)}.")
