"""``kvlens recommend``: choose a per-layer KV quantization config under a memory budget.

Pipeline (one capture layer in memory at a time):

1. **Candidates** per tensor: keys and values x granularity (per-channel, per-token) x bits
   (2, 4, 8 by default; 3 with ``bits``: measured not to earn, docs/recommend.md) x group
   size; keys also pre-RoPE (KVQuant) and, for per-token keys, with the
   MiKV channel balancer fitted on the capture (``b = (max|q| / max|k|)^exponent``); with
   ``gear`` (default on) also GEAR twins of the plain G32 candidates up to 4 bits (GEAR's
   published settings, ``GEAR_SETTINGS``: 2% outliers per vector, rank 4 per flushed block,
   measured block by block at the layer's flush block). A layer takes GEAR for both tensors or
   for neither (the config's ``gear.layers``). With ``mikv`` (default on) the G32 candidates
   up to 4 bits (plain or balanced) also have MiKV set twins, one per global ``(set_bits,
   heavy_fraction)`` of ``mikv_set_bits`` x ``mikv_fractions``: heavy hitters and sinks kept
   at ``set_bits`` codes, measured by replaying the cache's H2O selection while decoding
   (``kvlens.analysis.heavy_hitters``); a layer takes the set for both tensors or neither (the config's
   ``mikv.layers``). Only what ``kvlens generate`` can run is offered.
2. **Cost** of a layer's (key, value, window, flush) choice: the bytes that layer of the cache
   holds after ``L`` tokens (default 4096), from ``kvlens.cache.layout`` (the same description
   the cache allocates by, tested against held bytes): codes at their bits (dense), fp16
   scales and zeros, the window buffer (``R`` fp16 tokens, ``R`` chosen per layer from
   ``windows``), the sink tokens' fp16 copies and positions, pre-RoPE positions, balancers,
   GEAR's outlier values and indices and low-rank factors, MiKV sets (codes, scales,
   positions, H2O mask and accumulators); a sliding-window layer counts only what it keeps.
   The budget
   is in bits per element relative to an fp16 cache of the same tokens (16 = as big as fp16).
3. **Error** of a candidate, measured where the tensor is consumed: the relative error of the
   attention output (``kvlens.analysis.metrics``) when only that tensor is quantized, mean over the
   layer's query heads, *as the cache is read while decoding*: query ``i`` reads the tokens
   still in the window and the sink tokens exact (``streaming_exact_mask``). The window slides:
   when it fills, its oldest ``F`` tokens are quantized (``flush_tokens``; ``F`` is raised to a
   per-channel group size, since a group needs all its tokens), so each candidate is measured
   for every window ``R`` and ``F`` it can be stored with. Score and reconstruction errors are
   recorded too, to explain. By default the first ``tokens=256`` tokens of every capture
   sample (``samples=None``) are used (about 170 attention passes per layer and sample; a few
   seconds per layer on 2 CPU cores); with several windows every option is scored on the same
   queries, from ``score_from`` (three times the largest window) on, of ``default_tokens`` (four times it).
4. **Sensitivity**: with ``sensitivity="model"`` each layer gets a weight ``w_l`` = KL damage
   of the real model's predictions per unit of attention-output error, measured by
   probe-quantizing that layer alone (``kvlens.analysis.sensitivity``); ``uniform`` sets ``w_l = 1``.
5. **Allocation**: pick one (key, value, window) option per layer (which fixes its ``F``)
   minimising ``sum_l w_l (e_K + e_V)`` subject to the mean cost over all layers and both
   tensors <= budget: a multiple-choice knapsack over each layer's Pareto front, solved exactly
   by dynamic programming on costs rounded up to 1/64 bit (so the budget is never exceeded).
   Config-wide choices are solved for separately and the best objective kept: with and without
   rotated candidates (the shared matrix), without MiKV sets and with each ``(set_bits,
   heavy_fraction)``.
6. **Decode cost**: the bytes one decode step reads at ``L`` tokens for the recommendation and
   the presets (``kvlens.cache.decode_cost``: a documented model, not a timing) and whether the
   fused Triton kernel reads every layer. ``prefer_fast`` (``--prefer-fast``) offers only
   (key, value) pairs the kernel reads (``kvlens.cache.attention.kernel_layout_problem``: no
   pre-RoPE keys), so decoding on CUDA never leaves the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvlens.analysis.compare import layer_rope_tables, torch_threads
from kvlens.analysis.heavy_hitters import set_membership, set_reconstruction
from kvlens.analysis.metrics import (
    Variant,
    attention_errors_many,
    per_head_rel_error,
    streaming_exact_mask,
)
from kvlens.analysis.sensitivity import (
    PROBE_BITS,
    PROBE_GROUP,
    layer_kl,
    perturbed_kl,
    weights_from,
)
from kvlens.cache.attention import kernel_layout_problem
from kvlens.cache.decode_cost import config_decode_cost
from kvlens.cache.gear import part_bytes
from kvlens.cache.layout import (
    FP_BYTES,
    SCALE_BYTES,
    ModelShape,
    config_bits,
    config_part_bytes,
    flush_every,
    layer_part_bytes,
    packed_bytes,
    stream_state,
)
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.config import SET_BITS, GearSettings, KVConfig, LayerKV, MikvSettings, preset
from kvlens.config.rules import check_layout
from kvlens.errors import ConfigError, InputError, KvlensError, PlacementError, is_int
from kvlens.model.architecture import describe
from kvlens.model.load import load_model
from kvlens.model.placement import input_device
from kvlens.quant import (
    QuantSpec,
    fake_quantize,
    fit_balancer,
    hadamard_block_size,
    hadamard_rotation,
    quantize_gear,
    quantize_pre_rope,
    quantize_rotated,
)
from kvlens.quant.spec import FITS
from kvlens.text.prompts import retrieval_text

GRANULARITIES = ("per-channel", "per-token")
COST_RESOLUTION = 64  # DP cost units per bit
GEAR_GROUP = 32  # GEAR twins are offered for KIVI's G32 grouping only (measuring cost)
DEFAULT_WINDOWS = (32, 64, 128)  # the CLI's --windows (docs/recommend.md: why these)


class Stream(NamedTuple):
    """How a layer's full-precision window moves: it holds up to ``residual`` tokens and,
    when full, quantizes its oldest ``flush`` (0 = the whole window, KIVI)."""

    residual: int
    flush: int

    @property
    def block(self) -> int:
        """Tokens quantized together (a per-channel group must divide it)."""
        return self.flush or self.residual
MIKV_GROUP = 32  # so are MiKV set twins (each is simulated while decoding: measuring cost)
MIKV_FRACTION_MAX = 0.5  # largest heavy fraction offered (more is no longer a small set)
SENSITIVITIES = ("auto", "model", "layout", "uniform")


@dataclass(frozen=True)
class Candidate:
    """One way to store one tensor of one layer."""

    tensor: str  # "key" or "value"
    bits: int
    granularity: str
    group_size: int
    stage: str = "post"  # keys only: "pre" = quantize before RoPE
    balancer: bool = False  # keys only: MiKV channel balancer
    rotate: bool = False  # Hadamard rotation along head_dim (kvlens.quant.rotation)
    gear: bool = False  # GEAR outliers + low-rank factors (GEAR_SETTINGS) beside the codes
    # MiKV importance set (set_bits, heavy_fraction) beside the codes; None: sinks only
    mikv_set: tuple[int, float] | None = None
    fit: str = "minmax"  # how each group's scale and zero are chosen (QuantSpec.fit)

    @property
    def short(self) -> str:
        axis = "ch" if self.granularity == "per-channel" else "tok"
        extra = (" pre" if self.stage == "pre" else "") + (" bal" if self.balancer else "") + \
            (" rot" if self.rotate else "") + (" gear" if self.gear else "") + \
            (f" set{self.mikv_set[0]}@{self.mikv_set[1]:g}" if self.mikv_set else "") + \
            (" mse" if self.fit == "mse" else "")
        return f"{self.bits}b {axis} G{self.group_size}{extra}"

    @property
    def label(self) -> str:
        extra = (" pre-RoPE" if self.stage == "pre" else "") + \
            (" +bal" if self.balancer else "") + (" +rotation" if self.rotate else "") + \
            (" +GEAR" if self.gear else "") + \
            (f" +MiKV set {self.mikv_set[1]:g} INT{self.mikv_set[0]}" if self.mikv_set else "") + \
            (" mse-fit" if self.fit == "mse" else "")
        return f"{self.bits}b {self.granularity} G{self.group_size}{extra}"

    @property
    def base(self) -> Candidate:
        """The same storage without the MiKV set."""
        return replace(self, mikv_set=None)

    def spec(self):

        return QuantSpec(self.bits, self.granularity, self.group_size, fit=self.fit)


@dataclass(frozen=True)
class RecommendOptions:
    budget_bits: float
    context: int = 4096
    residual_tokens: int = 128  # the window when ``windows`` is None (one size for every layer)
    windows: tuple[int, ...] | None = None  # window sizes each layer chooses among
    # 3-bit codes (dense, 3 bits each) are offered only when asked: at 3.0 bits they measured
    # no better on average on either model (a Gemma3 allocation with them lost on one unseen
    # text and won on another; docs/vs-llamacpp.md#dense-3-bit-codes-2026-12-02-last)
    bits: tuple[int, ...] = (2, 4, 8)
    group_sizes: tuple[int, ...] = (32, 64, 128)
    pre_rope: str = "auto"  # auto: offer pre-RoPE keys when the capture has RoPE; on; off
    balancer: bool = True
    rotation: bool = True  # offer Hadamard-rotated per-token keys and values
    balancer_exponent: float = 0.5
    # capture samples the error tables are measured on (None: all). All four 512-token samples
    # instead of the first alone took Gemma3-270M's 3.0-bit KLD from 0.097 to 0.075 on held-out
    # text and 0.123 to 0.100 on a never-seen text (docs/recommend.md#calibration-text)
    samples: int | None = None
    tokens: int | None = 256
    layer_weights: tuple[float, ...] | None = None
    # uniform | model | layout | auto (layout when the capture's model is loadable); model: a
    # weight per layer (``_sensitivity_weights``); layout: and a factor per storage family
    # (``_layout_factors``)
    sensitivity: str = "uniform"
    model: str | None = None  # model for sensitivity (default: the capture's model source)
    name: str = "recommended"
    flush_tokens: int = 32  # smallest flush block of the sliding window; 0 = whole window (KIVI)
    sink_tokens: int = 4  # first tokens kept at full precision (attention sinks)
    retrieval: str = "auto"  # add the retrieval probe's errors: auto (when the model loads), on, off
    retrieval_weight: float = 1.0
    retrieval_tokens: int = 960
    prefer_fast: bool = False  # only layouts the fused (Triton) decode kernel reads
    # where the model loaded for sensitivity/retrieval goes (kvlens.model.placement; None = one device)
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None
    gear: bool = True  # offer GEAR twins of the plain G32 candidates (not with prefer_fast)
    # offer MiKV set twins (heavy hitters at set_bits) of the G32 candidates up to 4 bits, for
    # every (set_bits, heavy_fraction) combination (not with prefer_fast)
    mikv: bool = True
    mikv_set_bits: tuple[int, ...] = (4, 8)
    mikv_fractions: tuple[float, ...] = (0.1, 0.2)
    # scale/zero fits offered for the plain, pre-RoPE, balanced and rotated codes, per tensor
    # (QuantSpec.fit); GEAR and MiKV twins take the first; each fit is a family of its own
    # for --sensitivity layout. Keys: min/max only by default (docs/recommend.md#the-scale-fit:
    # fitted keys measured worse than the proxy expects, even with a KL rate of their own)
    key_fits: tuple[str, ...] = ("minmax",)
    value_fits: tuple[str, ...] = ("minmax", "mse")
    # dtype of the full-precision parts (window, sinks, sets, GEAR outliers): the config's
    # fp_dtype; float8_e4m3fn halves their bytes, but the error proxy reads them exact
    # (docs/recommend.md#fp8-windows: it pays at 3.0 bits on both models, costs at 4.0)
    fp_dtype: str = "float16"
    # how each group's scale and zero are stored: the config's scale_dtype; "8bit" (default)
    # halves their bytes (kvlens.quant.meta8) and the error proxy measures the 8-bit grid
    # (docs/recommend.md#8-bit-group-metadata); the Triton kernel decodes the bytes itself
    scale_dtype: str = "8bit"

    def __post_init__(self) -> None:
        if not (isinstance(self.budget_bits, (int, float)) and 0 < self.budget_bits <= 16):
            raise InputError(f"--budget-bits must be in (0, 16], got {self.budget_bits}.")
        self._check_windows()
        if self.samples is not None and not is_int(self.samples, 1):
            raise InputError(f"--samples must be a positive number of capture samples (or "
                             f"omitted: all of them), got {self.samples!r}.")
        r = max(self.window_sizes)
        if self.context <= r:
            raise InputError(f"--context {self.context} must exceed the residual window "
                             f"({r} tokens).")
        if self.sensitivity not in SENSITIVITIES:
            raise InputError(f"Unknown --sensitivity {self.sensitivity!r}; allowed: "
                             f"{_listed(SENSITIVITIES)}.")
        if self.retrieval not in ("auto", "on", "off"):
            raise InputError(f"Unknown --retrieval {self.retrieval!r}; allowed: auto, on, off.")
        if not self.retrieval_weight >= 0:
            raise InputError(f"--retrieval-weight must be >= 0, got {self.retrieval_weight}.")
        if self.retrieval_tokens <= r + 64:
            raise InputError(f"The retrieval probe ({self.retrieval_tokens} tokens) must be well "
                             f"beyond the residual window ({r}).")
        if self.pre_rope not in ("auto", "on", "off"):
            raise InputError(f"Unknown --pre-rope {self.pre_rope!r}; allowed: auto, on, off.")
        if self.prefer_fast and self.pre_rope == "on":
            raise InputError("--prefer-fast keeps only layouts the fused decode kernel reads, "
                             "and it does not read pre-RoPE keys; use --pre-rope auto or off.")

        if self.fp_dtype not in FP_BYTES:
            raise InputError(f"--window-dtype {self.fp_dtype!r}: allowed {_listed(FP_BYTES)}.")
        if self.scale_dtype not in SCALE_BYTES:
            raise InputError(f"--scale-dtype {self.scale_dtype!r}: allowed "
                             f"{_listed(SCALE_BYTES)}.")

        for flag, fits in (("--key-fits", self.key_fits), ("--value-fits", self.value_fits)):
            if not fits or any(f not in FITS for f in fits) or len(set(fits)) != len(fits):
                raise InputError(f"{flag} {','.join(fits) or '(empty)'}: give one or both of "
                                 f"{_listed(FITS)}, each once.")
        bad = [b for b in self.bits if b not in (2, 3, 4, 8)]
        if bad:
            raise InputError(f"Unsupported bit widths {bad}; allowed: 2, 3, 4, 8.")
        bad = [g for g in self.group_sizes
               if g <= 0 or all(w % g for w in self.window_sizes)]
        if bad:
            raise InputError(f"Group sizes {bad} do not divide the residual window "
                             f"({_listed(self.window_sizes)}), which per-channel keys need.")
        f = self.flush_tokens
        if f < 0 or f % 4 or any(f % g for g in self.group_sizes if g < f):
            raise InputError(f"--flush {f} must be 0 (flush the whole window) or a multiple of "
                             "4 and of the smaller group sizes (a block >= the residual window "
                             "also flushes it whole).")
        if self.sink_tokens < 0:
            raise InputError(f"--sinks must be >= 0, got {self.sink_tokens}.")

        bad = [b for b in self.mikv_set_bits if b not in SET_BITS]
        if bad or not self.mikv_set_bits:
            raise InputError(f"Unsupported --mikv-bits {bad or 'none'}; allowed: "
                             f"{', '.join(map(str, SET_BITS))} (the MiKV set's integer widths).")
        bad = [f for f in self.mikv_fractions if not 0 < f <= MIKV_FRACTION_MAX]
        if bad or not self.mikv_fractions:
            raise InputError(f"Unsupported --mikv-fractions {bad or 'none'}; allowed: fractions "
                             f"in (0, {MIKV_FRACTION_MAX}] (MiKV's published 0.2, e.g. 0.1,0.2).")
        if self.tokens is not None and self.tokens <= max(r, self.score_from):
            raise InputError(f"--tokens {self.tokens} must exceed "
                             + (f"three times the largest window ({self.score_from}): with several "
                                "windows errors are scored on the queries from there on, "
                                f"e.g. --tokens {default_tokens(self.window_sizes)}."
                                if self.score_from else
                                f"the residual window ({r}): errors are measured on the "
                                "queries that read quantized history."))

    def _check_windows(self) -> None:
        if self.windows is not None and not self.windows:
            raise InputError("--windows is empty; give one or more window sizes (tokens), "
                             f"e.g. {_listed(DEFAULT_WINDOWS, ',')}.")
        bad = [w for w in self.window_sizes if not is_int(w, 1)]
        if bad:
            raise InputError(f"Window sizes {bad} are not allowed; allowed: positive integers "
                             f"(tokens kept at full precision), e.g. "
                             f"{_listed(DEFAULT_WINDOWS, ',')}.")

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """The full-precision window sizes a layer chooses among, ascending."""
        if self.windows is None:
            return (self.residual_tokens,)
        return tuple(sorted(set(self.windows)))

    @property
    def score_from(self) -> int:
        """First query scored for the text errors: 0 with one window (every query, as
        before); with several, three times the largest window, so that every option is
        compared on the same queries, each with a quantized history at least twice as long as
        the largest window (docs/recommend.md: on shorter histories the proxy overstates what
        a larger window buys)."""
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

    def mikv_sets(self) -> list[tuple[int, float]]:
        """The global (set_bits, heavy_fraction) combinations offered (none: ``[]``)."""
        if not self.mikv or self.prefer_fast:
            return []
        return [(b, f) for b in sorted(set(self.mikv_set_bits))
                for f in sorted(set(self.mikv_fractions))]

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
    """Capture tokens to measure errors on: 256 with one window (as before), four times the
    largest window with several (512 at the default windows: the last quarter scored)."""
    return 256 if len(set(windows)) <= 1 else 4 * max(windows)


def _listed(values, sep: str = ", ") -> str:
    return sep.join(str(v) for v in values)


@dataclass
class Choice:
    layer: int
    tensor: str
    candidate: Candidate
    bits: float
    output_error: float
    score_error: float | None
    reconstruction_error: float
    runner_up: str = ""  # the cheapest candidate with lower error, if the budget ruled it out
    flush_tokens: int = 0  # the layer's flush block (0 = the whole window)
    residual_tokens: int = 0  # the layer's full-precision window

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidate"] = asdict(self.candidate) | {"label": self.candidate.label}
        return d


@dataclass
class Recommendation:
    config: Any  # kvlens.config.kvconfig.KVConfig
    choices: list[Choice]
    budget_bits: float
    mean_bits: float
    expected_output_error: float  # mean over layers of (e_K + e_V) / 2
    context: int
    weights: tuple[float, ...] = ()  # per-layer sensitivity weights used by the allocation
    kv_bytes: dict[int, float] = field(default_factory=dict)  # context -> bytes
    kv_bytes_fp16: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    residual_tokens: int = 0  # the config default's window (layers may differ: choices)
    sink_tokens: int = 0
    windows: tuple[int, ...] = ()  # the window sizes offered
    # [(config name, kvlens.cache.decode_cost.DecodeCost)]: the recommendation, then presets
    decode_cost: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bits": self.budget_bits, "mean_bits": self.mean_bits,
                "expected_output_error": self.expected_output_error, "context": self.context,
                "residual_tokens": self.residual_tokens, "sink_tokens": self.sink_tokens,
                "windows": list(self.windows),
                "layer_weights": list(self.weights), "kv_bytes": self.kv_bytes, "kv_bytes_fp16": self.kv_bytes_fp16,
                "choices": [c.to_dict() for c in self.choices], "notes": self.notes,
                "decode_cost": [{"config": n, **c.to_dict()} for n, c in self.decode_cost],
                "config": self.config.to_dict()}


# -- candidates and costs -------------------------------------------------------------------

def candidates(head_dim: int, opts: RecommendOptions, has_rope: bool) -> list[Candidate]:
    """Every storable candidate; per-token groups larger than head_dim are skipped. Rotated
    candidates are per-token only (where rotation spreads outlier channels over a group;
    measured on SmolLM2 it makes per-channel keys worse, docs/rotation.md) and need a
    head_dim with a Hadamard construction."""

    rotation = opts.rotation
    if rotation:
        try:
            hadamard_block_size(head_dim)
        except ConfigError:
            rotation = False
    out = []
    for tensor in ("key", "value"):
        for gran in GRANULARITIES:
            for g in opts.group_sizes:
                if gran == "per-token" and (g > head_dim or head_dim % g):
                    continue
                fits = opts.fits_for(tensor)
                for b, fit in ((b, f) for b in opts.bits for f in fits):
                    out.append(Candidate(tensor, b, gran, g, fit=fit))
                    if tensor == "key" and has_rope and opts.pre_rope != "off" \
                            and not opts.prefer_fast:
                        out.append(Candidate(tensor, b, gran, g, stage="pre", fit=fit))
                    if tensor == "key" and gran == "per-token" and opts.balancer:
                        out.append(Candidate(tensor, b, gran, g, balancer=True, fit=fit))
                    if gran == "per-token" and rotation:
                        out.append(Candidate(tensor, b, gran, g, rotate=True, fit=fit))
                    if fit != fits[0]:
                        continue
                    if opts.gear and not opts.prefer_fast and g == GEAR_GROUP and b <= 4:
                        out.append(Candidate(tensor, b, gran, g, gear=True))
    # MiKV set twins: plain or balanced post-RoPE G32 codes up to 4 bits (a set beside 8-bit
    # codes buys nothing), one per global (set_bits, heavy_fraction)
    return out + [replace(c, mikv_set=m) for c in out if c.group_size == MIKV_GROUP
                  and c.bits <= 4 and c.stage == "post" and not (c.rotate or c.gear)
                  and c.fit == opts.fits_for(c.tensor)[0] for m in opts.mikv_sets()]


def gear_settings(layers=None):
    """GEAR's published settings as ``recommend`` offers them (2% outliers, rank 4)."""

    return GearSettings(4, 0.02, 3, layers)


def gear_variant(x, c: Candidate, block: int, scale_dtype: str = "float32"):
    """What a GEAR layer with flush block ``block`` holds for ``x`` ``[B, H, T, D]``: blocks of
    ``block`` tokens, each ``D_hat + S + L`` (``kvlens.quant.quantize_gear``, group metadata
    ``scale_dtype``), the tail (a partial block, read from the window in the cache) the same
    on its own."""
    import torch


    g = gear_settings()
    out = []
    for t0 in range(0, x.shape[2], block):
        part = x[:, :, t0:t0 + block]
        rank = min(g.rank, part.shape[2], part.shape[3])
        out.append(quantize_gear(part, c.spec(), rank, g.outlier_fraction, g.power_iters,
                                 scale_dtype=scale_dtype))
    return torch.cat(out, dim=2)


def option_bytes(kc: Candidate, vc: Candidate, flush: int, opts: RecommendOptions, shape,
                 layer: int, residual: int | None = None) -> tuple[int, int, int]:
    """``(total, key share, value share)`` bytes that ``layer`` of the cache holds after
    ``opts.context`` tokens storing keys ``kc`` and values ``vc`` with a window of
    ``residual`` tokens (default: the largest offered) and flush block ``flush``
    (``kvlens.cache.layout``: what the cache allocates; a sliding layer counts what it keeps).
    The shares split what both tensors use (window, sink copies, positions) evenly; they are
    for display."""

    r = max(opts.window_sizes) if residual is None else residual
    setting = LayerKV(kc.spec(), vc.spec(), r, kc.stage == "pre",
                      flush_tokens=flush, rotate_keys=kc.rotate, rotate_values=vc.rotate)
    w = shape.window(layer)
    mikv = _layer_mikv(kc, opts)
    fp, sb = FP_BYTES[opts.fp_dtype], SCALE_BYTES[opts.scale_dtype]
    parts = layer_part_bytes(setting, tokens=opts.context, head_dim=shape.head_dim,
                             kv_heads=shape.kv_heads, mikv=mikv, balancer=kc.balancer,
                             sliding_window=w, gear=gear_settings() if kc.gear else None,
                             fp_bytes=fp, scale_bytes=sb)
    total = sum(parts.values())
    held = stream_state(setting, opts.context, w).q_held
    f = flush_every(setting)
    own = [shape.kv_heads * (sum(packed_bytes(c.spec(), held, f, shape.head_dim, sb)) + (
        sum(part_bytes(c.spec(), gear_settings(), held, f, shape.head_dim, fp)) if c.gear
        else 0)) for c in (kc, vc)]
    shared = (total - sum(own)) / 2
    return total, own[0] + shared, own[1] + shared


def _layer_mikv(c: Candidate, opts: RecommendOptions):
    """The MiKV settings a layer storing ``c`` keeps its set with (what the written config's
    ``mikv_for`` gives that layer): heavy hitters at ``c.mikv_set``, else the sinks at fp16."""

    if c.mikv_set:
        bits, fraction = c.mikv_set
        return MikvSettings(fraction, opts.sink_tokens, "off", set_bits=bits)
    return MikvSettings(0.0, opts.sink_tokens, "off") if opts.sink_tokens else None


def tensor_fp16_bytes(shape, layer: int, context: int) -> int:
    """Bytes of one tensor (K or V) of ``layer`` in an fp16 cache after ``context`` tokens."""
    return shape.kv_heads * shape.visible_tokens(layer, context) * shape.head_dim * 2


# -- error measurement ----------------------------------------------------------------------

def measure_layer(layer, meta, cands: Sequence[Candidate], opts: RecommendOptions,
                  plain: Sequence[Candidate] = (), queries: int | None = None, balancer=None):
    """Per-candidate mean errors on one capture layer and the fitted balancer ``[Hkv, D]``
    (None when no candidate uses it).

    Errors are ``{(candidate, Stream(R, F)): (out, score, recon)}`` for every window ``R``
    (``opts.window_sizes``) and flush block ``F`` the candidate can be stored with
    (``opts.streams()``), measured as the cache reads history while decoding: recent tokens
    (the window, as it slides with ``F``) and the first ``opts.sink_tokens`` exact
    (``kvlens.analysis.metrics.streaming_exact_mask``), on queries from ``opts.score_from`` on. MiKV
    set twins (``Candidate.mikv_set``) are measured as such a layer decodes
    (``_SetVariants``); a sliding-window layer keeps no set, so has no twins. Candidates in
    ``plain`` are also measured with every token quantized, key ``(candidate, None)`` (the
    sensitivity probe, which quantizes the whole layer). ``queries``: score only the last
    queries (the retrieval probe's answer position). ``balancer``: use this fitted balancer
    instead of fitting one on this layer's data."""

    q, k, v, variants, bal, pre_ok = layer_variants(layer, meta, cands, opts, balancer)
    n_tok = k.shape[2]
    if n_tok <= max(max(opts.window_sizes), opts.score_from):
        raise InputError(f"The capture has {n_tok} tokens per sample, no more than "
                         + (f"three times the largest window ({opts.score_from}), where the errors "
                            "of several windows are scored from" if opts.score_from else
                            f"the residual window ({max(opts.window_sizes)}): no query would "
                            "read quantized history")
                         + ". Capture longer samples or offer smaller windows.")
    la = layer.attrs
    runs: list[tuple[Stream | None, list[Candidate]]] = [
        (s, [c for c in variants if _fits(c, s)]) for s in opts.streams()]
    runs.append((None, [c for c in plain if c in variants]))
    out, recon = {}, {}
    sets = _SetVariants(q, k, v, la, opts)
    for s, run in runs:
        if not run:
            continue
        for c in run:  # GEAR's low-rank factors are per flushed block: a variant per block
            if c.gear:
                x_hat = gear_variant(v if c.tensor == "value" else k, c,
                                     s.block if s is not None else n_tok, opts.scale_dtype)
                variants[c] = Variant(v_hat=x_hat) if c.tensor == "value" \
                    else Variant(k_hat=x_hat)
        # the probe quantizes every token (no window): it is scored on every query
        start = n_tok - queries if queries is not None else 0 if s is None else opts.score_from
        rows, picked = q[:, :, start:], slice(start, None)
        # a layer with a MiKV set holds its sinks in the set (at its codes), not exact
        for group, sinks in (([c for c in run if not c.mikv_set], opts.sink_tokens),
                             ([c for c in run if c.mikv_set], 0)):
            if not group:
                continue
            exact = None if s is None else streaming_exact_mask(
                n_tok, s.residual, s.flush, sinks)[picked]
            vs = [sets.variant(c, variants[c.base], s, picked) if c.mikv_set else variants[c]
                  for c in group]
            errs = attention_errors_many(rows, k, v, vs, scaling=la.scaling,
                                         sliding_window=la.sliding_window,
                                         softcap=la.logit_softcap, exact=exact,
                                         reconstruction=False)
            for c, e in zip(group, errs):
                if c.base not in recon:  # the same for every stream and set: once per candidate
                    var = variants[c.base]
                    recon[c.base] = float(per_head_rel_error(v, var.v_hat).mean()
                                          if c.tensor == "value"
                                          else per_head_rel_error(k, var.k_hat).mean())
                out[c, s] = (float(e.output.mean()),
                             None if e.scores is None else float(e.scores.mean()), recon[c.base])
    return out, bal, pre_ok


def layer_variants(layer, meta, cands: Sequence[Candidate], opts: RecommendOptions,
                   balancer=None):
    """``(q, k, v, variants, balancer, pre_ok)`` of one capture layer (``opts.samples`` and
    ``opts.tokens``): ``variants[c]`` is what the cache would give back for candidate ``c``
    with every token quantized (a ``kvlens.analysis.metrics.Variant``), None for MiKV set and GEAR
    twins (they depend on the flush block: built by ``measure_layer``); pre-RoPE candidates
    are left out when the capture's RoPE cannot be rebuilt (``pre_ok`` False)."""

    sel = None if opts.samples is None else list(range(min(opts.samples, meta.num_samples)))
    t = slice(None) if opts.tokens is None else slice(0, opts.tokens)
    q, k, v = (layer.read(n, samples=sel)[:, :, t] for n in ("q", "k", "v"))
    pre_ok = any(c.stage == "pre" for c in cands) and meta.has_rope
    tables = None
    if pre_ok:
        k_pre = layer.read("k_pre", samples=sel)[:, :, t]
        # this layer's theta (Gemma3: one on sliding, one on global layers); scaled RoPE
        # (YaRN...) cannot be rebuilt: no pre-RoPE candidates then
        tables, _ = layer_rope_tables(meta, k, k_pre)
        pre_ok = tables is not None
    bal = balancer
    if bal is None and any(c.balancer for c in cands):
        bal = fit_balancer(q, k, opts.balancer_exponent)
    la = layer.attrs
    rot = hadamard_rotation(k.shape[-1]) if any(c.rotate for c in cands) else None
    variants: dict[Candidate, Variant] = {}
    sd = opts.scale_dtype  # the group metadata the cache will store
    for c in cands:
        if c.stage == "pre" and not pre_ok:
            continue
        spec = c.spec()
        if c.mikv_set:  # the set depends on the flush block: built per run below
            if not la.sliding_window and c.base in cands:
                variants[c] = None
        elif c.gear:  # depends on the flush block: built per run below
            variants[c] = None
        elif c.rotate:  # what the cache stores (x R) seen back in the original basis
            x_hat = quantize_rotated(v if c.tensor == "value" else k, spec, rot, sd)
            variants[c] = Variant(v_hat=x_hat) if c.tensor == "value" else Variant(k_hat=x_hat)
        elif c.tensor == "value":
            variants[c] = Variant(v_hat=fake_quantize(v, spec, sd))
        elif c.stage == "pre":
            variants[c] = Variant(k_hat=quantize_pre_rope(k_pre, *tables, spec,
                                                          meta.rope_layout, scale_dtype=sd))
        elif c.balancer:
            b = bal[None, :, None, :]
            variants[c] = Variant(k_hat=fake_quantize(k * b, spec, sd) / b)
        else:
            variants[c] = Variant(k_hat=fake_quantize(k, spec, sd))
    return q, k, v, variants, bal, pre_ok


class _SetVariants:
    """``Variant``s of MiKV set twins on one capture layer: each tensor measured alone, as for
    every candidate, with the set the cache would keep (``kvlens.analysis.heavy_hitters``): for keys, the
    H2O attention accumulated through the candidate's codes and the set's codes; for values
    (keys exact) through exact keys, so one set per (heavy fraction, stream)."""

    def __init__(self, q, k, v, attrs, opts: RecommendOptions):
        self.q, self.k, self.v, self.attrs, self.opts = q, k, v, attrs, opts
        self._recon: dict = {}
        self._members: dict = {}

    def reconstruction(self, tensor: str, bits: int):

        if (tensor, bits) not in self._recon:
            x = self.k if tensor == "key" else self.v
            self._recon[tensor, bits] = set_reconstruction(x, bits)
        return self._recon[tensor, bits]

    def membership(self, key, k_read, k_set, fraction: float, stream: Stream):

        if key not in self._members:
            mikv = MikvSettings(fraction, self.opts.sink_tokens, "off")
            self._members[key] = set_membership(
                self.q, self.k, k_read, k_set, mikv, scaling=self.attrs.scaling,
                residual_tokens=stream.residual, flush_tokens=stream.flush,
                softcap=self.attrs.logit_softcap)
        return self._members[key]

    def variant(self, c: Candidate, base, stream: Stream, rows: slice):
        """``c``'s variant with the layer's window moving as ``stream``, for the query
        ``rows`` measured."""

        bits, fraction = c.mikv_set
        x_set = self.reconstruction(c.tensor, bits)
        if c.tensor == "key":
            member = self.membership((c, stream), base.k_hat, x_set, fraction, stream)
            return Variant(k_hat=base.k_hat, in_set=member[:, :, rows], k_set=x_set)
        member = self.membership((fraction, stream), self.k, self.k, fraction, stream)
        return Variant(v_hat=base.v_hat, in_set=member[:, :, rows], v_set=x_set)


def _fits(c: Candidate, stream: Stream) -> bool:
    """Can ``c`` be stored in a layer whose window moves as ``stream``?"""

    if c.gear and gear_settings().rank > stream.block:
        return False
    if c.granularity != "per-channel":
        return True
    try:  # the cache's own rule: the group and the code packing must divide the block
        check_layout(c.spec(), stream.residual, 0, flush_tokens=stream.flush)
    except ConfigError:
        return False
    return True


def check_windows(head_dim: int, opts: RecommendOptions, cands: Sequence[Candidate]) -> None:
    """Refuse a window size at which no (key, value) pair can be stored, naming the sizes
    that can (with ``opts.group_sizes``, ``opts.flush_tokens`` and this ``head_dim``)."""
    def storable(r: int) -> bool:
        streams = [Stream(r, f) for f in opts.flush_options(r)]
        return all(any(c.tensor == t and _fits(c, s) for c in cands for s in streams)
                   for t in ("key", "value"))

    bad = [r for r in opts.window_sizes if not storable(r)]
    if bad:
        ok = [r for r in range(1, 2 * max(max(opts.group_sizes), opts.flush_tokens) + 1)
              if storable(r)]
        raise InputError(f"No candidate can be stored with a window of {_listed(bad)} tokens "
                         f"(per-channel groups {_listed(opts.group_sizes)} must divide the "
                         f"flush block, per-token groups head_dim {head_dim}); allowed window "
                         f"sizes up to {ok[-1] if ok else 0}: {_ranges(ok) or 'none'}"
                         f"{' and above' if ok else ''}.")


def _ranges(values: Sequence[int]) -> str:
    """``1, 2, 3, 5`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


# -- allocation -----------------------------------------------------------------------------

def allocate(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
             budget_total: float) -> list[int]:
    """Multiple-choice knapsack: one option per group, ``sum cost <= budget_total``, minimal
    ``sum error``. Exact on costs rounded *up* to ``1/COST_RESOLUTION`` (never over budget).
    Raises ``InputError`` when even the cheapest options exceed the budget."""
    import numpy as np

    units = [np.ceil(np.asarray(c, dtype=float) * COST_RESOLUTION - 1e-9).astype(int)
             for c in costs]
    cap = int(math.floor(budget_total * COST_RESOLUTION + 1e-9))
    minimum = sum(int(u.min()) for u in units)
    if minimum > cap:
        raise InputError(
            f"The budget is too small: the cheapest candidates need "
            f"{minimum / COST_RESOLUTION / len(costs):.3f} bits per element on average, "
            f"more than the {budget_total / len(costs):.3f} asked for.")
    inf = float("inf")
    best = np.full(cap + 1, inf)
    best[0] = 0.0
    picks = []
    for u, e in zip(units, errors):
        new = np.full(cap + 1, inf)
        arg = np.full(cap + 1, -1, dtype=int)
        for i, (cu, ce) in enumerate(zip(u, e)):
            if cu > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[cu:] = best[:cap + 1 - cu] + ce
            better = cand < new
            new[better] = cand[better]
            arg[better] = i
        best = new
        picks.append(arg)
    end = int(np.argmin(best))
    chosen = []
    for u, arg in zip(reversed(units), reversed(picks)):
        i = int(arg[end])
        chosen.append(i)
        end -= int(u[i])
    return chosen[::-1]


# -- the whole command ----------------------------------------------------------------------

ProgressFn = Callable[[int, int, str], None]


@dataclass
class Measurements:
    """Everything ``recommend`` measured on a capture; ``choose`` allocates from it for any
    budget without measuring again."""

    meta: Any
    tables: list[dict]  # per layer: {Candidate: (output_err, score_err, recon_err)}
    balancers: dict[int, Any]
    weights: tuple[float, ...]
    notes: list[str]
    windows: tuple[int | None, ...] = ()  # per layer sliding window (None = global)
    # per layer {storage family: factor on top of the layer weight} (--sensitivity layout)
    factors: tuple[dict, ...] = ()


def recommend(path: str | Path, opts: RecommendOptions,
              progress: ProgressFn | None = None) -> Recommendation:
    """Measure every candidate on the capture, allocate under the budget, build the config."""
    return choose(measure(path, opts, progress), opts)


def measure(path: str | Path, opts: RecommendOptions,
            progress: ProgressFn | None = None) -> Measurements:
    """Per-layer candidate errors, fitted balancers and layer sensitivity weights."""
    import torch


    # One thread: these many small attention passes run several times faster than with two
    # threads on a 2-core machine (measured: 0.6-0.8 s vs 2-15 s per SmolLM2 layer). The
    # model's forwards (sensitivity) get the threads the caller had.
    threads = torch.get_num_threads()
    with open_capture(path) as cap, torch_threads(1):
        meta = cap.meta
        if tuple(meta.layers) != tuple(range(meta.num_layers)):
            raise InputError(f"{path} captures layers {list(meta.layers)}, but a recommendation "
                             f"needs all {meta.num_layers}; re-run `kvlens capture` without "
                             "--layers.")
        if opts.layer_weights and len(opts.layer_weights) != meta.num_layers:
            raise InputError(f"{len(opts.layer_weights)} layer weights given for "
                             f"{meta.num_layers} layers.")
        if opts.pre_rope == "on" and not meta.has_rope:
            raise InputError(f"Pre-RoPE keys were requested but {path} has no pre-RoPE data: "
                             f"{meta.model} has no rotary embedding (q_pre/k_pre equal q/k). "
                             "Use --pre-rope auto or off.")
        cands = candidates(meta.head_dim, opts, meta.has_rope)
        check_windows(meta.head_dim, opts, cands)
        probes = _probe_candidates(meta.head_dim)
        tables, balancers, notes, windows = [], {}, [], []
        for i, layer in enumerate(cap.iter_layers()):
            windows.append(layer.attrs.sliding_window or None)
            table, bal, pre_ok = measure_layer(layer, meta, cands + [
                p for p in probes if p not in cands], opts, plain=probes)
            if opts.pre_rope == "on" and not pre_ok:
                raise InputError(f"Pre-RoPE keys were requested but the RoPE of {meta.model} "
                                 "cannot be rebuilt from the capture's config (scaled RoPE?).")
            if not pre_ok and meta.has_rope and opts.pre_rope == "auto" and not notes:
                notes.append(f"pre-RoPE candidates skipped from layer {layer.index} on where "
                             "default RoPE at no theta rebuilds the stored keys from the "
                             "stored pre-RoPE keys (scaled RoPE?)")
            tables.append(table)
            if bal is not None:
                balancers[layer.index] = bal
            if progress:
                progress(i + 1, meta.num_layers, f"layer {layer.index}")
        need = (opts.sensitivity != "uniform" and not opts.layer_weights) or \
            opts.retrieval != "off"
        model, tokenizer = _model_for(cap, opts, notes) if need else (None, None)
        with torch_threads(threads):
            weights = opts.layer_weights or _sensitivity_weights(cap, model, opts, tables,
                                                                 probes, notes, progress)
        if model is not None and opts.retrieval != "off" and opts.retrieval_weight > 0:
            _add_retrieval_errors(model, tokenizer, cands, opts, tables, balancers, notes,
                                  progress)
        factors: tuple[dict, ...] = ()
        if opts.sensitivity in ("layout", "auto") and model is not None \
                and not opts.layer_weights:
            with torch_threads(threads):
                weights, factors = _layout_factors(cap, model, opts, cands, balancers, notes,
                                                   progress)
    wanted = set(candidates(meta.head_dim, opts, meta.has_rope))
    tables = [{cf: e for cf, e in t.items() if cf[0] in wanted and cf[1] is not None}
              for t in tables]
    return Measurements(meta, tables, balancers, tuple(weights), notes, tuple(windows),
                        factors)


def _model_for(cap, opts: RecommendOptions, notes: list[str]):
    """The capture's model (or ``opts.model``) for sensitivity and the retrieval probe:
    ``(model, tokenizer)``, or ``(None, None)`` with a note when "auto" settings allow."""

    meta = cap.meta
    spec = opts.model or model_spec_from_capture(meta)
    try:
        if spec is None:
            raise InputError(f"{cap.path} does not say which model it came from; pass --model.")

        model, tokenizer, _ = load_model(spec, device_map=opts.device_map,
                                         max_memory=opts.max_memory,
                                         offload_folder=opts.offload_folder)
        info = describe(model)
        if (info.num_layers, info.head_dim, info.num_key_value_heads) != (
                meta.num_layers, meta.head_dim, meta.num_key_value_heads):
            raise InputError(f"Model {spec} does not match the capture (layers/head_dim/KV "
                             "heads differ).")
    except KvlensError as exc:
        required = (opts.sensitivity in ("model", "layout") and not opts.layer_weights) or \
            opts.retrieval == "on"
        if required or isinstance(exc, PlacementError):  # a placement asked for must work
            raise
        notes.append(f"uniform layer weights and no retrieval probe: the model is unavailable "
                     f"({exc})")
        return None, None
    return model, tokenizer


def _add_retrieval_errors(model, tokenizer, cands, opts, tables, balancers, notes, progress):
    """Add ``retrieval_weight`` x each candidate's error at the retrieval probe's answer
    position (``kvlens.text.prompts``) to the text errors in ``tables``."""
    import tempfile


    text, _ = retrieval_text(tokenizer, opts.retrieval_tokens)
    ids = tokenizer(text, return_tensors="pt").input_ids.to(input_device(model))
    probe_opts = replace(opts, samples=None, tokens=None)
    with tempfile.TemporaryDirectory(prefix="kvlens-probe-") as tmp:
        path = Path(tmp) / "probe.h5"
        capture_model(model, ids, path)
        with open_capture(path) as cap:
            n = cap.meta.num_layers
            for i, layer in enumerate(cap.iter_layers()):
                extra, _, _ = measure_layer(layer, cap.meta, cands, probe_opts, queries=4,
                                            balancer=balancers.get(layer.index))
                table = tables[i]
                for key, (out, _, _) in extra.items():
                    if key in table:
                        o, sc, rc = table[key]
                        table[key] = (o + opts.retrieval_weight * out, sc, rc)
                if progress:
                    progress(i + 1, n, f"retrieval probe layer {layer.index}")
    notes.append(f"errors include a retrieval probe ({ids.shape[1]} tokens, answer position, "
                 f"weight {opts.retrieval_weight:g}): see kvlens.text.prompts")


def choose(m: Measurements, opts: RecommendOptions) -> Recommendation:
    """Allocate under ``opts.budget_bits`` from earlier measurements and build the config."""
    tables = [{k: e for k, e in t.items() if k[0].fit in opts.fits_for(k[0].tensor)}
              for t in m.tables]  # measured with more fits than offered now: drop the rest
    return _assemble(m.meta, opts, tables, m.balancers, m.weights, list(m.notes),
                     model_shape(m.meta, m.windows), m.factors)


def model_shape(meta, windows=()):
    """``kvlens.cache.layout.ModelShape`` of a capture's model (``windows``: per layer)."""

    return ModelShape(meta.num_layers, meta.num_key_value_heads, meta.head_dim,
                      tuple(windows) if any(windows) else ())


def _probe_candidates(head_dim: int) -> tuple[Candidate, Candidate]:

    g = PROBE_GROUP if head_dim % PROBE_GROUP == 0 else head_dim
    return (Candidate("key", PROBE_BITS, "per-token", g),
            Candidate("value", PROBE_BITS, "per-token", g))


def model_spec_from_capture(meta) -> str | None:
    """The ``--model`` string that reloads the captured model, if the capture says."""
    kind, _, where = meta.model_source.partition(":")
    return where if kind in ("gguf", "dir", "hub") and where else None


def _sensitivity_weights(cap, model, opts, tables, probes, notes, progress
                         ) -> tuple[float, ...]:

    meta = cap.meta
    if opts.sensitivity in ("uniform", "layout", "auto") or model is None:
        return (1.0,) * meta.num_layers
    n = meta.num_tokens if opts.tokens is None else min(opts.tokens, meta.num_tokens)
    ids = cap.tokens()[:1, :n].to(input_device(model))
    kl = layer_kl(model, ids, list(meta.layers), progress, group_size=probes[0].group_size)
    # the probe quantizes every token of the layer, so its error is measured that way too
    probe_err = [t[probes[0], None][0] + t[probes[1], None][0] for t in tables]
    weights = weights_from(kl, probe_err)
    notes.append("layer weights from measured sensitivity (KL per unit output error): "
                 f"min {min(weights):.2f}, max {max(weights):.2f} "
                 f"(layer {weights.index(max(weights))})")
    return tuple(weights)


def family(c: Candidate) -> tuple:
    """The storage family ``--sensitivity layout`` measures one factor for: tensor, axis,
    transforms and the scale fit (bits, group size, GEAR and a MiKV set share their base's
    factor). The fit has its own: a least-squares fit clips a group's extremes, and on
    Gemma3-270M fitted keys turned their output error into KL at another rate than min/max
    keys (docs/recommend.md, the scale fit)."""
    return (c.tensor, c.granularity, c.stage, c.balancer, c.rotate, c.fit)


def family_probes(cands: Sequence[Candidate]) -> list[Candidate]:
    """One candidate per storage family, at its fewest bits (where layouts differ most):
    per-channel at the smallest group (KIVI's), per-token at the largest (cheapest scales)."""
    out = []
    for fam in dict.fromkeys(family(c) for c in cands):
        members = [c for c in cands if family(c) == fam and not (c.gear or c.mikv_set)]
        if not members:
            continue
        bits = min(c.bits for c in members)
        at = [c for c in members if c.bits == bits]
        pick = min if fam[1] == "per-channel" else max
        out.append(pick(at, key=lambda c: c.group_size))
    return out


def _layout_factors(cap, model, opts, cands, balancers, notes, progress):
    """``(layer weights, per-layer {family: factor})`` for ``--sensitivity layout``: for every
    layer and storage family, the model's KL when only that layer's keys (or values) are
    replaced by the family probe's reconstruction (every token quantized), per unit of the
    probe's attention-output error on the same queries (the capture's first sample, KL and
    error on its last half). The rates are normalised to mean 1 over all layers and families;
    the layer weight is a layer's mean rate, a family's factor its rate over that mean (so
    weight x factor is the rate). A first-order rate, like ``--sensitivity model``, but
    one per layout: the rate at which a layout's output error becomes KL differs between
    layouts (Gemma3-270M, docs/vs-llamacpp.md)."""

    meta = cap.meta
    n = meta.num_tokens if opts.tokens is None else min(opts.tokens, meta.num_tokens)
    keep = n // 2
    ids = cap.tokens()[:1, :n].to(input_device(model))
    probes = family_probes(cands)
    one = replace(opts, samples=1, tokens=n)
    rates: list[dict] = []
    with perturbed_kl(model, ids, keep) as kl:
        for i, layer in enumerate(cap.iter_layers()):
            with torch_threads(1):  # small attention passes: one thread (see measure)
                q, k, v, variants, _, _ = layer_variants(layer, meta, probes, one,
                                                         balancers.get(layer.index))
                got = [c for c in probes if variants.get(c) is not None]
                la = layer.attrs
                errs = attention_errors_many(q[:, :, n - keep:], k, v,
                                             [variants[c] for c in got], scaling=la.scaling,
                                             sliding_window=la.sliding_window,
                                             softcap=la.logit_softcap, reconstruction=False)
            row = {}
            for c, e in zip(got, errs):
                var, err = variants[c], float(e.output.mean())
                damage = kl(layer.index, key=var.k_hat - k) if c.tensor == "key" else \
                    kl(layer.index, value=var.v_hat - v)
                if err > 0:
                    row[family(c)] = damage / err
            rates.append(row)
            if progress:
                progress(i + 1, meta.num_layers, f"layout sensitivity layer {layer.index}")
    known = [r for row in rates for r in row.values()]
    mean = sum(known) / len(known) if known and sum(known) > 0 else 1.0
    weights, factors = [], []
    for row in rates:
        w = sum(row.values()) / len(row) / mean if row else 1.0
        weights.append(w)
        factors.append({f: r / mean / w if w > 0 else 1.0 for f, r in row.items()})
    spread = [max(f.values()) / min(f.values()) for f in factors
              if f and min(f.values()) > 0]
    measured = max((len(row) for row in rates), default=0)
    notes.append(f"layer weights and per-layout factors from measured KL ({measured} storage "
                 f"families per layer, KL on the last {keep} of {n} capture tokens): weights "
                 f"{min(weights):.2f}-{max(weights):.2f}, largest factor ratio within a layer "
                 f"{max(spread, default=1.0):.1f}")
    return tuple(weights), tuple(factors)


def _fused(kc: Candidate, vc: Candidate, stream: Stream, head_dim: int) -> bool:
    """Whether the fused decode kernel reads a layer storing ``kc`` / ``vc`` (``--prefer-fast``;
    the rule is the dispatch's own, ``kvlens.cache.attention.kernel_layout_problem``)."""

    setting = LayerKV(kc.spec(), vc.spec(), stream.residual, kc.stage == "pre",
                      flush_tokens=stream.flush)
    return kernel_layout_problem(setting, head_dim) is None


def _layer_options(table, opts: RecommendOptions, cost, weight: float, head_dim: int = 0,
                   factors: dict | None = None):
    """The Pareto front of (key, value, window) choices for one layer: ``[(cost, error, key,
    value, stream)]`` with ``cost(kc, vc, stream)`` the layer's held bytes in budget units and
    ``error`` the weighted sum of both tensors' errors with the layer's window and flush block
    (``stream``); a pair that cannot be stored with a window is not offered with it.
    ``factors``: ``{family(c): f}`` multiplying each tensor's error (1 where absent)."""
    factors = factors or {}
    keys = sorted({c for c, _ in table if c.tensor == "key"}, key=lambda c: c.label)
    values = sorted({c for c, _ in table if c.tensor == "value"}, key=lambda c: c.label)
    pairs = []
    for r in opts.window_sizes:
        for kc in keys:
            for vc in values:
                s = Stream(r, opts.layer_flush(kc, vc, residual=r))
                # GEAR and a MiKV set are a layer's choice (the config's gear.layers,
                # mikv.layers)
                if kc.gear != vc.gear or kc.mikv_set != vc.mikv_set:
                    continue
                if opts.prefer_fast and not _fused(kc, vc, s, head_dim):
                    continue
                if (kc, s) in table and (vc, s) in table:
                    err = weight * (factors.get(family(kc), 1.0) * table[kc, s][0] +
                                    factors.get(family(vc), 1.0) * table[vc, s][0])
                    pairs.append((cost(kc, vc, s), err, kc, vc, s))
    pairs.sort(key=lambda p: (p[0], p[1]))
    front, best = [], math.inf
    for p in pairs:  # cheapest first: keep only options that lower the error
        if p[1] < best:
            front.append(p)
            best = p[1]
    return front


def _assemble(meta, opts, tables, balancers, weights, notes, shape, factors=()
              ) -> Recommendation:
    from functools import cache


    fp16_total = shape.fp16_bytes(opts.context)
    n = len(tables)

    @cache
    def option(kc, vc, s, window):
        layer = next(i for i in range(shape.num_layers) if shape.window(i) == window)
        return option_bytes(kc, vc, s.flush, opts, shape, layer, residual=s.residual)

    def solve(rotation: bool, mikv_set):
        """``((objective, fronts, picks), None)`` of the best allocation with or without
        rotated candidates, with MiKV sets at the global ``mikv_set`` (None: no set), or
        ``(None, bits the cheapest options need)`` when nothing fits."""
        fronts = []
        for layer, table in zip(meta.layers, tables):
            w = shape.window(layer)
            table = {cf: e for cf, e in table.items() if (rotation or not cf[0].rotate)
                     and cf[0].mikv_set in (None, mikv_set)}
            # budget units: bits per element of the whole cache, times the number of layers
            fronts.append(_layer_options(
                table, opts,
                lambda kc, vc, s, w=w: 16 * n * option(kc, vc, s, w)[0] / fp16_total,
                weights[layer], shape.head_dim, factors[layer] if factors else None))
        costs = [[p[0] for p in front] for front in fronts]
        errors = [[p[1] for p in front] for front in fronts]
        # one [D, D] float32 rotation matrix is shared by every rotating layer: reserve it
        rotates = any(p[2].rotate or p[3].rotate for front in fronts for p in front)
        reserve = 16 * shape.head_dim ** 2 * 4 / fp16_total if rotates else 0.0
        try:
            picks = allocate(costs, errors, n * (opts.budget_bits - reserve))
        except InputError:  # what the allocation needs: its costs are rounded up per layer
            need = sum(math.ceil(min(c) * COST_RESOLUTION - 1e-9) for c in costs)
            return None, need / COST_RESOLUTION / n + reserve
        return (sum(e[p] for e, p in zip(errors, picks)), fronts, picks), None

    # the shared rotation matrix is a fixed cost the knapsack cannot split over layers, and a
    # MiKV set's width and fraction are global settings: solve for each (with and without
    # rotated candidates; no set or each set) and keep the best allocation
    sets = [None, *opts.mikv_sets()]
    solved = [(m, *solve(rot, m)) for rot in ((True, False) if opts.rotation else (False,))
              for m in sets]
    best = min((s for _, s, _ in solved if s is not None), key=lambda s: s[0], default=None)
    if best is None:
        raise InputError(
            f"The budget is too small: the cheapest candidates need "
            f"{min(need for _, _, need in solved):.3f} bits per element at {opts.context} "
            f"tokens (windows of {_listed(opts.window_sizes, '/')} tokens and "
            f"{opts.sink_tokens} sink tokens included), more than the {opts.budget_bits} asked "
            "for. Raise --budget-bits or --context, or offer smaller --windows / fewer --sinks.")
    _, fronts, picks = best
    if len(sets) > 1:
        plain = min((s[0] for m, s, _ in solved if s is not None and m is None), default=math.inf)
        notes = notes + [f"MiKV set candidates ({', '.join(f'INT{b} {h:g}' for b, h in sets[1:])}"
                         f"): objective {best[0]:.4f}, {plain:.4f} without a set"]
    choices = []
    for layer, front, pick, table in zip(meta.layers, fronts, picks, tables):
        _, _, kc, vc, s = front[pick]
        w = shape.window(layer)
        fp16 = tensor_fp16_bytes(shape, layer, opts.context)
        shares = dict(zip(("key", "value"), option(kc, vc, s, w)[1:]))
        for c in (kc, vc):
            out, score, recon = table[c, s]
            # the cheapest same-tensor candidate with a lower error (it did not fit the budget)
            better = []
            for o in (o for o, g in table if g == s and o.tensor == c.tensor
                      and o.gear == c.gear and o.mikv_set == c.mikv_set):
                pair = (o, vc) if c.tensor == "key" else (kc, o)
                if table[o, s][0] < out and opts.layer_flush(*pair, residual=s.residual) == \
                        s.flush:
                    share = option(*pair, s, w)[1 if c.tensor == "key" else 2]
                    better.append((16 * share / fp16, o.label))
            choices.append(Choice(layer, c.tensor, c, 16 * shares[c.tensor] / fp16, out, score,
                                  recon, min(better)[1] if better else "", s.flush,
                                  s.residual))
    expected = sum(ch.output_error for ch in choices) / len(choices)
    config = build_config(meta, opts, choices, balancers)
    mean_bits = config_bits(config, shape, opts.context)
    rec = Recommendation(config, choices, opts.budget_bits, mean_bits, expected, opts.context,
                         weights=tuple(weights), notes=notes,
                         residual_tokens=config.default.residual_tokens,
                         sink_tokens=opts.sink_tokens, windows=opts.window_sizes)
    for ctx in (1024, 4096, 32768, 131072):
        rec.kv_bytes[ctx] = sum(config_part_bytes(config, shape, ctx).values())
        rec.kv_bytes_fp16[ctx] = shape.fp16_bytes(ctx)
    rec.decode_cost = decode_costs(config, shape, opts.context)
    if opts.prefer_fast and not rec.decode_cost[0][1].fused:
        raise ConfigError(f"internal: --prefer-fast chose layouts without a fused path: "
                          f"{rec.decode_cost[0][1].unfused}")
    return rec


COST_PRESETS = ("fp16", "kivi-2", "kivi-4", "per-token-4")


def decode_costs(config, shape, context: int) -> list[tuple[str, Any]]:
    """``[(name, kvlens.cache.decode_cost.DecodeCost)]`` at ``context`` tokens: the
    recommendation first, then the presets of ``COST_PRESETS`` that fit the model."""

    rows = [(config.name, config_decode_cost(config, shape, context))]
    for name in COST_PRESETS:
        cfg = preset(name)
        try:
            for s in (cfg.default, *cfg.layers.values()):
                for spec in (s.key, s.value):
                    if spec is not None:
                        check_layout(spec, s.residual_tokens, shape.head_dim,
                                     flush_tokens=s.flush_tokens)
        except ConfigError:  # e.g. G=64 per-token groups on a head_dim-16 model
            continue
        rows.append((name, config_decode_cost(cfg, shape, context)))
    return rows


def build_config(meta, opts: RecommendOptions, choices: Sequence[Choice], balancers):
    """The versioned ``kvlens.config.kvconfig`` config that ``kvlens generate --config`` consumes."""
    from collections import Counter


    by_layer: dict[int, dict[str, Candidate]] = {}
    streams: dict[int, Stream] = {}
    for ch in choices:
        by_layer.setdefault(ch.layer, {})[ch.tensor] = ch.candidate
        streams[ch.layer] = Stream(ch.residual_tokens, ch.flush_tokens)
    settings = {}
    for layer, pair in by_layer.items():
        k, v = pair["key"], pair["value"]
        r, f = streams[layer]
        settings[layer] = LayerKV(k.spec(), v.spec(), r, k.stage == "pre", flush_tokens=f,
                                  rotate_keys=k.rotate, rotate_values=v.rotate)
    default = Counter(settings.values()).most_common(1)[0][0]
    overrides = {i: s for i, s in settings.items() if s != default}
    used = {i: balancers[i] for i, p in by_layer.items() if p["key"].balancer}
    if any(settings[i].pre_rope_keys for i in used):
        raise ConfigError("internal: balancer chosen together with pre-RoPE keys")
    gear_layers = sorted(i for i, p in by_layer.items() if p["key"].gear)
    sets = {i: p["key"].mikv_set for i, p in by_layer.items() if p["key"].mikv_set}
    if len(set(sets.values())) > 1:
        raise ConfigError(f"internal: MiKV sets of different widths/fractions chosen: {sets}")
    set_bits, fraction = next(iter(sets.values())) if sets else (None, 0.0)
    mikv = None
    if used or opts.sink_tokens or sets:
        # layers not in mikv.layers keep only the sinks, at fp16 (KVConfig.mikv_for), as their
        # candidates were measured and priced
        mikv = MikvSettings(heavy_fraction=fraction, sink_tokens=opts.sink_tokens,
                            balancer="fixed" if used else "off",
                            balancer_exponent=opts.balancer_exponent, set_bits=set_bits,
                            layers=sorted(sets) if sets else None)
    return KVConfig(
        name=opts.name, default=default, layers=overrides, mikv=mikv,
        gear=gear_settings(gear_layers) if gear_layers else None,
        balancers={i: tuple(tuple(float(x) for x in row) for row in b.tolist())
                   for i, b in used.items()},
        fp_dtype=opts.fp_dtype, scale_dtype=opts.scale_dtype,
        description=(f"kvlens recommend for {meta.model}: budget {opts.budget_bits} bits/element "
                     f"at {opts.context} tokens (residual window "
                     f"{_listed(sorted({s.residual for s in streams.values()}), '/')}, "
                     f"{opts.sink_tokens} sink tokens)"),
        model={"num_layers": meta.num_layers, "head_dim": meta.head_dim,
               "num_key_value_heads": meta.num_key_value_heads})
