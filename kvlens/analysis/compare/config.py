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
from kvlens.quant.codebook import CODEBOOKS
from kvlens.quant.formats import parse_format
from kvlens.text.selection import parse_index_spec

CONFIG_VERSION = 1
TENSOR_NAMES = ("key", "value")
AXES = ("per-token", "per-channel")
STAGES = ("post", "pre")  # post-RoPE (what the cache holds) / pre-RoPE (KVQuant), keys only
EXTRA_VARIANTS = ("balancer", "outliers", "lowrank", "rotate", "center", "predict")
PLAIN = "plain"
KEY_METRICS = ("reconstruction", "score", "attention_weights", "attention_output")
VALUE_METRICS = ("reconstruction", "attention_output")
METRICS = KEY_METRICS
# after a codebook name: "+center" (keys), "+renorm", "+pre" (keys coded before RoPE),
# "+predict" (the residual of a cross-layer prediction coded, kvlens.analysis.compare.predict)
CODEBOOK_OPTIONS = ("center", "renorm", "pre", "predict")


@dataclass(frozen=True)
class CompareConfig:
    """What ``compare_axes`` sweeps (frozen, JSON-serialisable, validated on creation).

    bits: code widths (1-8). group_sizes: ``G``; per-token groups are ``G`` channels of one
        token (must divide head_dim), per-channel groups ``G`` tokens of one channel.
    stages: key stages: ``"post"`` quantizes the stored post-RoPE key; ``"pre"`` quantizes the
        pre-RoPE key and re-rotates it (values have no stage).
    variants: extra transforms beside plain quantization: ``"balancer"`` (MiKV, keys,
        post-RoPE only), ``"outliers"`` (dense-and-sparse), ``"lowrank"`` (GEAR residual),
        ``"rotate"`` (orthonormal Hadamard along head_dim, ``kvlens.quant.rotation``),
        ``"center"`` (keys: the per-KV-head mean key of the layer subtracted before quantizing
        and added back, ``kvlens.quant.centering``; the post stage centres post-RoPE keys, the
        pre stage pre-RoPE keys), ``"predict"`` (AQUA-KV: keys predicted from the previous
        layer's reconstructed keys of the same stage, values from the layer's reconstructed
        keys and the previous layer's reconstructed values, by ridge maps fitted on the other
        samples; only the residual is quantized, ``kvlens.analysis.compare.predict``; needs at
        least 2 samples).
    outlier_fraction: share of each quantization vector kept exact by ``"outliers"``.
    rank: rank of the ``"lowrank"`` residual per (sample, head).
    rotation_seed: ``"rotate"`` without sign flips (None) or with random sign flips drawn with
        this seed (randomized Hadamard).
    formats: engine cache formats swept beside the integer specs, by name
        (``kvlens.quant.formats.parse_format``: ``q8_0``, ``q4_0+norot``, ``fp8_e4m3@head``,
        ``int8@token-head`` ...), stored canonical. Static fp8 scales are calibrated per layer
        on the captured tensor they are evaluated on (in-sample).
    codebooks: codebook layouts (``kvlens.quant.codebook``) swept at every ``bits``, by name:
        ``lloyd-max``, ``fitted``, ``weighted`` (keys only), each optionally followed by
        ``+center`` (keys centred as the ``center`` variant; values are coded uncentred),
        ``+renorm`` (decoded vectors rescaled to the stored norm) and ``+pre`` (keys coded
        before RoPE and re-rotated, as the pre stage; ``weighted`` then weights by the pre-RoPE
        queries) and ``+predict`` (the residual of the ``predict`` variant's prediction coded;
        not with ``weighted`` or ``+center``); stored canonical (``fitted+center+renorm+pre``). Fitted codebooks and means come from the layer's captured
        tensor they are evaluated on (in-sample).
    layers: captured layers to analyse (None = all). samples: use only the first N samples.
    tensors: which of ``"key"``, ``"value"`` to sweep.
    sink_tokens: the first N tokens are read exact by every query in the score / weight /
        output metrics (a cache keeping the attention sinks at full precision, as
        ``generate``'s ``sink_tokens``); reconstruction still covers every token.
    predict_calibration: path of another capture of the same model (other text) to fit the
        ``predict`` variant's predictors on, all of its samples; None: leave one sample out of
        the measured capture.
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
    codebooks: tuple[str, ...] = ()
    predict_calibration: str | None = None

    def __post_init__(self) -> None:
        for name in ("bits", "group_sizes", "stages", "variants", "tensors", "formats",
                     "codebooks"):
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

        object.__setattr__(
            self, "codebooks", tuple(dict.fromkeys(parse_codebook(c) for c in self.codebooks))
        )
        cal = self.predict_calibration
        if cal is not None:
            if not isinstance(cal, str) or not cal.strip():
                raise ConfigError(f"Invalid predict calibration {cal!r}; expected a capture path.")
            if "predict" not in self.variants and not any(
                    "+predict" in c for c in self.codebooks):
                raise ConfigError(
                    "A predict calibration capture needs --variants predict or a +predict codebook.")

    def codebook_settings(self) -> tuple[tuple[str, str, frozenset[str]], ...]:
        """``(name, codebook, options)`` for each of ``self.codebooks``."""
        out = []
        for name in self.codebooks:
            base, *opts = name.split("+")
            out.append((name, base, frozenset(opts)))
        return tuple(out)

    @property
    def codebook_pre_rope(self) -> bool:
        """Whether a codebook codes keys before RoPE (the capture's ``k_pre`` is needed)."""
        return "key" in self.tensors and any("pre" in o for *_, o in self.codebook_settings())

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


def parse_codebook(name: object) -> str:
    """Canonical codebook variant name (``"Fitted+renorm+center"`` -> ``"fitted+center+renorm"``);
    ``ConfigError`` listing the allowed names otherwise."""
    allowed = (f"{', '.join(CODEBOOKS)}, each optionally with "
               f"{' / '.join('+' + o for o in CODEBOOK_OPTIONS)}")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"Invalid codebook {name!r}; allowed: {allowed}.")
    base, *opts = [p.strip().lower() for p in name.split("+")]
    if base not in CODEBOOKS:
        raise ConfigError(f"Unknown codebook {base!r}; allowed: {allowed}.")
    for o in opts:
        if o not in CODEBOOK_OPTIONS:
            raise ConfigError(f"Unknown codebook option {o!r} in {name!r}; allowed: {allowed}.")
    if "predict" in opts and ("center" in opts or base == "weighted"):
        raise ConfigError(
            f"Codebook {name!r}: +predict codes a prediction's residual, whose intercept already "
            "centres it; it does not combine with +center or with weighted (use fitted or "
            "lloyd-max)."
        )
    return "+".join([base, *(o for o in CODEBOOK_OPTIONS if o in opts)])


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
