"""Retrieval over a grid of lengths and depths: passkey and a key-value lookup among distractors.

Tasks (``TASKS``; prompts and seeding in docs/evaluation.md): **passkey**, the 5-digit key in
repeated filler, and **kv**, the 4-digit code of one name among ``DISTRACTORS`` others in
held-out paragraphs. Depth is the fraction of the filler before the needle; an answer is
correct when the digits appear in the greedy continuation of ``NEW_TOKENS`` tokens. Every
prompt has its own string-seeded random stream (``_rng``), shared with no other kvlens prompt.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlens.errors import InputError
from kvlens.evaluation.baselines import open_session
from kvlens.evaluation.decode import greedy
from kvlens.evaluation.stats import (
    BOOTSTRAP_SEED,
    RESAMPLES,
    bootstrap_indices,
    paired_difference,
    percentile_interval,
    wilson,
)
from kvlens.model.placement import input_device
from kvlens.text.heldout import paragraphs
from kvlens.text.prompts import FILLER, passkey_text

TASKS = ("passkey", "kv")
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_SEED = 0
NEW_TOKENS = 8
DISTRACTORS = 3  # other "The code for NAME is NNNN." sentences in a kv prompt
NAMES = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
         "jasper", "kestrel", "lagoon", "meadow", "nickel", "onyx", "pepper", "quill", "raven",
         "sorrel", "tundra")


@dataclass(frozen=True)
class NeedlePrompt:
    task: str
    length: int  # target length in tokens
    depth: float
    index: int
    text: str
    answer: str


@dataclass
class GridScores:
    prompts: list[NeedlePrompt]
    tokens: list[int] = field(default_factory=list)  # measured prompt lengths
    exact: list[bool] = field(default_factory=list)
    configs: list[tuple[str, bool, list[bool]]] = field(default_factory=list)
    interrupted: bool = False


def grid_lengths(requested: Sequence[int] | None, max_positions: int | None) -> tuple[int, ...]:
    """Requested lengths (``InputError`` past the model's context) or the defaults that fit."""
    room = None if max_positions is None else max_positions - NEW_TOKENS - 8
    if requested:
        bad = [n for n in requested if n < 64 or (room is not None and n > room)]
        if bad:
            raise InputError(f"Retrieval lengths {', '.join(map(str, bad))} do not fit: allowed "
                             f"64-{room if room is not None else 'any'} tokens (the model's "
                             f"max_position_embeddings is {max_positions}, minus "
                             f"{NEW_TOKENS + 8} for the answer).")
        return tuple(requested)
    fits = tuple(n for n in DEFAULT_LENGTHS if room is None or n <= room)
    if not fits:
        raise InputError(f"The model's context ({max_positions} tokens) is shorter than the "
                         f"smallest default retrieval length {DEFAULT_LENGTHS[0]}; give "
                         "{retrieval_lengths}.")
    return fits


def _rng(seed: int, task: str, length: int, depth: float, i: int) -> random.Random:
    return random.Random(f"kvlens.eval.retrieval/{seed}/{task}/{length}/{depth}/{i}")


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def passkey_prompt(tokenizer, length: int, depth: float, rng: random.Random) -> tuple[str, str]:
    key = f"{rng.randint(10000, 99999)}"
    per = max(1, _ntok(tokenizer, FILLER))
    repeats = max(1, (length - _ntok(tokenizer, passkey_text(key, 0, 0))) // per)
    before = round(depth * repeats)
    return passkey_text(key, before, repeats - before), key


def kv_prompt(tokenizer, length: int, depth: float, rng: random.Random,
              paras: list[str]) -> tuple[str, str]:
    names = rng.sample(NAMES, 1 + DISTRACTORS)
    codes = [f"{c}" for c in rng.sample(range(1000, 10000), 1 + DISTRACTORS)]
    target, code = names[0], codes[0]
    question = (f"\n\nQuestion: What is the code for {target}?\nAnswer: The code for {target} "
                "is")
    facts = [f"The code for {n} is {c}." for n, c in zip(names, codes)]
    budget = length - _ntok(tokenizer, question) - sum(_ntok(tokenizer, f) + 2 for f in facts)
    start = rng.randrange(len(paras))
    body, used = [], 0
    for j in range(len(paras)):
        p = paras[(start + j) % len(paras)]
        n = _ntok(tokenizer, p) + 2
        if used + n > budget:  # skip a paragraph that does not fit; a shorter one may
            if budget - used < 16:
                break
            continue
        body.append(p)
        used += n
    if len(body) < 2:
        raise InputError(f"Retrieval length {length} is too short for the key-value task "
                         f"({1 + DISTRACTORS} facts, a question and at least two paragraphs); "
                         "use 150 tokens or more.")
    slots: dict[int, list[str]] = {round(depth * len(body)): [facts[0]]}
    for fact in facts[1:]:  # distractors: any gap, several may share one
        slots.setdefault(rng.randrange(len(body) + 1), []).append(fact)
    out = []
    for s in range(len(body) + 1):
        out.extend(slots.get(s, []))
        if s < len(body):
            out.append(body[s])
    return "\n\n".join(out) + question, code


def build_grid(tokenizer, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
               per_cell: int = 1, seed: int = DEFAULT_SEED) -> list[NeedlePrompt]:
    """``per_cell`` prompts of each task at every (length, depth), deterministic."""
    if per_cell < 1:
        raise InputError(f"{{retrieval_prompts}} must be at least 1 (got {per_cell}).")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise InputError(f"Retrieval depths must be in [0, 1]; got {bad}.")
    paras = paragraphs()
    prompts = []
    for length, depth, task, i in itertools.product(lengths, depths, TASKS, range(per_cell)):
        rng = _rng(seed, task, length, depth, i)
        if task == "passkey":
            text, answer = passkey_prompt(tokenizer, length, depth, rng)
        else:
            text, answer = kv_prompt(tokenizer, length, depth, rng, paras)
        prompts.append(NeedlePrompt(task, length, depth, i, text, answer))
    return prompts


def run_grid(model, tokenizer, configs: Sequence, prompts: list[NeedlePrompt],
             backend: str = "auto", progress: Callable[[str], None] = lambda msg: None
             ) -> GridScores:
    """Greedy answers of the exact model (plain ``DynamicCache``) and of every config.

    Ctrl-C stops early: the configs finished so far are kept, ``interrupted=True``."""
    device = input_device(model)
    encoded = [tokenizer(p.text, return_tensors="pt").input_ids.to(device) for p in prompts]
    scores = GridScores(prompts, tokens=[int(e.shape[1]) for e in encoded])

    def answers(label: str, session) -> list[bool]:  # session None: the exact model
        got = []
        for j, (p, ids) in enumerate(zip(prompts, encoded)):
            progress(f"{label}: retrieval {j + 1}/{len(prompts)} ({p.task}, {ids.shape[1]} "
                     "tokens)")
            new, _ = greedy(model, ids, session, NEW_TOKENS)
            got.append(p.answer in tokenizer.decode(new[0], skip_special_tokens=True))
        return got

    try:
        scores.exact = answers("exact", None)
        for config in configs:
            with open_session(model, config, backend) as session:
                got = answers(config.name, session)
            scores.configs.append((config.name, bool(config.compressed), got))
    except KeyboardInterrupt:
        scores.interrupted = True
    return scores


def _cells(prompts: list[NeedlePrompt], correct: list[bool], tokens: list[int]) -> dict:
    """Per length (both tasks) and per task and length: correct/total, Wilson interval."""
    out: dict = {"by_length": [], "by_task": []}
    for length in sorted({p.length for p in prompts}):
        sel = [j for j, p in enumerate(prompts) if p.length == length]
        out["by_length"].append(_cell({"length": length}, sel, correct, tokens))
        for task in TASKS:
            sub = [j for j in sel if prompts[j].task == task]
            if sub:
                out["by_task"].append(_cell({"task": task, "length": length}, sub, correct,
                                            tokens))
    return out


def _cell(label: dict, sel: list[int], correct: list[bool], tokens: list[int]) -> dict:
    k = int(sum(correct[j] for j in sel))
    lo, hi = wilson(k, len(sel))
    return {**label, "correct": k, "total": len(sel), "accuracy": k / len(sel),
            "wilson95": [lo, hi], "mean_tokens": round(float(np.mean([tokens[j] for j in sel])))}


def _outcomes(scores: GridScores, correct: list[bool], ci95: list[float] | None = None) -> dict:
    """One run's answers: counts, outcomes, accuracy (with its bootstrap ``ci95`` when given),
    Wilson interval and cells."""
    k = int(sum(correct))
    return {"correct": k, "total": len(correct), "outcomes": [bool(c) for c in correct],
            "accuracy": float(np.mean(correct)), **({"ci95": ci95} if ci95 else {}),
            "wilson95": list(wilson(k, len(correct))),
            **_cells(scores.prompts, correct, scores.tokens)}


def summarize(scores: GridScores, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """JSON-ready results: protocol, the exact model's cells, per-config cells and comparisons."""
    prompts = scores.prompts
    protocol = {"prompts": len(prompts), "lengths": sorted({p.length for p in prompts}),
                "depths": sorted({p.depth for p in prompts}), "tasks": list(TASKS),
                "new_tokens": NEW_TOKENS, "interrupted": scores.interrupted,
                "bootstrap": {"unit": "prompt", "resamples": resamples, "seed": seed},
                # the order of every "outcomes" list: runs can be pooled and paired later
                "prompt_order": [{"task": p.task, "length": p.length, "depth": p.depth,
                                  "index": p.index} for p in prompts]}
    if not scores.exact:
        return {"protocol": protocol, "exact": None, "configs": []}
    draws = bootstrap_indices(len(prompts), resamples, seed)

    def acc_samples(correct):
        return np.asarray(correct, dtype=np.float64)[draws].mean(axis=1)

    exact_samples = acc_samples(scores.exact)
    exact_doc = _outcomes(scores, scores.exact)
    first = next((i for i, (_, compressed, _) in enumerate(scores.configs) if compressed), None)
    out = []
    for i, (name, _, correct) in enumerate(scores.configs):
        samples = acc_samples(correct)
        res = {"name": name, **_outcomes(scores, correct, percentile_interval(samples))}
        res["vs_exact"] = {"accuracy": paired_difference(
            res["accuracy"], exact_doc["accuracy"], samples, exact_samples)}
        res["vs_first"] = None
        if first is not None and i != first:
            ref_name, _, ref = scores.configs[first]
            res["vs_first"] = {"reference": ref_name, "accuracy": paired_difference(
                res["accuracy"], float(np.mean(ref)), samples, acc_samples(ref))}
        out.append(res)
    return {"protocol": protocol, "exact": exact_doc, "configs": out}
