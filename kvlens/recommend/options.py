"""What ``recommend`` is asked and what it chooses among: ``RecommendOptions`` (every option,
validated with errors that name the allowed values), ``Candidate`` (one way to store one tensor
of one layer), ``Stream`` (how a layer's full-precision window moves), the constants they share,
``default_tokens`` and ``listed`` (values joined for messages). Research candidates (twins of
these, ``Candidate.twin``) come from the extensions ``extensions`` switches on
(``kvlens.recommend.extension``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvlens.config import FP_BYTES, SCALE_DTYPES, LayerKV
from kvlens.errors import InputError, OptionError, is_int
from kvlens.model.load import DTYPES
from kvlens.quant import QuantSpec
from kvlens.quant.spec import FITS, GRANULARITIES
from kvlens.recommend.extension import Twin, extension_class, resolve

#: the granularities candidates take (quant's vocabulary, ``GRANULARITIES``, without
#: per-tensor: one scale per flushed block is an engine format's, not a candidate's)
OFFERED_GRANULARITIES = tuple(g for g in GRANULARITIES if g != "per-tensor")
SENSITIVITIES = ("auto", "model", "layout", "uniform")
#: the ``RecommendOptions`` fields that take one of a few names, and those names
CHOICES = (("sensitivity", SENSITIVITIES), ("retrieval", ("auto", "on", "off")),
           ("pre_rope", ("auto", "on", "off")), ("dtype", DTYPES), ("fp_dtype", FP_BYTES),
           ("scale_dtype", SCALE_DTYPES))
DEFAULT_WINDOWS = (32, 64, 128)  # the default --windows (docs/recommend.md: why these)
#: ``RecommendOptions.tokens`` derived from the windows (``default_tokens``)
AUTO = "auto"


class Stream(NamedTuple):
    """How a layer's full-precision window moves: it holds up to ``residual`` tokens and,
    when full, quantizes its oldest ``flush`` (0 = the whole window, KIVI)."""

    residual: int
    flush: int

    @property
    def block(self) -> int:
        """Tokens quantized together (a per-channel group must divide it)."""
        return self.flush or self.residual

    def setting(self, key: Candidate, value: Candidate) -> LayerKV:
        """The config's setting of a layer storing ``key`` and ``value`` with this window."""
        return LayerKV(key.spec(), value.spec(), self.residual, key.stage == "pre",
                       flush_tokens=self.flush, rotate_keys=key.rotate,
                       rotate_values=value.rotate)


@dataclass(frozen=True)
class Candidate:
    """One way to store one tensor of one layer."""

    tensor: str  # "key" or "value"
    bits: int
    granularity: str
    group_size: int
    stage: str = "post"  # keys only: "pre" = quantize before RoPE
    balancer: bool = False  # keys only: key-channel balancer
    rotate: bool = False  # Hadamard rotation along head_dim (kvlens.quant.rotation)
    # what a research extension keeps beside the codes (kvlens.recommend.extension); None: the
    # stable candidate (its sinks only)
    twin: Twin | None = None
    fit: str = "minmax"  # how each group's scale and zero are chosen (QuantSpec.fit)

    @property
    def short(self) -> str:
        axis = "ch" if self.granularity == "per-channel" else "tok"
        return f"{self.bits}b {axis} G{self.group_size}{self._traits(0)}"

    @property
    def label(self) -> str:
        return f"{self.bits}b {self.granularity} G{self.group_size}{self._traits(1)}"

    def _traits(self, long: int) -> str:
        """What it keeps beside plain codes, in ``short``'s (0) or ``label``'s (1) words."""
        twin = ("", "") if self.twin is None else \
            extension_class(self.twin.extension)().words(self.twin.setting)
        said = [(self.stage == "pre", " pre", " pre-RoPE"), (self.balancer, " bal", " +bal"),
                (self.rotate, " rot", " +rotation"), (True, *twin),
                (self.fit == "mse", " mse", " mse-fit")]
        return "".join(words[long] for on, *words in said if on)

    @property
    def base(self) -> Candidate:
        """The same storage without its twin's extra (itself for a stable candidate)."""
        return replace(self, twin=None)

    def spec(self) -> QuantSpec:
        """What the config stores this candidate as."""
        return QuantSpec(self.bits, self.granularity, self.group_size, fit=self.fit)


#: Where an option lives (``dataclasses.field`` metadata ``"door"``): ``MAIN`` a main option of
#: ``kvlens recommend`` (its flag is ``"flag"``); ``RESEARCH`` a lever behind the research door
#: (``kvlens.research``; ``kvlens recommend --set NAME=VALUE``, NAME ``"lever"``); ``LIBRARY``
#: the Python API only. ``tests/test_recommend_options.py`` checks every field is classified.
MAIN, RESEARCH, LIBRARY = "main", "research", "library"


def _main(default, flag: str):
    return field(default=default, metadata={"door": MAIN, "flag": flag})


def _lever(default, lever: str, help: str):
    """A knob of the default run behind ``--set`` (the default recommendation uses it, at its
    default value)."""
    return field(default=default, metadata={"door": RESEARCH, "lever": lever, "help": help})


def _library(default):
    return field(default=default, metadata={"door": LIBRARY})


def option_name(name: str) -> str:
    """How a user names ``RecommendOptions`` field ``name``: ``--window-dtype`` for a main
    option, ``--set flush`` for a research lever, the field name for a library one."""
    meta = RecommendOptions.__dataclass_fields__[name].metadata
    if meta.get("door") == MAIN:
        return meta["flag"]
    return f"--set {meta['lever']}" if meta.get("door") == RESEARCH else name


@dataclass(frozen=True)
class RecommendOptions:
    """Everything ``recommend`` is asked; the defaults are what ``kvlens recommend -b B`` runs
    (the CLI builds its options from this class). Fields are main options, research levers or
    library-only (``door`` metadata; ``option_name``)."""

    budget_bits: float = field(metadata={"door": MAIN, "flag": "--budget-bits"})
    context: int = _main(4096, "--context")
    # window sizes each layer chooses among (docs/recommend.md: why these)
    windows: tuple[int, ...] = _main(DEFAULT_WINDOWS, "--windows")
    # capture samples the errors are measured on (None: all; docs/lab-notes/recommend.md)
    samples: int | None = _main(None, "--samples")
    # first tokens of each sample measured on (None: all); AUTO: ``default_tokens(windows)``
    tokens: int | str | None = _main(AUTO, "--tokens")
    model: str | None = _main(None, "--model")  # default: the capture's model source
    # dtype of the model stages (sensitivity, retrieval probe, validation: their exact reference)
    dtype: str = _main("float32", "--dtype")
    name: str = _main("recommended", "--name")
    # where the model loaded for sensitivity/retrieval goes (kvlens.model.placement; None = one device)
    device_map: str | None = _main(None, "--device-map")
    max_memory: str | None = _main(None, "--max-memory")
    offload_folder: str | None = _main(None, "--offload-folder")
    # the config's fp_dtype (the error proxy reads those parts exact: docs/recommend.md)
    fp_dtype: str = _main("float16", "--window-dtype")
    # processes measuring layers (kvlens.recommend.parallel); None: every free core when the
    # per-layer stages are predicted to be long
    workers: int | None = _main(None, "--workers")
    # research candidate extensions switched on: settings objects or registered names
    extensions: tuple[Any, ...] = _library(())
    # 3-bit codes only when asked (docs/lab-notes/vs-llamacpp.md, dense 3-bit codes)
    bits: tuple[int, ...] = _lever((2, 4, 8), "bits", "candidate bit widths (2, 3, 4, 8)")
    group_sizes: tuple[int, ...] = _lever((32, 64, 128), "group-sizes",
                                          "candidate group sizes (per-token ones must divide "
                                          "head_dim, per-channel ones the flush block)")
    pre_rope: str = _lever("auto", "pre-rope", "pre-RoPE key candidates: auto (when the "
                           "capture has RoPE), on (required), off")
    balancer: bool = _lever(True, "balancer", "offer key-channel-balancer key candidates")
    balancer_exponent: float = _lever(0.5, "balancer-exponent",
                                      "balancer b = (max|q| / max|k|) ^ exponent")
    rotation: bool = _lever(True, "rotation", "offer Hadamard-rotated per-token candidates "
                            "(engine targets: llama.cpp with its rotation)")
    # kvlens.recommend.sensitivity: sensitivity_weights (model), layout_factors (layout)
    sensitivity: str = _lever("auto", "sensitivity",
                              "error weights: auto (layout when the model loads), layout (KL "
                              "damage per unit error, per layer and storage family), model "
                              "(one weight per layer), uniform")
    layout_layers: int | None = _lever(None, "layout-layers",
                                       "layout sensitivity: measure every storage family on "
                                       "this many layers only, two anchor families elsewhere")
    layout_tokens: int | None = _lever(None, "layout-tokens",
                                       "layout sensitivity: tokens of its model forwards "
                                       "(default: --tokens)")
    flush_tokens: int = _lever(32, "flush", "quantize the oldest N window tokens at a time "
                               "when the window fills; 0 = the whole window (KIVI)")
    sink_tokens: int = _lever(4, "sinks", "first tokens kept at full precision "
                              "(attention sinks)")
    retrieval: str = _lever("auto", "retrieval", "add errors at the answer position of a "
                            "built-in retrieval prompt: auto (when the model loads), on, off")
    retrieval_weight: float = _lever(1.0, "retrieval-weight", "weight of the retrieval errors")
    prefer_fast: bool = _lever(False, "prefer-fast", "only layouts the fused Triton decode "
                               "kernel reads")
    # QuantSpec.fit per tensor, each a family of its own for the layout sensitivity; keys
    # min/max only by default (docs/recommend.md#the-scale-fit)
    key_fits: tuple[str, ...] = _lever(("minmax",), "key-fits",
                                       "how key groups' scale and zero are chosen: minmax, "
                                       "mse, hqq (one or more)")
    value_fits: tuple[str, ...] = _lever(("minmax", "mse"), "value-fits",
                                         "the same for values")
    # the config's scale_dtype; the error proxy measures the 8-bit grid (kvlens.quant.meta8)
    scale_dtype: str = _lever("8bit", "scale-dtype", "how group scales and zeros are stored: "
                              "8bit or float16")
    layer_weights: tuple[float, ...] | None = _library(None)
    retrieval_tokens: int = _library(960)

    def __post_init__(self) -> None:
        if self.tokens == AUTO:  # frozen: set once, here, from the windows
            object.__setattr__(self, "tokens", default_tokens(self._checked_windows()))
        if not (isinstance(self.budget_bits, (int, float)) and 0 < self.budget_bits <= 16):
            raise OptionError(f"{{budget_bits}} must be in (0, 16], got {self.budget_bits}.")
        self._checked_windows()
        if self.samples is not None and not is_int(self.samples, 1):
            raise OptionError(f"{{samples}} must be a positive number of capture samples (or "
                             f"omitted: all of them), got {self.samples!r}.")
        r = max(self.window_sizes)
        if self.context <= r:
            raise OptionError(f"{{context}} {self.context} must exceed the residual window "
                             f"({r} tokens).")
        self._check_choices()
        self._check_probes(r)
        self._check_candidates()
        self._check_measurement()
        object.__setattr__(self, "extensions", resolve(self.extensions))
        if self.tokens is not None and self.tokens <= max(r, self.score_from):
            raise OptionError(f"{{tokens}} {self.tokens} must exceed "
                             + (f"three times the largest window ({self.score_from}): with several "
                                "windows errors are scored on the queries from there on, "
                                f"e.g. {{tokens}} {default_tokens(self.window_sizes)}."
                                if self.score_from else
                                f"the residual window ({r}): errors are measured on the "
                                "queries that read quantized history."))

    def _check_probes(self, r: int) -> None:
        """The retrieval probe and the pre-RoPE candidates."""
        if not self.retrieval_weight >= 0:
            raise OptionError(f"{{retrieval_weight}} must be >= 0, got {self.retrieval_weight}.")
        if self.retrieval_tokens <= r + 64:
            raise InputError(f"The retrieval probe ({self.retrieval_tokens} tokens) must be well "
                             f"beyond the residual window ({r}).")
        if self.prefer_fast and self.pre_rope == "on":
            raise OptionError("{prefer_fast}=on keeps only layouts the fused decode kernel reads, "
                             "and it does not read pre-RoPE keys; use {pre_rope}=auto or off.")

    def _check_choices(self) -> None:
        """The options that take one of a few names (``CHOICES``)."""
        for name, allowed in CHOICES:
            if getattr(self, name) not in allowed:
                raise OptionError(f"Unknown {{{name}}}={getattr(self, name)!r}; allowed: "
                                  f"{listed(allowed)}.")

    def _check_candidates(self) -> None:
        """The fits, bit widths, group sizes, flush block and sinks offered."""
        for name in ("key_fits", "value_fits"):
            fits = getattr(self, name)
            if not fits or any(f not in FITS for f in fits) or len(set(fits)) != len(fits):
                raise OptionError(f"{{{name}}}={','.join(fits) or '(empty)'}: give one or both "
                                  f"of {listed(FITS)}, each once.")
        bad = [b for b in self.bits if b not in (2, 3, 4, 8)]
        if bad:
            raise InputError(f"Unsupported bit widths {bad}; allowed: 2, 3, 4, 8.")
        bad = [g for g in self.group_sizes
               if g <= 0 or all(w % g for w in self.window_sizes)]
        if bad:
            raise InputError(f"Group sizes {bad} do not divide the residual window "
                             f"({listed(self.window_sizes)}), which per-channel keys need.")
        f = self.flush_tokens
        if f < 0 or f % 4 or any(f % g for g in self.group_sizes if g < f):
            raise OptionError(f"{{flush_tokens}}={f} must be 0 (flush the whole window) or a multiple of "
                             "4 and of the smaller group sizes (a block >= the residual window "
                             "also flushes it whole).")
        if self.sink_tokens < 0:
            raise OptionError(f"{{sink_tokens}} must be >= 0, got {self.sink_tokens}.")

    def _check_measurement(self) -> None:
        """The layout sensitivity's size and the worker processes."""
        if self.layout_layers is not None and not is_int(self.layout_layers, 1):
            raise OptionError(f"{{layout_layers}} must be a positive number of layers (or None: "
                             f"every layer), got {self.layout_layers!r}.")
        if self.layout_tokens is not None and \
                not is_int(self.layout_tokens, max(self.window_sizes) + 1):
            raise OptionError(f"{{layout_tokens}}={self.layout_tokens!r} must be a number of tokens "
                             f"above the largest window ({max(self.window_sizes)}): the layout "
                             "sensitivity's forwards stand for contexts the window does not "
                             "cover (or omit it: {tokens}).")
        if self.workers is not None and not is_int(self.workers, 1):
            raise OptionError(f"{{workers}} must be a positive number of processes (or omitted: "
                             f"as many as there are free cores), got {self.workers!r}.")

    def _checked_windows(self) -> tuple[int, ...]:
        if not self.windows:
            raise OptionError("{windows} is empty; give one or more window sizes (tokens), "
                             f"e.g. {listed(DEFAULT_WINDOWS, ',')}.")
        bad = [w for w in self.windows if not is_int(w, 1)]
        if bad:
            raise InputError(f"Window sizes {bad} are not allowed; allowed: positive integers "
                             f"(tokens kept at full precision), e.g. "
                             f"{listed(DEFAULT_WINDOWS, ',')}.")
        return self.window_sizes

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """The full-precision window sizes a layer chooses among, ascending."""
        return tuple(sorted(set(self.windows)))

    @property
    def score_from(self) -> int:
        """First query scored: 0 with one window; with several, three times the largest, so
        every option is compared on the same queries (docs/recommend.md)."""
        sizes = self.window_sizes
        return 3 * max(sizes) if len(sizes) > 1 else 0

    def layer_flush(self, *cands: Candidate, residual: int | None = None) -> int:
        """``flush_tokens`` of a layer storing ``cands`` with a window of ``residual`` tokens
        (default: the largest offered): the sliding block, raised to the per-channel group
        sizes (a group needs all its tokens); 0 when that is the whole window (the KIVI
        default)."""
        r = max(self.window_sizes) if residual is None else residual
        if not self.flush_tokens:
            return 0
        f = max([self.flush_tokens] + [c.group_size for c in cands
                                        if c.granularity == "per-channel"])
        return 0 if f >= r else f

    def fits_for(self, tensor: str) -> tuple[str, ...]:
        """The scale fits offered for ``tensor`` ("key" or "value")."""
        return self.key_fits if tensor == "key" else self.value_fits

    def twin_settings(self) -> list[Twin]:
        """The config-wide twin settings the allocation solves for separately, one extension's
        each (none: ``[]``)."""
        return [Twin(e.name, s) for e in self.extensions for s in e.settings(self)]

    def flush_options(self, residual: int | None = None) -> list[int]:
        """Every flush block a layer with a ``residual``-token window can end up with (see
        ``layer_flush``)."""
        gs = [Candidate("key", 2, "per-channel", g) for g in self.group_sizes]
        return sorted({self.layer_flush(residual=residual)} |
                      {self.layer_flush(c, residual=residual) for c in gs})

    def streams(self) -> list[Stream]:
        """Every (window, flush block) a layer can end up with."""
        return [Stream(r, f) for r in self.window_sizes for f in self.flush_options(r)]


def default_tokens(windows: Sequence[int]) -> int:
    """Capture tokens to measure errors on: 256 with one window, four times the largest with
    several."""
    return 256 if len(set(windows)) <= 1 else 4 * max(windows)


def listed(values, sep: str = ", ") -> str:
    """``values`` joined by ``sep`` for a message: ``(2, 4, 8)`` -> ``"2, 4, 8"``."""
    return sep.join(str(v) for v in values)
