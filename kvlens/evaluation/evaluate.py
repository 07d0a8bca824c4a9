"""What a compressed cache really loses: long-context KL divergence and retrieval against the
exact model, plus the short-context decode perplexity, passkey and agreement checks.

Every compressed run uses ``kvlens.cache.compressed_attention`` and a fresh compressed cache per
sequence, so attention reads the packed store exactly as in generation.

Long-context evaluations (``kvlens.evaluation``; protocols in docs/evaluation.md):

- **kld**: teacher-forced scoring of ``eval_tokens`` tokens (default 4096, capped by the model's
  context) of the held-out text, fed ``chunk`` tokens per forward through every config's cache
  and the exact model (plain ``DynamicCache``) in lockstep: KL divergence, top-1 agreement,
  perplexity, with paired bootstrap intervals.
- **retrieval**: passkey and key-value lookup over lengths x depths, Wilson intervals.

Short-context checks (kept for continuity; they say little about long contexts):

- **ppl (decode mode)**: the first ``prefix`` tokens of the text (default: the held-out text)
  are prefilled in one forward (exact attention; the cache then stores them compressed, as after
  any prompt); every following
  token is then fed one at a time, and the logits of step ``t`` score token ``t + 1``. So each of
  the ``tokens - prefix - 1`` scored predictions attends to the compressed history, the way a
  generated token would. ``ppl = exp(mean NLL)``. The same protocol with the ``exact`` preset
  (no compression, the model's dtype) gives the reference, reported as ``ppl_fp16`` (the key
  predates the ``exact`` preset); ``ppl_change = ppl / ppl_fp16 - 1``.
- **passkey**: ``prompts`` prompts of about ``context_tokens`` tokens of repeated filler text
  with the sentence "The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted at a
  random depth (seeded), ending "What is the pass key? The pass key is"; greedy decoding of 8
  tokens; correct when the 5 digits appear in the continuation.
- **agreement**: greedy continuation of the prompt (``max_new_tokens``) vs the uncompressed
  continuation: number of matching tokens position by position and the first divergence.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.attention import select_backend
from kvlens.config import KVConfig, preset
from kvlens.errors import InputError
from kvlens.evaluation.baselines import Baseline, baseline_memory_report, baseline_session
from kvlens.evaluation.decode import cache_kwargs, greedy
from kvlens.evaluation.kld import check_lengths, max_positions, score_text, summarize
from kvlens.evaluation.needles import build_grid, grid_lengths, run_grid
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.model.placement import input_device
from kvlens.text.corpus import DEFAULT_CORPUS_NAME, load_text
from kvlens.text.heldout import HELDOUT_NAME, heldout_text
from kvlens.text.prompts import FILLER, passkey_text

EVALS = ("ppl", "passkey", "agreement", "kld", "retrieval")
LONG_EVALS = ("kld", "retrieval")
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class EvalOptions:
    evals: tuple[str, ...] = ()
    prompt: str | None = None
    max_new_tokens: int = 64
    text: str | None = None  # ppl/kld text (None: the held-out text; builtin:corpus, a path)
    ppl_tokens: int = 512
    ppl_prefix: int = 32
    passkey_prompts: int = 5
    passkey_context: int = 1000
    seed: int = 0
    backend: str = "auto"
    eval_tokens: int | None = None  # kld: None = 4096 capped by the model's context
    chunk: int = 64  # kld: tokens per forward (1 = decode mode)
    retrieval_prompts: int = 1  # prompts per task, length and depth
    retrieval_lengths: tuple[int, ...] | None = None  # None: 1k, 2k, 4k that fit the model
    retrieval_depths: tuple[float, ...] = (0.1, 0.5, 0.9)


def parse_evals(spec: str | None) -> tuple[str, ...]:
    if not spec:
        return ()
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [n for n in names if n not in EVALS]
    if bad:
        raise InputError(f"Unknown evaluation(s) {', '.join(bad)}; allowed: {', '.join(EVALS)}.")
    return names


def decode_ppl(model, ids, session, prefix: int) -> tuple[float, object]:
    """Decode-mode perplexity of ``ids`` ``[1, T]`` (protocol in the module docstring)."""
    import torch

    if ids.shape[1] < prefix + 2:
        raise InputError(f"Decode-mode perplexity needs more than {prefix + 1} tokens of text, "
                         f"got {ids.shape[1]}.")
    cache = session.new_cache()
    kw = cache_kwargs(model, cache)
    nll, count = 0.0, 0
    with torch.no_grad():
        logits = model(ids[:, :prefix], use_cache=True, **kw).logits[:, -1]
        for t in range(prefix, ids.shape[1] - 1):
            logits = model(ids[:, t:t + 1], use_cache=True, **kw).logits[:, -1]
            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t + 1]].item()
            count += 1
    return math.exp(nll / count), cache


def passkey_prompts(tokenizer, n: int, context_tokens: int, seed: int
                    ) -> list[tuple[str, str]]:
    """``n`` (prompt, key) pairs of about ``context_tokens`` tokens, key at a random depth."""
    rng = random.Random(seed)
    per = max(1, len(tokenizer(FILLER, add_special_tokens=False).input_ids))
    repeats = max(1, (context_tokens - 40) // per)
    out = []
    for _ in range(n):
        key = f"{rng.randint(10000, 99999)}"
        depth = rng.randint(0, repeats)
        out.append((passkey_text(key, depth, repeats - depth), key))
    return out


def _encode(tokenizer, text: str, device):
    return tokenizer(text, return_tensors="pt").input_ids.to(device)


def load_eval_text(path: str | None) -> tuple[str, str]:
    """``(text, source)``: ``None`` or ``builtin:heldout`` is the held-out text,
    ``builtin:corpus`` the capture corpus, anything else a UTF-8 file."""

    if path is None or str(path) == HELDOUT_NAME:
        return heldout_text(), HELDOUT_NAME
    if str(path) == DEFAULT_CORPUS_NAME:
        return load_text(None)
    return load_text(path)


def evaluate_configs(model, tokenizer, configs: list[KVConfig], options: EvalOptions,
                     progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Run generation and the requested evaluations for each config on the same inputs.

    Returns ``{"backend_reason", "results": [per-config dict], "evaluation": {...},
    "interrupted": bool}``; each result has ``name``, ``kv_bytes``, ``kv_bytes_fp16``,
    ``bits_per_element`` (measured on the largest cache this config built), ``text`` (with a
    prompt) and one entry per evaluation; ``evaluation`` holds each long evaluation's protocol
    and the exact model's results. Ctrl-C stops the run: what was finished is returned with
    ``interrupted: True`` (a config or chunk in progress is dropped)."""

    device = input_device(model)
    short = [e for e in options.evals if e not in LONG_EVALS]
    report: dict = {"results": [{"name": c.name} for c in configs], "evaluation": {},
                    "interrupted": False}
    kld_ids = text_source = None
    if "kld" in options.evals:  # validate before any work

        text, text_source = load_eval_text(options.text)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        n = check_lengths(ids.shape[1], options.eval_tokens, options.chunk,
                          max_positions(model), text_source)
        kld_ids = ids[:, :n].to(device)
    grid = None
    if "retrieval" in options.evals:

        lengths = grid_lengths(options.retrieval_lengths, max_positions(model))
        progress(f"building {len(lengths)} x {len(options.retrieval_depths)} retrieval grid")
        grid = build_grid(tokenizer, lengths, options.retrieval_depths,
                          options.retrieval_prompts, options.seed)

    if short or options.prompt is not None:
        finished, report["interrupted"] = _short_evals(model, tokenizer, configs, options,
                                                       progress)
        report["results"] = finished + report["results"][len(finished):]
    if kld_ids is not None and not report["interrupted"]:

        progress(f"kld: {kld_ids.shape[1]} tokens of {text_source} in chunks of "
                 f"{options.chunk}, {len(configs)} configs + exact in lockstep")
        scores = score_text(model, kld_ids, configs, options.chunk, options.backend,
                            progress=_every(progress, "kld: chunk"))
        sec = scores.seconds
        progress(f"kld: exact forwards {sec['exact_forward']:.1f} s, config forwards "
                 + ", ".join(f"{c.name} {t:.1f} s" for c, t in zip(configs,
                                                                  sec["config_forward"]))
                 + f", KL/NLL {sec['kl_and_nll']:.1f} s; bootstrap ...")
        summary = summarize(scores)
        report["evaluation"]["kld"] = {"text_source": text_source, **summary["protocol"],
                                       "exact": summary["exact"]}
        for res, doc in zip(report["results"], summary["configs"]):
            if doc is not None:
                memory = doc.pop("memory", None)
                doc.pop("name")
                res["kld"] = doc
                _merge_memory(res, memory)
        report["interrupted"] = scores.interrupted
    if grid is not None and not report["interrupted"]:

        scores = run_grid(model, tokenizer, configs, grid, options.backend, progress)
        summary = summarize_grid(scores)
        report["evaluation"]["retrieval"] = {**summary["protocol"], "exact": summary["exact"]}
        # summary["configs"] covers the configs that finished, in order (names may repeat)
        for res, doc in zip(report["results"], summary["configs"]):
            res["retrieval"] = {k: v for k, v in doc.items() if k != "name"}
        report["interrupted"] = scores.interrupted
    reason = next((r.get("backend_reason") for r in reversed(report["results"])
                   if r.get("backend_reason")), None)
    report["backend_reason"] = reason or select_backend(options.backend, device)[1]
    for res in report["results"]:
        res.setdefault("backend", select_backend(options.backend, device)[0])
    return report


def _every(progress: Callable[[str], None], label: str, parts: int = 8):
    """A ``(done, total)`` callback that reports about ``parts`` times over the run."""
    def update(done: int, total: int) -> None:
        if done == total or done % max(1, total // parts) == 0:
            progress(f"{label} {done}/{total}")
    return update


def _merge_memory(res: dict, memory: dict | None) -> None:
    """Keep the bytes of the largest cache a config built."""
    if memory and memory["kv_bytes_fp16"] >= res.get("kv_bytes_fp16", 0):
        res.update(memory)


def _short_evals(model, tokenizer, configs: list[KVConfig], options: EvalOptions,
                 progress: Callable[[str], None]) -> tuple[list[dict], bool]:
    """Generation with ``options.prompt`` and the short-context ppl / passkey / agreement:
    ``(results of the configs that finished, interrupted)``."""

    device = input_device(model)
    exact = preset("exact")  # the reference: no compression, the model's dtype
    prompt_ids = _encode(tokenizer, options.prompt, device) if options.prompt else None
    need_agree = "agreement" in options.evals
    if need_agree and prompt_ids is None:
        prompt_ids = _encode(tokenizer, DEFAULT_PROMPT, device)
    ppl_ids = None
    if "ppl" in options.evals:
        text, source = load_eval_text(options.text)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] < options.ppl_tokens:
            raise InputError(f"The text from {source} has {ids.shape[1]} tokens; decode-mode "
                             f"perplexity needs {options.ppl_tokens} (lower --ppl-tokens or "
                             "give a longer --text).")
        ppl_ids = ids[:, :options.ppl_tokens].to(device)
    passkeys = passkey_prompts(tokenizer, options.passkey_prompts, options.passkey_context,
                               options.seed) if "passkey" in options.evals else []

    baseline: dict = {}

    def run(config: KVConfig) -> dict:
        res: dict = {"name": config.name}
        caches = []
        if isinstance(config, Baseline):
            ctx, report_fn = baseline_session(model, config), baseline_memory_report
        else:
            ctx, report_fn = compressed_attention(model, config, options.backend), memory_report
        with ctx as session:
            res["backend"] = session.backend
            if prompt_ids is not None:
                progress(f"{config.name}: generating {options.max_new_tokens} tokens")
                new, cache = greedy(model, prompt_ids, session, options.max_new_tokens)
                caches.append(cache)
                res["text"] = tokenizer.decode(new[0], skip_special_tokens=True)
                res["_tokens"] = new[0].tolist()
            if ppl_ids is not None:
                progress(f"{config.name}: decode-mode perplexity over {ppl_ids.shape[1]} tokens")
                res["ppl"], cache = decode_ppl(model, ppl_ids, session, options.ppl_prefix)
                caches.append(cache)
            if passkeys:
                correct = 0
                lengths = []
                for i, (text, key) in enumerate(passkeys):
                    progress(f"{config.name}: passkey {i + 1}/{len(passkeys)}")
                    ids = _encode(tokenizer, text, device)
                    lengths.append(ids.shape[1])
                    new, cache = greedy(model, ids, session, 8)
                    caches.append(cache)
                    correct += key in tokenizer.decode(new[0], skip_special_tokens=True)
                res["passkey"] = {"correct": correct, "total": len(passkeys),
                                  "context_tokens": round(sum(lengths) / len(lengths))}
        res["backend_reason"] = session.backend_reason
        reports = [report_fn(c) for c in caches]
        if reports:
            biggest = max(reports, key=lambda r: r["kv_bytes_fp16"])
            res.update(kv_bytes=biggest["kv_bytes"], kv_bytes_fp16=biggest["kv_bytes_fp16"],
                       bits_per_element=biggest["bits_per_element"],
                       kv_bytes_by_device=biggest["by_device"])
        return res

    results = []
    interrupted = False
    try:
        if ppl_ids is not None or need_agree:
            if not any(c.name == "exact" and not c.compressed for c in configs):
                progress("exact reference")
                baseline = run(exact)
        for config in configs:
            res = run(config)
            if not config.compressed and config.name == "exact":
                baseline = baseline or res
            results.append(res)
    except KeyboardInterrupt:  # keep the configs that finished
        interrupted = True
    for res in results:
        if ppl_ids is not None and baseline:
            res["ppl_fp16"] = baseline["ppl"]
            res["ppl_change"] = res["ppl"] / baseline["ppl"] - 1
        if need_agree and baseline:
            res["agreement"] = agreement(res["_tokens"], baseline["_tokens"])
    for res in results:
        res.pop("_tokens", None)
    return results, interrupted


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Position-by-position token agreement with the reference continuation."""
    n = min(len(tokens), len(reference))
    matching = sum(a == b for a, b in zip(tokens[:n], reference[:n]))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) != len(reference):
        first = n
    return {"matching": matching, "total": len(reference), "first_divergence": first}
