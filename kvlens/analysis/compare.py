"""``compare-axes``: quantization error of keys and values per axis, measured where it matters.

For every captured layer (streamed one at a time) and every combination of tensor (key, value)
x axis (per-token, per-channel) x bits x group size x key stage (post-RoPE, pre-RoPE) x transform
(plain, balancer, outliers, lowrank, rotate), and for every engine cache format asked for
(``formats``: ggml q8_0/q4_0/..., fp8, per-token-head int8/int4/fp8, ``kvlens.quant.formats``),
one tensor is fake-quantized with the reference library (``kvlens.quant``) while the other two
stay exact, and the relative Frobenius error
``||X - X_hat||_F / ||X||_F`` is measured on the tensor itself and on what attention makes of it
(``kvlens.analysis.metrics.attention_errors_many``: the model's causal mask, GQA mapping, scaling and
softcap, reference attention computed once per layer for all variants).

Metrics (definitions in ``docs/compare-axes.md``):

- key variants: ``reconstruction`` (per KV head), ``score`` (pre-softmax logits, causal entries
  only), ``attention_weights`` (post-softmax) and ``attention_output`` (per query head);
- value variants: ``reconstruction`` (per KV head) and ``attention_output`` (per query head).

Every error pools all samples and tokens of one (layer, head) before taking the ratio. The
summary averages those per-head errors over layers and heads (each head counts once), names
the winning axis per metric and flags where reconstruction and attention output disagree.
Tensors are ``[B, H, T, D]`` (B = samples) throughout.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from kvlens.analysis.metrics import Variant, attention_errors_many, rel_error
from kvlens.capture.store import open_capture
from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant import (
    QuantSpec,
    apply_balancer,
    fake_quantize,
    fit_balancer,
    hadamard_block_size,
    hadamard_rotation,
    quantize_gear,
    quantize_rotated,
    quantize_with_outliers,
    rope_tables_for,
)
from kvlens.quant.formats import fake_quantize_format, parse_format
from kvlens.rope import apply_rope
from kvlens.text.selection import parse_index_spec

CONFIG_VERSION = 1
TENSOR_NAMES = ("key", "value")
AXES = ("per-token", "per-channel")
STAGES = ("post", "pre")  # post-RoPE (what the cache holds) / pre-RoPE (KVQuant), keys only
EXTRA_VARIANTS = ("balancer", "outliers", "lowrank", "rotate")
PLAIN = "plain"
KEY_METRICS = ("reconstruction", "score", "attention_weights", "attention_output")
VALUE_METRICS = ("reconstruction", "attention_output")
METRICS = KEY_METRICS
# A stored k_pre re-rotated with the default RoPE tables must reproduce the stored post-RoPE k
# to storage precision (fp16 rounding of both tensors gives ~1e-3); a different RoPE (YaRN,
# linear scaling, another theta) misses by far more.
ROPE_CHECK_TOLERANCE = 1e-2
_TIE = 1e-9

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class CompareConfig:
    """What ``compare_axes`` sweeps (frozen, JSON-serialisable, validated on creation).

    bits: code widths (1-8). group_sizes: ``G``; per-token groups are ``G`` channels of one
        token (must divide head_dim), per-channel groups ``G`` tokens of one channel.
    stages: key stages: ``"post"`` quantizes the stored post-RoPE key; ``"pre"`` quantizes the
        pre-RoPE key and re-rotates it (values have no stage).
    variants: extra transforms beside plain quantization: ``"balancer"`` (MiKV, keys,
        post-RoPE only), ``"outliers"`` (dense-and-sparse), ``"lowrank"`` (GEAR residual),
        ``"rotate"`` (orthonormal Hadamard along head_dim, ``kvlens.quant.rotation``).
    outlier_fraction: share of each quantization vector kept exact by ``"outliers"``.
    rank: rank of the ``"lowrank"`` residual per (sample, head).
    rotation_seed: ``"rotate"`` without sign flips (None) or with random sign flips drawn with
        this seed (randomized Hadamard).
    formats: engine cache formats swept beside the integer specs, by name
        (``kvlens.quant.formats.parse_format``: ``q8_0``, ``q4_0+norot``, ``fp8_e4m3@head``,
        ``int8@token-head`` ...), stored canonical. Static fp8 scales are calibrated per layer
        on the captured tensor they are evaluated on (in-sample).
    layers: captured layers to analyse (None = all). samples: use only the first N samples.
    tensors: which of ``"key"``, ``"value"`` to sweep.
    sink_tokens: the first N tokens are read exact by every query in the score / weight /
        output metrics (a cache keeping the attention sinks at full precision, as
        ``generate``'s ``sink_tokens``); reconstruction still covers every token.
    """

    bits: tuple[int, ...] = (2, 4)
    group_sizes: tuple[int, ...] = (32,)
    stages: tuple[str, ...] = ("post",)
    variants: tuple[str, ...] = ()
    outlier_fraction: float = 0.01
    rank: int = 2
    layers: tuple[int, ...] | None = None
    samples: int | None = None
    tensors: tuple[str, ...] = TENSOR_NAMES
    sink_tokens: int = 0
    rotation_seed: int | None = None
    formats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("bits", "group_sizes", "stages", "variants", "tensors", "formats"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise ConfigError(f"{name} must be a list, got {value!r}.")
            object.__setattr__(self, name, tuple(dict.fromkeys(value)))  # dedupe, keep order
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        if not self.bits:
            raise ConfigError("No bit widths given; allowed: integers 1-8, e.g. 2,4.")
        for b in self.bits:
            if not is_int(b, 1, 8):
                raise ConfigError(f"Invalid bits {b!r}; allowed: integers 1-8.")
        if not self.group_sizes:
            raise ConfigError("No group sizes given; e.g. 32.")
        for g in self.group_sizes:
            if not is_int(g, 1):
                raise ConfigError(f"Invalid group size {g!r}; allowed: positive integers.")
        _check_choices("stage", self.stages, STAGES, allow_empty=False)
        _check_choices("variant", self.variants, EXTRA_VARIANTS, allow_empty=True)
        _check_choices("tensor", self.tensors, TENSOR_NAMES, allow_empty=False)
        if (
            isinstance(self.outlier_fraction, bool)
            or not isinstance(self.outlier_fraction, (int, float))
            or not 0.0 < self.outlier_fraction < 1.0
        ):
            raise ConfigError(
                f"Invalid outlier fraction {self.outlier_fraction!r}; allowed: 0 < f < 1 "
                "(e.g. 0.01 for 1%)."
            )
        if not is_int(self.rank, 1):
            raise ConfigError(f"Invalid rank {self.rank!r}; allowed: a positive integer.")
        if self.samples is not None and not is_int(self.samples, 1):
            raise ConfigError(f"Invalid samples {self.samples!r}; allowed: a positive integer.")
        s = self.sink_tokens
        if not is_int(s, 0):
            raise ConfigError(f"Invalid sink tokens {s!r}; allowed: an integer >= 0.")
        seed = self.rotation_seed
        if seed is not None and not is_int(seed, 0):
            raise ConfigError(
                f"Invalid rotation seed {seed!r}; allowed: none (no sign flips) or an integer >= 0."
            )
        if self.formats:

            for f in self.formats:
                if not isinstance(f, str):
                    raise ConfigError(f"Invalid format {f!r}; expected a name such as q8_0.")
            names = tuple(dict.fromkeys(parse_format(f).name for f in self.formats))
            object.__setattr__(self, "formats", names)

    def format_settings(self):
        """``self.formats`` as ``kvlens.quant.formats.FormatSetting`` objects."""

        return tuple(parse_format(f) for f in self.formats)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
        return {"version": CONFIG_VERSION, **d}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompareConfig:
        version = data.get("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ConfigError(f"Unsupported compare config version {version!r}; allowed: 1.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known - {"version"})
        if unknown:
            raise ConfigError(f"Unknown compare config keys {unknown}; allowed: {sorted(known)}.")
        return cls(
            **{
                k: (tuple(v) if isinstance(v, list) else v)
                for k, v in data.items()
                if k != "version"
            }
        )


def _check_choices(
    what: str, values: Sequence[str], allowed: Sequence[str], allow_empty: bool
) -> None:
    if not values and not allow_empty:
        raise ConfigError(f"No {what}s given; allowed: {', '.join(allowed)}.")
    for v in values:
        if v not in allowed:
            raise ConfigError(f"Unknown {what} {v!r}; allowed: {', '.join(allowed)}.")


@dataclass(frozen=True)
class Record:
    """One relative error: ``head`` is a KV head for ``reconstruction`` and a query head for
    the attention metrics (``head_kind`` says which). ``stage`` is None for values.

    ``format`` is None for the integer specs; for an engine format it is the format's name and
    ``axis`` says what shares a scale (``per-token`` for ggml blocks and per-token-head,
    ``per-layer`` / ``per-head`` for static fp8), ``bits`` is the code width and
    ``group_size`` the channels sharing a scale (0 for static scales)."""

    layer: int
    head: int
    tensor: str
    axis: str
    bits: int
    group_size: int
    stage: str | None
    variant: str
    metric: str
    rel_error: float
    head_kind: str
    format: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CompareResult:
    records: list[Record]
    summary: dict[str, Any]
    config: CompareConfig = field(default_factory=CompareConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"records": [r.to_dict() for r in self.records], "summary": self.summary}


@dataclass(frozen=True)
class _VariantKey:
    tensor: str
    axis: str
    bits: int
    group_size: int
    stage: str | None
    variant: str
    format: str | None = None


def parse_int_list(text: str | None, what: str) -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)`` with an error naming ``what`` on anything else."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    if not items:
        raise InputError(f"No {what} given; example: 2,4.")
    try:
        return tuple(int(s) for s in items)
    except ValueError:
        raise InputError(
            f"Invalid {what} {text!r}: expected comma-separated integers, e.g. 2,4."
        ) from None


def parse_name_list(text: str | None) -> tuple[str, ...]:
    """``"balancer, outliers"`` -> ``("balancer", "outliers")``; ``""``/``"none"`` -> ``()``."""
    items = [s.strip().lower() for s in (text or "").split(",") if s.strip()]
    return () if items in ([], ["none"]) else tuple(items)


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"0,4,8-11"`` -> layer indices (None/``"all"`` -> None); checked against the capture
    later, so the error can list the captured layers."""
    if text is None or text.strip().lower() in ("", "all"):
        return None

    return tuple(parse_index_spec(text, 1 << 30, "layer"))


# -- the sweep ------------------------------------------------------------------------------


def compare_axes(
    path: str | os.PathLike,
    config: CompareConfig | None = None,
    progress: Progress | None = None,
    threads: int | None = 1,
) -> CompareResult:
    """Sweep ``config`` over the capture at ``path``, one layer in memory at a time.

    threads: torch intra-op threads while sweeping (restored afterwards; None = leave as is).
    The work is many small element-wise passes, where extra threads mostly wait on each other:
    on the 2-core development machine one thread ran a SmolLM2 layer 4x faster than two.

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
        pre = "pre" in _key_stages(config)
        for done, layer in enumerate(layers):
            if progress:
                progress(done, len(layers), f"layer {layer}")
            records.extend(_layer_records(cap.layer(layer), config, meta, n_samples, pre))
        if progress:
            progress(len(layers), len(layers), "done")
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
    if config.formats:
        summary["formats"] = format_info(
            config, meta.num_key_value_heads, meta.num_tokens, meta.head_dim
        )
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
    if "rotate" in config.variants:
        try:
            hadamard_block_size(meta.head_dim)
        except ConfigError as exc:
            raise ConfigError(
                f"Variant 'rotate' does not fit {meta.model or 'this'} capture: {exc}"
            ) from None
    if "pre" in _key_stages(config):
        if not meta.has_rope or meta.rope_layout in ("none", "", "pending"):
            raise InputError(
                f"Stage 'pre' needs a capture of a model with RoPE, but {meta.model or 'this'} "
                f"capture has none (rope_layout {meta.rope_layout!r}); its keys have no "
                "pre-RoPE form. Use --stages post."
            )


def rope_tables(meta, n_samples: int, n_tokens: int | None = None, theta: float | None = None):
    """Default-RoPE ``(cos, sin)`` for a capture's windows (positions 0..T-1 per sample), at
    ``theta`` (default: the capture's ``rope_theta``); check them with ``rope_rebuild_error``
    before trusting them (scaled RoPE variants differ; ``layer_rope_tables`` does both)."""
    import torch


    positions = torch.arange(n_tokens or meta.num_tokens).expand(n_samples, -1)
    return rope_tables_for(
        positions,
        meta.head_dim,
        float(meta.rope["rope_theta"] if theta is None else theta),
        meta.rotary_dim or meta.head_dim,
        meta.rope_layout,
    )


COMMON_ROPE_THETAS = (10000.0, 500000.0, 1000000.0, 100000.0, 1000.0, 5000000.0, 10000000.0,
                      50000.0, 250000.0, 2000000.0)


def layer_rope_tables(meta, k, k_pre, n_tokens: int | None = None):
    """``(tables, theta)`` reproducing one layer's stored keys from its stored pre-RoPE keys
    (``k``, ``k_pre``: ``[S, H, T, D]``), or ``(None, None)``. Tries the capture's recorded
    ``rope_theta``, then common thetas, then a search over theta (log scale) on the rebuild
    error; a theta counts only when its rebuild error is within ``ROPE_CHECK_TOLERANCE``. Why
    per layer: models such as Gemma3 use one theta on their sliding-window layers and another
    on their global ones, and a capture may not record them (Gemma3's config keeps them per
    layer type); the check keeps scaled variants (YaRN...) out."""
    if meta.rope_layout not in ("half", "interleaved"):
        return None, None
    n_tok = k.shape[2] if n_tokens is None else n_tokens
    probe = slice(0, min(k.shape[2], 256))
    kp, pp = k[:1, :, probe], k_pre[:1, :, probe]

    def tables(theta, samples=1, t=None):
        return rope_tables(meta, samples, t, theta=theta)

    def err(theta):
        return rope_rebuild_error(kp, pp, tables(theta, 1, kp.shape[2]), meta.rope_layout)

    tried = ([float(meta.rope["rope_theta"])] if "rope_theta" in meta.rope else []) + \
        list(COMMON_ROPE_THETAS)
    found = next((t for t in tried if err(t) <= ROPE_CHECK_TOLERANCE), None)
    if found is None:  # log-grid, then golden-section refinement around the best point
        grid = [10 ** (2 + i * 6 / 240) for i in range(241)]
        errs = [err(t) for t in grid]
        i = min(range(len(grid)), key=errs.__getitem__)
        lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
        g = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            if err(math.exp(a)) < err(math.exp(b)):
                hi = b
            else:
                lo = a
        t = math.exp((lo + hi) / 2)
        found = t if err(t) <= ROPE_CHECK_TOLERANCE else None
    if found is None:
        return None, None
    full = tables(found, k.shape[0], n_tok)
    if rope_rebuild_error(k[:, :, :n_tok], k_pre[:, :, :n_tok], full, meta.rope_layout) \
            > ROPE_CHECK_TOLERANCE:
        return None, None
    return full, found


def rope_rebuild_error(k, k_pre, tables, layout: str) -> float:
    """Relative error of re-applying RoPE (``tables``) to stored pre-RoPE keys vs stored keys."""

    return rel_error(k, apply_rope(k_pre, *tables, layout))


def _layer_tables(k, k_pre, meta, layer: int):
    """The layer's RoPE tables (``layer_rope_tables``) or an ``InputError`` saying why not."""
    tables, _ = layer_rope_tables(meta, k, k_pre)
    if tables is None:
        theta = meta.rope.get("rope_theta")
        err = rope_rebuild_error(k, k_pre, rope_tables(meta, k.shape[0], k.shape[2],
                                                       theta=theta or 10000.0),
                                 meta.rope_layout)
        raise InputError(
            f"Layer {layer}: re-applying default RoPE ({meta.rope_layout} layout, rotary_dim "
            f"{meta.rotary_dim}, positions 0..T-1) to the stored pre-RoPE keys at no theta "
            f"reproduces the stored keys (at the recorded theta {theta}: relative error "
            f"{err:.3g} > {ROPE_CHECK_TOLERANCE}); the model uses a RoPE variant kvlens cannot "
            f"re-create (rope type {meta.rope.get('rope_type', 'unknown')!r}, e.g. YaRN or "
            "linear scaling). Use --stages post."
        )
    return tables


def _layer_records(layer_data, config: CompareConfig, meta, n_samples: int,
                   pre: bool) -> list[Record]:
    import torch


    samples = slice(0, n_samples)
    q = layer_data.read("q", samples)
    k = layer_data.read("k", samples)
    v = layer_data.read("v", samples)
    k_pre = tables = None
    if pre:
        k_pre = layer_data.read("k_pre", samples)
        tables = _layer_tables(k, k_pre, meta, layer_data.index)
    keys: list[_VariantKey] = []
    variants: list[Variant] = []
    for key, approx in _approximations(q, k, v, k_pre, tables, config, meta.rope_layout):
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


def _approximations(q, k, v, k_pre, tables, config: CompareConfig, layout: str):
    """Yield ``(_VariantKey, approximation)`` for every variant of one layer: keys as the
    post-RoPE ``[B, Hkv, T, D]`` tensor attention sees, values as themselves."""

    transforms = (PLAIN, *config.variants)
    # the same R for every layer and head: it depends only on head_dim and the seed
    rotation = (
        hadamard_rotation(k.shape[-1], config.rotation_seed, k.device)
        if "rotate" in config.variants
        else None
    )
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
                            if name == "balancer":
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
                        if name != "balancer":  # the balancer rescales keys against queries
                            yield (
                                _VariantKey("value", axis, bits, g, None, name),
                                _transform(v, spec, name, config, rotation),
                            )
    yield from _format_approximations(k, v, config)


def format_axis(fmt) -> str:
    """What shares one scale in an engine format, as a ``Record.axis``."""
    if fmt.family == "fp8":
        return "per-layer" if fmt.scope == "tensor" else "per-head"
    return "per-token"


def format_group_size(fmt, head_dim: int) -> int:
    """Channels of one token sharing a scale (0: a static scale shared over tokens)."""
    if fmt.family == "ggml":
        return fmt.block_size
    return head_dim if fmt.family == "token-head" else 0


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


# -- summary ----------------------------------------------------------------------------------


def _config_key(r: Record) -> tuple:
    return (r.tensor, r.bits, r.group_size, r.stage, r.variant)


def _winner(per_token: float, per_channel: float) -> str:
    if abs(per_token - per_channel) <= _TIE * max(per_token, per_channel):
        return "tie"
    return "per-token" if per_token < per_channel else "per-channel"


FORMAT_CALIBRATION_NOTE = (
    "static fp8 scales (fp8_e4m3, fp8_e5m2, @head; not :sS) are calibrated per layer from the "
    "same captured keys/values they are evaluated on (in-sample: absmax never clips); "
    "per-token-head and ggml scales are dynamic per token"
)


def format_info(config: CompareConfig, kv_heads: int, tokens: int, head_dim: int) -> list[dict]:
    """Per swept format: layout, storage bits per element for one sequence of the capture's
    shape, whether keys and values are rotated, and how static scales were calibrated."""
    out = []
    shape = (1, kv_heads, tokens, head_dim)
    for setting in config.format_settings():
        fmt = setting.format
        out.append(
            {
                "format": setting.name,
                "family": fmt.family,
                "shares_scale": fmt.shares_scale,
                "code_bits": fmt.code_bits,
                "bits_per_element": setting.bits_per_element(shape),
                "rotated": setting.rotates(head_dim),
                "calibration": _calibration(fmt),
            }
        )
    return out


def _calibration(fmt) -> str:
    if fmt.family != "fp8":
        return "dynamic"
    if fmt.fixed_scale is not None:
        return f"static, {fmt.calibration} (not calibrated)"
    return f"static, per layer from the capture ({fmt.calibration}, in-sample)"


def summarize_formats(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Means over layers and heads per (tensor, format, metric) for engine-format records."""
    sums: dict[tuple, list[float]] = defaultdict(list)
    order: dict[str, int] = {}
    for r in records:
        if r.format is not None:
            order.setdefault(r.format, len(order))
            sums[(r.tensor, r.format, r.metric)].append(r.rel_error)
    rows = [
        {
            "tensor": tensor,
            "format": fmt,
            "metric": metric,
            "mean": sum(vals) / len(vals),
            "min": min(vals),
            "max": max(vals),
            "count": len(vals),
        }
        for (tensor, fmt, metric), vals in sums.items()
    ]
    metric_order = {m: i for i, m in enumerate(KEY_METRICS)}
    rows.sort(
        key=lambda m: (
            TENSOR_NAMES.index(m["tensor"]),
            order[m["format"]],
            metric_order[m["metric"]],
        )
    )
    return rows


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Means over layers and heads, the winning axis per metric, reconstruction-vs-output
    disagreements and the KIVI-pattern check (JSON-ready; see ``docs/compare-axes.md``).
    Engine-format records (``Record.format`` set) are summarised apart, in
    ``format_means``; they take no part in the axis comparison."""
    format_means = summarize_formats(records)
    records = [r for r in records if r.format is None]
    sums: dict[tuple, list[float]] = defaultdict(list)
    per_layer: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        sums[(*_config_key(r), r.axis, r.metric)].append(r.rel_error)
        per_layer[(*_config_key(r), r.axis, r.metric, r.layer)].append(r.rel_error)
    means = []
    for (tensor, bits, g, stage, variant, axis, metric), vals in sums.items():
        means.append(
            {
                "tensor": tensor,
                "axis": axis,
                "bits": bits,
                "group_size": g,
                "stage": stage,
                "variant": variant,
                "metric": metric,
                "mean": sum(vals) / len(vals),
                "min": min(vals),
                "max": max(vals),
                "count": len(vals),
            }
        )
    means.sort(key=_sort_key)
    mean_of = means_by_key(means)
    layer_mean = {k: sum(v) / len(v) for k, v in per_layer.items()}
    layers = sorted({r.layer for r in records})
    winners, rankings = [], []
    configs = sorted(
        {_config_key(r) for r in records},
        key=lambda c: _sort_key(
            {"tensor": c[0], "bits": c[1], "group_size": c[2], "stage": c[3], "variant": c[4]}
        ),
    )
    for ck in configs:
        metrics = KEY_METRICS if ck[0] == "key" else VALUE_METRICS
        ranking = dict(zip(("tensor", "bits", "group_size", "stage", "variant"), ck, strict=True))
        for metric in metrics:
            tok = mean_of.get((*ck, "per-token", metric))
            ch = mean_of.get((*ck, "per-channel", metric))
            if tok is None or ch is None:
                continue
            won = sum(
                1
                for layer in layers
                if layer_mean[(*ck, "per-channel", metric, layer)]
                < layer_mean[(*ck, "per-token", metric, layer)]
            )
            winner = _winner(tok, ch)
            winners.append(
                {
                    **ranking,
                    "metric": metric,
                    "per_token": tok,
                    "per_channel": ch,
                    "winner": winner,
                    "ratio_token_over_channel": (tok / ch) if ch > 0 else None,
                    "layers_per_channel_better": won,
                    "layers": len(layers),
                }
            )
            ranking[metric] = winner
        recon, output = ranking.get("reconstruction"), ranking.get("attention_output")
        ranking["disagree"] = bool(
            recon and output and "tie" not in (recon, output) and recon != output
        )
        rankings.append(ranking)
    return {
        "aggregation": "mean over layers and heads of per-(layer, head) relative Frobenius "
        "errors; reconstruction per KV head, attention metrics per query head",
        "means": means,
        "winners": winners,
        "rankings": rankings,
        "disagreements": [r for r in rankings if r["disagree"]],
        "kivi_pattern": _kivi_pattern(mean_of, configs),
        **(
            {"format_means": format_means, "format_calibration": FORMAT_CALIBRATION_NOTE}
            if format_means
            else {}
        ),
    }


def means_by_key(means: Sequence[Mapping[str, Any]]) -> dict[tuple, float]:
    """Summary means keyed by (tensor, bits, group_size, stage, variant, axis, metric)."""
    return {
        (
            m["tensor"],
            m["bits"],
            m["group_size"],
            m["stage"],
            m["variant"],
            m["axis"],
            m["metric"],
        ): m["mean"]
        for m in means
    }


def _sort_key(m: Mapping[str, Any]) -> tuple:
    order = {
        n: i
        for i, n in enumerate((*TENSOR_NAMES, *AXES, *STAGES, PLAIN, *EXTRA_VARIANTS, *KEY_METRICS))
    }
    return (
        order[m["tensor"]],
        m["bits"],
        m["group_size"],
        order.get(m["stage"], -1),
        order[m["variant"]],
        order.get(m.get("axis"), -1),
        order.get(m.get("metric"), -1),
    )


def _kivi_pattern(mean_of: Mapping[tuple, float], configs) -> list[dict[str, Any]]:
    """For each (bits, G) with plain post-RoPE keys and plain values: does KIVI's finding hold?
    Keys: per-channel lower reconstruction and score error. Values: per-channel lower or equal
    reconstruction error but higher attention-output error."""
    out = []
    for bits, g in sorted({(c[1], c[2]) for c in configs}):
        kk, vk = ("key", bits, g, "post", PLAIN), ("value", bits, g, None, PLAIN)

        def get(ck, axis, metric):
            return mean_of.get((*ck, axis, metric))

        parts = {
            "key_reconstruction": (
                get(kk, "per-channel", "reconstruction"),
                get(kk, "per-token", "reconstruction"),
                "<",
            ),
            "key_score": (get(kk, "per-channel", "score"), get(kk, "per-token", "score"), "<"),
            "value_reconstruction": (
                get(vk, "per-channel", "reconstruction"),
                get(vk, "per-token", "reconstruction"),
                "<=",
            ),
            "value_attention_output": (
                get(vk, "per-channel", "attention_output"),
                get(vk, "per-token", "attention_output"),
                ">",
            ),
        }
        if any(ch is None or tok is None for ch, tok, _ in parts.values()):
            continue
        checks = {}
        for name, (ch, tok, op) in parts.items():
            ok = ch < tok if op == "<" else ch > tok if op == ">" else ch <= tok * (1 + _TIE)
            checks[name] = {
                "per_channel": ch,
                "per_token": tok,
                "expected": f"per-channel {op} per-token",
                "holds": bool(ok),
            }
        out.append(
            {
                "bits": bits,
                "group_size": g,
                "holds": all(c["holds"] for c in checks.values()),
                "checks": checks,
            }
        )
    return out
