"""Run every requested evaluation of ``kvlens generate`` (``evaluate_configs``): the
short-context checks (``short``) first, then long-context KL divergence (``kld``), then
retrieval (``needles``). Each compressed run reads a fresh cache per sequence through
``kvlens.cache.compressed_attention``, exactly as in generation."""

from __future__ import annotations

from collections.abc import Callable

from kvlens.cache.backend import select_backend
from kvlens.config import KVConfig
from kvlens.evaluation.kld import (
    check_lengths,
    load_eval_text,
    max_positions,
    score_text,
    summarize,
)
from kvlens.evaluation.needles import build_grid, grid_lengths, run_grid
from kvlens.evaluation.needles import summarize as summarize_grid
from kvlens.evaluation.options import LONG_EVALS, EvalOptions
from kvlens.evaluation.short import short_evals
from kvlens.model.load import model_dtype
from kvlens.model.placement import input_device


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
        finished, report["interrupted"] = short_evals(model, tokenizer, configs, options,
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
                                       "model_dtype": model_dtype(model),
                                       "exact": summary["exact"]}
        for res, doc in zip(report["results"], summary["configs"]):
            if doc is not None:
                memory = doc.pop("memory", None)
                doc.pop("name")
                if doc.get("backend_reason"):  # the kld run's own: torch-path calls counted
                    res["backend_reason"] = doc.pop("backend_reason")
                res["kld"] = doc
                if memory and memory["kv_bytes_fp16"] >= res.get("kv_bytes_fp16", 0):
                    res.update(memory)  # the bytes of the largest cache the config built
        report["interrupted"] = scores.interrupted
    if grid is not None and not report["interrupted"]:
        scores = run_grid(model, tokenizer, configs, grid, options.backend, progress)
        summary = summarize_grid(scores)
        report["evaluation"]["retrieval"] = {**summary["protocol"], "exact": summary["exact"]}
        # summary["configs"] covers the configs that finished, in order (names may repeat)
        for res, doc in zip(report["results"], summary["configs"]):
            res["retrieval"] = {k: v for k, v in doc.items() if k != "name"}
        report["interrupted"] = scores.interrupted
    backend, why = select_backend(options.backend, device)  # a result's own reason wins
    report["backend_reason"] = next((r["backend_reason"] for r in reversed(report["results"])
                                     if r.get("backend_reason")), why)
    for res in report["results"]:
        res.setdefault("backend", backend)
    return report


def _every(progress: Callable[[str], None], label: str, parts: int = 8):
    """A ``(done, total)`` callback that reports about ``parts`` times over the run."""
    def update(done: int, total: int) -> None:
        if done == total or done % max(1, total // parts) == 0:
            progress(f"{label} {done}/{total}")
    return update
