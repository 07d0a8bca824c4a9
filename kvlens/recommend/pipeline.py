"""The ``recommend`` pipeline: measure a capture once (``measure`` -> ``Measurements``: every
candidate's errors, and when the model loads the layer weights and the retrieval probe's
errors, one capture layer at a time), then allocate for any budget (``choose``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlens.analysis.compare import torch_threads
from kvlens.capture.store import CaptureMeta, open_capture
from kvlens.errors import InputError, OptionError
from kvlens.recommend.allocation import assemble
from kvlens.recommend.catalog import candidates
from kvlens.recommend.layer_errors import check_windows, measure_layer
from kvlens.recommend.options import Candidate, RecommendOptions, Stream
from kvlens.recommend.parallel import map_layers, resolve_workers
from kvlens.recommend.probe import add_retrieval_errors, load_model_for
from kvlens.recommend.profile import Profile, extrapolate, profiling, stage
from kvlens.recommend.result import Recommendation
from kvlens.recommend.sensitivity import layout_factors, probe_candidates, sensitivity_weights
from kvlens.text.selection import format_index_spec

ProgressFn = Callable[[int, int, str], None]
LogFn = Callable[[str], None]


@dataclass
class Measurements:
    """Everything ``recommend`` measured on a capture; ``choose`` allocates from it for any
    budget without measuring again."""

    # The annotations are exact: kvlens.recommend.reuse.CODEC writes and checks a kept
    # measurement by them.
    meta: CaptureMeta
    # per layer: {(candidate, stream; None: the probe's): (output, score, reconstruction)
    # errors}, the score error None where the layer has no score
    tables: list[dict[tuple[Candidate, Stream | None], tuple[float, float | None, float]]]
    balancers: dict[int, torch.Tensor]
    weights: tuple[float, ...]
    notes: list[str]
    # per layer {storage family (catalog.family: a tuple of its traits): factor on top of the
    # layer weight} (--set sensitivity=layout)
    factors: tuple[dict[tuple[str | bool, ...], float], ...] = ()
    profile: Profile = field(default_factory=Profile)  # where measure's time went


def measure(path: str | Path, opts: RecommendOptions, progress: ProgressFn | None = None,
            log: LogFn | None = None) -> Measurements:
    """Per-layer candidate errors, fitted balancers and layer sensitivity weights; ``log``
    receives each stage's predicted time (``kvlens.recommend.profile.expect``)."""

    # One thread: these many small attention passes run faster than with two threads, which
    # mostly wait on each other (as in compare-axes: docs/compare-axes.md#memory-and-time).
    # The model's forwards (sensitivity) get the threads the caller had.
    threads = torch.get_num_threads()
    with profiling(log=log) as prof, torch_threads(1):
        with open_capture(path) as cap:  # closed while worker processes start
            meta = cap.meta
        check_capture(path, meta, opts)
        cands = candidates(meta.shape.head_dim, opts, meta.shape.has_rope)
        check_windows(meta.shape.head_dim, opts, cands)
        probes = probe_candidates(meta.shape.head_dim)
        # per layer (errors, balancer, pre_ok), the probes also with every token quantized
        args = (cands + [p for p in probes if p not in cands], opts, probes)
        with stage("candidate errors"):
            rows, workers = _first_layer(path, meta.layers, args, opts.workers, progress)
            first = len(rows)
            rows += map_layers(measure_layer, path, meta.layers[first:], args, workers,
                               progress and (lambda d, t, note: progress(d + first, t + first,
                                                                         note)))
        tables = [table for table, _bal, _pre_ok in rows]
        balancers = {i: bal for i, (_t, bal, _p) in zip(meta.layers, rows) if bal is not None}
        notes: list[str] = []
        no_pre = [index for index, row in zip(meta.layers, rows) if not row[2]]
        if no_pre and meta.shape.has_rope and opts.pre_rope != "off":
            why = (f"the RoPE of layer(s) {format_index_spec(no_pre)} cannot be rebuilt from "
                   "the capture (a layer without RoPE, or a capture written before kvlens "
                   "stored each layer's RoPE tables, of a scaled RoPE)")
            if opts.pre_rope == "on":
                raise InputError(f"Pre-RoPE keys were requested but {why}; use --set "
                                 "pre-rope=auto.")
            notes.append(f"pre-RoPE candidates skipped where {why}")
        need = (opts.sensitivity != "uniform" and not opts.layer_weights) or \
            opts.retrieval != "off"
        factors: tuple[dict, ...] = ()
        with open_capture(path) as cap:  # closed before the layout stage's workers start
            with stage("model load"):
                model, tokenizer = load_model_for(cap, opts, notes) if need else (None, None)
            with torch_threads(threads), stage("sensitivity"):
                weights = opts.layer_weights or sensitivity_weights(cap, model, opts, tables,
                                                                    probes, notes, progress)
        if opts.sensitivity in ("layout", "auto") and model is not None \
                and not opts.layer_weights:
            with torch_threads(threads), stage("layout sensitivity"):
                weights, factors = layout_factors(path, model, opts, cands, balancers, notes,
                                                  progress, workers)
        if model is not None and opts.retrieval != "off" and opts.retrieval_weight > 0:
            with stage("retrieval probe"):
                add_retrieval_errors(model, tokenizer, cands, opts, tables, balancers, notes,
                                     progress, workers)
    wanted = set(cands)  # the probes measured beside them are dropped
    tables = [{cf: e for cf, e in t.items() if cf[0] in wanted and cf[1] is not None}
              for t in tables]
    prof.stages = {k: v for k, v in prof.stages.items() if v > 0}
    return Measurements(meta, tables, balancers, tuple(weights), notes, factors, prof)


def check_capture(path: str | Path, meta, opts: RecommendOptions) -> None:
    """Refuse ``opts`` on the capture at ``path`` (``meta``) where it cannot be measured: a
    capture of some layers only, more samples than it holds, pre-RoPE keys it lacks, layer
    weights of another depth."""
    if tuple(meta.layers) != tuple(meta.shape.attention_layers):
        raise InputError(f"{path} captures layers {list(meta.layers)}, but a recommendation "
                         f"needs every layer with a KV cache ({len(meta.shape.attention_layers)}); "
                         "re-run `kvlens capture` without {layers}.")
    if opts.samples is not None and opts.samples > meta.num_samples:
        raise OptionError(f"{{samples}} {opts.samples}: {path} holds {meta.num_samples} samples; "
                         f"give at most {meta.num_samples} (or omit it: all of them).")
    if opts.pre_rope == "on" and not meta.shape.has_rope:
        raise OptionError(f"Pre-RoPE keys were requested but {path} has no pre-RoPE data: "
                         f"{meta.model} has no rotary embedding (q_pre/k_pre equal q/k). "
                         "Use {pre_rope}=auto or off.")
    if opts.layer_weights and len(opts.layer_weights) != len(meta.layers):
        raise InputError(f"{len(opts.layer_weights)} layer weights given for "
                         f"{len(meta.layers)} layers with a KV cache.")


def _first_layer(path, layers, args, workers: int | None, progress: ProgressFn | None
                 ) -> tuple[list, int]:
    """``(rows measured so far, worker processes)``: ``workers`` as asked, else the first layer
    measured here, and every core when its time times the layers says workers pay
    (``kvlens.recommend.parallel.resolve_workers``)."""
    if workers is not None:
        return [], resolve_workers(workers, 0.0, len(layers))
    start = time.perf_counter()
    rows = map_layers(measure_layer, path, layers[:1], args, 1,
                      progress and (lambda d, _t, note: progress(d, len(layers), note)))
    alone = extrapolate(time.perf_counter() - start, 1, len(layers))
    return rows, resolve_workers(None, alone, len(layers))


def choose(m: Measurements, opts: RecommendOptions) -> Recommendation:
    """Allocate under ``opts.budget_bits`` from earlier measurements and build the config."""
    # measured with more fits than offered now: drop the rest
    tables = [{k: e for k, e in t.items() if k[0].fit in opts.fits_for(k[0].tensor)}
              for t in m.tables]
    prof = Profile(dict(m.profile.stages), list(m.profile.spans))
    with profiling(prof), stage("allocation"):
        rec = assemble(m.meta, opts, tables, m.balancers, m.weights, list(m.notes), m.factors)
    rec.profile = prof
    return rec
