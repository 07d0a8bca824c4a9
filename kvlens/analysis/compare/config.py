"""``compare-axes`` options: what a sweep covers (``CompareConfig``, validated, versioned JSON)
and the parsers that turn command-line lists into its fields.

The names of tensors, axes, key stages, transforms and metrics every other module of
``kvlens.analysis.compare`` keys its records and summaries by are defined here, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvlens.errors import ConfigError, InputError, is_int
from kvlens.quant.formats import parse_format
from kvlens.text.selection import parse_index_spec

CONFIG_VERSION = 1
TENSOR_NAMES = ("key", "value")
AXES = ("per-token", "per-channel")
STAGES = ("post", "pre")  # post-RoPE (what the cache holds) / pre-RoPE (KVQuant), keys only
EXTRA_VARIANTS = ("balancer", "outliers", "rotate")
PLAIN = "plain"
KEY_METRICS = ("reconstruction", "score", "attention_weights", "attention_output")
VALUE_METRICS = ("reconstruction", "attention_output")


@dataclass(frozen=True)
class CompareConfig:
    """What ``compare_axes`` sweeps (frozen, JSON-serialisable, validated on creation).

    bits: code widths (1-8). group_sizes: ``G``; per-token groups are ``G`` channels of one
        token (must divide head_dim), per-channel groups ``G`` tokens of one channel.
    stages: key stages: ``"post"`` quantizes the stored post-RoPE key; ``"pre"`` quantizes the
        pre-RoPE key and re-rotates it (values have no stage).
    variants: extra transforms beside plain quantization: ``"balancer"`` (MiKV, keys,
        post-RoPE only), ``"outliers"`` (dense-and-sparse), ``"rotate"`` (orthonormal Hadamard
        along head_dim, ``kvlens.quant.rotation``).
    outlier_fraction: share of each quantization vector kept exact by ``"outliers"``.
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
        return cls(**{k: v for k, v in data.items() if k != "version"})  # lists: tuples on init


def _check_choices(
    what: str, values: Sequence[str], allowed: Sequence[str], allow_empty: bool
) -> None:
    if not values and not allow_empty:
        raise ConfigError(f"No {what}s given; allowed: {', '.join(allowed)}.")
    for v in values:
        if v not in allowed:
            raise ConfigError(f"Unknown {what} {v!r}; allowed: {', '.join(allowed)}.")


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
