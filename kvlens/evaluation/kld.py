"""Teacher-forced scoring of a long text against the exact model: KL divergence, top-1, ppl.

``score_text`` feeds the text ``chunk`` tokens per forward through every config's cache and,
in lockstep on the same chunks, through the exact model (its own attention and plain
``DynamicCache``); the logits at ``t`` score token ``t + 1``. ``summarize`` gives point values,
bootstrap intervals over blocks of at least ``UNIT_TOKENS`` tokens (the same blocks for every
config: paired differences) and ``quantized_share``, the share of predictions that read a
quantized entry (``reads_quantized``). The protocol, and why perplexity and KLD disagree
(``excess_nll``): docs/evaluation.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from kvlens.errors import InputError, is_int
from kvlens.evaluation.baselines import held_bytes, open_session
from kvlens.evaluation.stats import (
    BOOTSTRAP_SEED,
    RESAMPLES,
    bootstrap_indices,
    paired_difference,
    percentile_interval,
)
from kvlens.model.architecture import text_config
from kvlens.model.hooks import cache_argument_name
from kvlens.text.corpus import DEFAULT_CORPUS_NAME, load_text
from kvlens.text.heldout import HELDOUT_NAME, heldout_text

DEFAULT_EVAL_TOKENS = 4096
DEFAULT_CHUNK = 64
UNIT_TOKENS = 64
STATS = ("mean_kld", "median_kld", "p99_kld", "top1_agreement", "ppl", "ppl_change",
         "excess_nll")
#: Statistics compared between configs (paired): lower KLD, higher agreement, lower ppl change;
#: and the excess NLL, which says how much of a ppl-change difference is not a KLD difference.
PAIRED = ("mean_kld", "top1_agreement", "ppl_change", "excess_nll")
#: Statistics compared with the exact cache, and the exact cache's own value of each.
VS_EXACT = {"mean_kld": 0.0, "top1_agreement": 1.0, "ppl_change": 0.0}


@dataclass
class TokenScores:
    """Per scored prediction of one config (arrays of equal length, in text order)."""

    name: str
    compressed: bool = True
    kld: list = field(default_factory=list)
    top1: list = field(default_factory=list)
    nll: list = field(default_factory=list)
    quantized: list = field(default_factory=list)
    memory: dict | None = None
    # why this backend, and (triton) which attention calls took the torch path
    backend_reason: str | None = None


@dataclass
class TextScores:
    """What ``score_text`` measured: the exact model's NLL and each config's scores."""

    tokens: int
    chunk: int
    chunk_of_token: list = field(default_factory=list)  # chunk index of each scored prediction
    nll_exact: list = field(default_factory=list)
    configs: list[TokenScores] = field(default_factory=list)
    chunks_done: int = 0
    chunks_total: int = 0
    interrupted: bool = False
    #: wall seconds in the exact forwards, each config's forwards (config order), KL/NLL scoring
    seconds: dict = field(default_factory=dict)

    @property
    def scored(self) -> int:
        return len(self.nll_exact)


def check_lengths(text_tokens: int, eval_tokens: int | None, chunk: int, max_positions: int | None,
                  source: str) -> int:
    """The number of tokens to score (``eval_tokens``, at least 2 as ``EvalOptions`` checks, or
    the default), or ``InputError``."""
    limit = max_positions or 10**9
    if eval_tokens is None:
        eval_tokens = min(DEFAULT_EVAL_TOKENS, limit)
    elif eval_tokens > limit:
        raise InputError(f"{{eval_tokens}} {eval_tokens} is beyond the model's context: its "
                         f"max_position_embeddings is {limit}; allowed: 2-{limit}.")
    if eval_tokens > text_tokens:
        raise InputError(f"{{eval_tokens}} {eval_tokens} is longer than the text from {source} "
                         f"({text_tokens} tokens); lower {{eval_tokens}} to at most {text_tokens} "
                         "or give a longer {text}.")
    if not 1 <= chunk <= eval_tokens:
        raise InputError(f"{{chunk}} must be between 1 (decode mode) and {{eval_tokens}} "
                         f"({eval_tokens}); got {chunk}.")
    return eval_tokens


def load_eval_text(path: str | None) -> tuple[str, str]:
    """``(text, source)``: ``None`` or ``builtin:heldout`` is the held-out text,
    ``builtin:corpus`` the capture corpus, anything else a UTF-8 file."""
    if path is None or str(path) == HELDOUT_NAME:
        return heldout_text(), HELDOUT_NAME
    if str(path) == DEFAULT_CORPUS_NAME:
        return load_text(None)
    return load_text(path)


def max_positions(model) -> int | None:
    config = text_config(model.config)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if is_int(value, 1):
            return value
    return None


def reads_quantized(cache) -> bool:
    """Whether attention over ``cache`` reads at least one quantized entry now (see module doc)."""
    return any(getattr(layer, "quantized_length", 0) > 0
               or getattr(layer, "quantizes_on_write", False)  # engine layers: the chunk itself
               or getattr(layer, "_quantized_keys", None) is not None  # transformers' caches
               for layer in getattr(cache, "layers", ()))


def score_text(model, ids, configs: Sequence, chunk: int = DEFAULT_CHUNK, backend: str = "auto",
               progress: Callable[[int, int], None] = lambda done, total: None) -> TextScores:
    """Score ``ids`` ``[1, N]`` under every config and the exact model, in lockstep (module doc).

    All configs' sessions are open together (their attention overrides nest: each one handles
    any kvlens cache layer and passes every other call down to the model's own attention), so
    the exact forward of a chunk is computed once for all configs. Ctrl-C between or during
    chunks stops early: the result then holds the chunks finished so far and
    ``interrupted=True``."""
    import torch

    n = ids.shape[1]
    if n < 2 or not 1 <= chunk <= n:
        raise InputError(f"Need at least 2 tokens and 1 <= chunk <= {n} (got chunk {chunk}).")
    arg = cache_argument_name(model)
    plain = model.config._attn_implementation
    starts = list(range(0, n, chunk))
    result = TextScores(tokens=n, chunk=chunk, chunks_total=len(starts),
                        configs=[TokenScores(c.name, bool(c.compressed)) for c in configs])
    with ExitStack() as stack, torch.no_grad():
        sessions = [stack.enter_context(open_session(model, c, backend)) for c in configs]
        installed = model.config._attn_implementation
        caches = [s.new_cache() for s in sessions]
        exact_cache = None
        exact_s = after_exact_s = 0.0  # the exact forwards; the rest of each chunk
        per_config = [0.0] * len(caches)
        try:
            for k, s in enumerate(starts):
                x = ids[:, s:s + chunk]
                targets = ids[0, s + 1:s + chunk + 1]
                m = targets.shape[0]  # the text's last token scores nothing
                t0 = time.perf_counter()
                out = _exact_forward(model, x, arg, exact_cache, plain, installed)
                exact_cache = _returned_cache(out)
                t1 = time.perf_counter()
                exact_s += t1 - t0
                logp_e = torch.log_softmax(out.logits[0, :m].double(), -1)
                nll_e = -logp_e.gather(-1, targets[:, None])[:, 0]
                top_e = logp_e.argmax(-1)
                p_e = logp_e.exp()
                rows = _score_configs(model, x, arg, caches, (logp_e, top_e, p_e), targets,
                                      per_config)
                # Record a chunk only once every config has scored it (an interrupt inside
                # _score_configs leaves all configs on the same chunks).
                _record_chunk(result, rows, nll_e, k)
                after_exact_s += time.perf_counter() - t1
                progress(k + 1, len(starts))
        except KeyboardInterrupt:
            result.interrupted = True
        result.seconds = {"exact_forward": round(exact_s, 2),
                          "config_forward": [round(v, 2) for v in per_config],
                          "kl_and_nll": round(after_exact_s - sum(per_config), 2)}
        for ts, config, cache, session in zip(result.configs, configs, caches, sessions):
            ts.memory = held_bytes(config, cache)
            ts.backend_reason = getattr(session, "backend_reason", None)
    return result


def _exact_forward(model, x, arg: str, exact_cache, plain: str, installed: str):
    """The exact model's forward on chunk ``x``: its own attention implementation (``plain``)
    switched back in for the call, the configs' (``installed``) restored after it."""
    if installed != plain:
        model.set_attn_implementation(plain)
    try:
        kw = {arg: exact_cache} if exact_cache is not None else {}
        return model(x, use_cache=True, **kw)
    finally:
        if installed != plain:
            model.set_attn_implementation(installed)


def _score_configs(model, x, arg: str, caches: list, exact: tuple, targets,
                   per_config: list[float]) -> list[tuple]:
    """Each config's forward on chunk ``x`` through its cache, scored against the exact
    model's ``(log-probabilities, top-1, probabilities)``: per config ``(KLD, top-1 agreement,
    NLL, whether it read quantized entries)``. Each forward's time goes to ``per_config``."""
    import torch

    logp_e, top_e, p_e = exact
    m = targets.shape[0]
    rows = []
    for j, cache in enumerate(caches):
        quant = reads_quantized(cache)
        t2 = time.perf_counter()
        logits = model(x, use_cache=True, **{arg: cache}).logits
        per_config[j] += time.perf_counter() - t2
        logp = torch.log_softmax(logits[0, :m].double(), -1)
        kld = (p_e * (logp_e - logp)).sum(-1).clamp_min(0.0)
        rows.append((kld, logp.argmax(-1) == top_e,
                     -logp.gather(-1, targets[:, None])[:, 0], quant))
    return rows


def _record_chunk(result: TextScores, rows: list[tuple], nll_exact, k: int) -> None:
    """Append chunk ``k``'s scores (``rows`` from ``_score_configs``, one per config, and the
    exact model's NLL) to ``result``."""
    m = nll_exact.shape[0]
    for ts, (kld, top1, nll, quant) in zip(result.configs, rows):
        ts.kld.extend(kld.tolist())
        ts.top1.extend(top1.tolist())
        ts.nll.extend(nll.tolist())
        ts.quantized.extend([quant] * m)
    result.nll_exact.extend(nll_exact.tolist())
    result.chunk_of_token.extend([k] * m)
    result.chunks_done = k + 1


def _returned_cache(out):
    """The cache a forward returned (``cache`` from transformers 5.24, ``past_key_values``
    before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _units(chunk_of_token: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Token index arrays of the bootstrap units: blocks of ceil(UNIT_TOKENS / chunk) chunks."""
    per = max(1, math.ceil(UNIT_TOKENS / chunk))
    unit_of = chunk_of_token // per
    return [np.flatnonzero(unit_of == u) for u in np.unique(unit_of)]


def _stats(kld: np.ndarray, top1: np.ndarray, nll: np.ndarray, nll_exact: np.ndarray
           ) -> np.ndarray:
    """The ``STATS`` of one set of scored predictions. ``excess_nll`` (nats): the mean NLL change
    of the text's own tokens minus the mean KLD, so ``ppl_change = exp(mean KLD + excess_nll) -
    1``. Per prediction it is ``sum_y (1[y = next] - p_exact(y)) log(p_exact(y) / p_config(y))``:
    zero on average when the text is drawn from the exact model, and otherwise how much the
    perplexity change says more (or less) than KLD about this text (module doc)."""
    ppl = math.exp(nll.mean())
    return np.array([kld.mean(), np.median(kld), np.percentile(kld, 99), top1.mean(), ppl,
                     ppl / math.exp(nll_exact.mean()) - 1,
                     nll.mean() - nll_exact.mean() - kld.mean()])


def summarize(scores: TextScores, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
              ) -> dict:
    """Point values, bootstrap intervals and paired comparisons (JSON-ready; docs/evaluation.md).

    Returns ``{"protocol": {...}, "exact": {...}, "configs": [per-config dict]}``; the first
    compressed config is the reference of ``vs_first``."""
    if scores.scored == 0:
        return {"protocol": _protocol(scores, 0, resamples, seed), "exact": None,
                "configs": [None] * len(scores.configs)}
    nll_e = np.asarray(scores.nll_exact)
    units = _units(np.asarray(scores.chunk_of_token), scores.chunk)
    draws = bootstrap_indices(len(units), resamples, seed)
    picks = [np.concatenate([units[u] for u in row]) for row in draws]
    ppl_exact = math.exp(nll_e.mean())
    ppl_exact_samples = np.array([math.exp(nll_e[p].mean()) for p in picks])
    per_config = []
    for ts in scores.configs:
        kld, top1, nll = (np.asarray(v, dtype=np.float64) for v in (ts.kld, ts.top1, ts.nll))
        point = _stats(kld, top1, nll, nll_e)
        samples = np.stack([_stats(kld[p], top1[p], nll[p], nll_e[p]) for p in picks])
        per_config.append((ts, point, samples))
    first = next((i for i, (ts, _, _) in enumerate(per_config) if ts.compressed), None)
    out = []
    for i, (ts, point, samples) in enumerate(per_config):
        res: dict = {"name": ts.name, "scored": scores.scored,
                     "quantized_share": float(np.mean(ts.quantized))}
        for j, stat in enumerate(STATS):
            res[stat] = {"value": float(point[j]), "ci95": percentile_interval(samples[:, j])}
        res["ppl_exact"] = ppl_exact
        # Versus the exact cache: KLD and (1 - agreement) are already differences from it.
        res["vs_exact"] = {stat: paired_difference(point[j], ref, samples[:, j],
                                                   np.full(len(picks), ref))
                           for stat, ref in VS_EXACT.items() for j in [STATS.index(stat)]}
        res["vs_first"] = None
        if first is not None and i != first:
            ref, ref_point, ref_samples = per_config[first]
            res["vs_first"] = {"reference": ref.name, **{
                stat: paired_difference(point[j], ref_point[j], samples[:, j], ref_samples[:, j])
                for stat, j in ((s, STATS.index(s)) for s in PAIRED)}}
        if ts.memory:
            res["memory"] = ts.memory
        if ts.backend_reason:
            res["backend_reason"] = ts.backend_reason
        out.append(res)
    exact = {"ppl": {"value": ppl_exact, "ci95": percentile_interval(ppl_exact_samples)}}
    return {"protocol": _protocol(scores, len(units), resamples, seed), "exact": exact,
            "configs": out}


def _protocol(scores: TextScores, units: int, resamples: int, seed: int) -> dict:
    return {"tokens": scores.tokens, "chunk": scores.chunk, "scored": scores.scored,
            "chunks_done": scores.chunks_done, "chunks_total": scores.chunks_total,
            "interrupted": scores.interrupted, "seconds": scores.seconds,
            "bootstrap": {"unit_tokens": max(1, math.ceil(UNIT_TOKENS / scores.chunk))
                          * scores.chunk, "units": units, "resamples": resamples,
                          "seed": seed}}
