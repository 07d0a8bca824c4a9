"""Per-layer error measurement of the candidates on a capture.

A candidate's error is the relative error of the attention output (``kvlens.analysis.metrics``)
when only that tensor is quantized, mean over the layer's query heads, as the cache is read
while decoding: query ``i`` reads the window and the sinks exact (``streaming_exact_mask``), and
the window flushes its oldest ``F`` tokens when full, so each candidate is measured for every
``Stream`` it can be stored with. Score and reconstruction errors are recorded to explain. With
several windows every option is scored on the same queries (``score_from`` on).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlens.analysis.attention import per_head_rel_error, streaming_exact_mask
from kvlens.analysis.compare import layer_rope_tables
from kvlens.analysis.metrics import Variant, attention_errors_many, attention_errors_streams
from kvlens.errors import ConfigError, InputError
from kvlens.layouts import check_layout, reference
from kvlens.quant import (
    fit_balancer,
    hadamard_rotation,
    quantize_pre_rope,
    quantize_rotated,
)
from kvlens.recommend.options import Candidate, RecommendOptions, Stream, listed
from kvlens.recommend.profile import stage
from kvlens.text.selection import format_index_spec


def measure_layer(layer, meta, cands: Sequence[Candidate], opts: RecommendOptions,
                  plain: Sequence[Candidate] = (), queries: int | None = None, balancer=None):
    """Per-candidate mean errors on one capture layer, the fitted balancer ``[Hkv, D]``
    (None when no candidate uses it) and whether pre-RoPE candidates were measured.

    Errors are ``{(candidate, Stream): (out, score, recon)}`` for every stream the candidate
    can be stored with (module docstring), and for the candidates in ``plain`` also with every
    token quantized, key ``(candidate, None)`` (the sensitivity probe). ``queries``: score only
    the last queries (the retrieval probe's answer position). ``balancer``: use this fitted
    balancer instead of fitting one on this layer's data."""

    q, k, v, variants, bal, pre_ok = layer_variants(layer, meta, cands, opts, balancer)
    n_tok = k.shape[2]
    if n_tok <= max(max(opts.window_sizes), opts.score_from):
        raise InputError(f"The capture has {n_tok} tokens per sample, no more than "
                         + (f"three times the largest window ({opts.score_from}), where the errors "
                            "of several windows are scored from" if opts.score_from else
                            f"the residual window ({max(opts.window_sizes)}): no query would "
                            "read quantized history")
                         + ". Capture longer samples or offer smaller windows.")
    runs: list[tuple[Stream | None, list[Candidate]]] = [
        (s, [c for c in variants if _fits(c, s)]) for s in opts.streams()]
    scoring = _LayerScoring(q, k, v, layer.attrs, opts, variants, queries)
    scoring.score_shared(runs)
    # twins depend on the stream (e.g. a set replayed while decoding), and the probe reads
    # every query: one pass per stream
    runs = [(s, [c for c in run if c.twin is not None]) for s, run in runs]
    runs.append((None, [c for c in plain if c in variants]))
    scoring.score_per_stream(runs)
    return scoring.out, bal, pre_ok


class _LayerScoring:
    """The errors of one capture layer's candidates, filled by ``measure_layer``'s passes:
    ``out[candidate, stream] = (out, score, recon)``."""

    def __init__(self, q, k, v, attrs, opts: RecommendOptions, variants: dict,
                 queries: int | None):
        self.q, self.k, self.v, self.attrs, self.opts = q, k, v, attrs, opts
        self.variants, self.queries, self.n_tok = variants, queries, k.shape[2]
        self.out: dict = {}
        self._recon: dict = {}

    def record(self, c: Candidate, s: Stream | None, e) -> None:
        if c.base not in self._recon:  # the same for every stream and set: once per candidate
            var = self.variants[c.base]
            self._recon[c.base] = float(per_head_rel_error(self.v, var.v_hat).mean()
                                        if c.tensor == "value"
                                        else per_head_rel_error(self.k, var.k_hat).mean())
        self.out[c, s] = (float(e.output.mean()),
                          None if e.scores is None else float(e.scores.mean()),
                          self._recon[c.base])

    def first_row(self, s: Stream | None) -> int:  # the probe quantizes every token: every query
        if self.queries is not None:
            return self.n_tok - self.queries
        return 0 if s is None else self.opts.score_from

    def score_shared(self, runs: list[tuple[Stream | None, list[Candidate]]]) -> None:
        """Plain candidates: every stream in one pass, sharing what does not depend on the
        window."""
        la, opts, variants = self.attrs, self.opts, self.variants
        shared = list(dict.fromkeys(c for _, run in runs for c in run if c.twin is None))
        if not shared:
            return
        at = {c: i for i, c in enumerate(shared)}
        start = self.first_row(runs[0][0])
        masks = [streaming_exact_mask(self.n_tok, s.residual, s.flush, opts.sink_tokens)[start:]
                 for s, _ in runs]
        errs = attention_errors_streams(
            self.q[:, :, start:], self.k, self.v, [variants[c] for c in shared], masks,
            select=[[at[c] for c in run if c in at] for _, run in runs], scaling=la.scaling,
            sliding_window=la.sliding_window, softcap=la.logit_softcap, sinks=la.sinks,
            reconstruction=False)
        for (s, run), per in zip(runs, errs):
            for c in run:
                if c in at:
                    self.record(c, s, per[at[c]])

    def score_per_stream(self, runs: list[tuple[Stream | None, list[Candidate]]]) -> None:
        """Research twins and the probe's candidates (stream None): one pass per stream."""
        la, opts, variants = self.attrs, self.opts, self.variants
        measurers = {e.name: e.measurer(self.q, self.k, self.v, la, opts)
                     for e in opts.extensions}
        for s, run in runs:
            if not run:
                continue
            start = self.first_row(s)
            rows, picked = self.q[:, :, start:], slice(start, None)
            # stable candidates read the sinks exact; a twin's measurer says what it reads
            # exact (TwinMeasurer.exact_sinks)
            groups = [(None, [c for c in run if c.twin is None], opts.sink_tokens)]
            groups += [(m, [c for c in run if c.twin is not None and c.twin.extension == name],
                        m.exact_sinks) for name, m in measurers.items()]
            for measurer, group, sinks in groups:
                if not group:
                    continue
                exact = None if s is None else streaming_exact_mask(
                    self.n_tok, s.residual, s.flush, sinks)[picked]
                if measurer is None:  # stable candidates: their variants are built already
                    vs = [variants[c] for c in group]
                else:
                    with stage(measurer.stage):
                        vs = [measurer.variant(c, variants[c.base], s, picked) for c in group]
                errs = attention_errors_many(rows, self.k, self.v, vs, scaling=la.scaling,
                                             sliding_window=la.sliding_window,
                                             softcap=la.logit_softcap, sinks=la.sinks,
                                             exact=exact, reconstruction=False)
                for c, e in zip(group, errs):
                    self.record(c, s, e)


def layer_variants(layer, meta, cands: Sequence[Candidate], opts: RecommendOptions,
                   balancer=None):
    """``(q, k, v, variants, balancer, pre_ok)`` of one capture layer: ``variants[c]`` is what
    the cache would give back for ``c`` with every token quantized (None for a research twin:
    it depends on the stream); pre-RoPE candidates are left out when the capture's RoPE cannot
    be rebuilt (``pre_ok`` False)."""

    sel = None if opts.samples is None else list(range(min(opts.samples, meta.num_samples)))
    t = slice(None) if opts.tokens is None else slice(0, opts.tokens)
    with stage("capture read"):
        q, k, v = (layer.read(n, samples=sel)[:, :, t] for n in ("q", "k", "v"))
    pre_ok = any(c.stage == "pre" for c in cands) and meta.shape.has_rope
    tables = None
    if pre_ok:
        with stage("capture read"):
            k_pre = layer.read("k_pre", samples=sel)[:, :, t]
        # this layer's theta (Gemma3: one on sliding, one on global layers); scaled RoPE
        # (YaRN...) cannot be rebuilt: no pre-RoPE candidates then
        tables, _ = layer_rope_tables(meta, k, k_pre, stored=layer.rope())
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
        # the candidate's storage layout's reference (kvlens.layouts); rotation, pre-RoPE
        # and the balancer compose around it
        quant = reference(c.spec(), sd)
        if c.twin is not None:  # it depends on the stream: built per run (measure_layer)
            ext = next(e for e in opts.extensions if e.name == c.twin.extension)
            if c.base in cands and ext.offered_on(la):
                variants[c] = None
        elif c.rotate:  # what the cache stores (x R) seen back in the original basis
            x_hat = quantize_rotated(v if c.tensor == "value" else k, quant, rot)
            variants[c] = Variant(v_hat=x_hat) if c.tensor == "value" else Variant(k_hat=x_hat)
        elif c.tensor == "value":
            variants[c] = Variant(v_hat=quant(v))
        elif c.stage == "pre":
            variants[c] = Variant(k_hat=quantize_pre_rope(k_pre, *tables, quant,
                                                          meta.rope_layout))
        elif c.balancer:
            b = bal[None, :, None, :]
            variants[c] = Variant(k_hat=quant(k * b) / b)
        else:
            variants[c] = Variant(k_hat=quant(k))
    return q, k, v, variants, bal, pre_ok


def _fits(c: Candidate, stream: Stream) -> bool:
    """Can ``c`` be stored in a layer whose window moves as ``stream``?"""

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
        raise InputError(f"No candidate can be stored with a window of {listed(bad)} tokens "
                         f"(per-channel groups {listed(opts.group_sizes)} must divide the "
                         f"flush block, per-token groups head_dim {head_dim}); allowed window "
                         f"sizes up to {ok[-1] if ok else 0}: {format_index_spec(ok) or 'none'}"
                         f"{' and above' if ok else ''}.")
