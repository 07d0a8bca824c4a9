"""Short-context checks of a compressed cache (kept for continuity; they say little about long
contexts): decode-mode perplexity, passkey retrieval and greedy agreement with the exact model
(docs/generate.md).

``short_evals`` runs them (and plain generation with a prompt) config by config; the exact
preset, run first when no config is the exact one, is the reference for ``ppl_change`` (its
perplexity is reported as ``ppl_fp16``, a key older than the ``exact`` preset) and
``agreement``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvlens.config import KVConfig, preset
from kvlens.errors import InputError
from kvlens.evaluation.baselines import held_bytes, open_session
from kvlens.evaluation.decode import cache_kwargs, greedy
from kvlens.evaluation.kld import load_eval_text
from kvlens.evaluation.options import EvalOptions
from kvlens.model.placement import input_device
from kvlens.text.prompts import FILLER, passkey_text

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


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


def short_evals(model, tokenizer, configs: list[KVConfig], options: EvalOptions,
                 progress: Callable[[str], None]) -> tuple[list[dict], bool]:
    """Generation with ``options.prompt`` and the short-context ppl / passkey / agreement:
    ``(results of the configs that finished, interrupted)``."""
    device = input_device(model)
    exact = preset("exact")  # the reference: no compression, the model's dtype
    need_agree = "agreement" in options.evals
    prompt = options.prompt or (DEFAULT_PROMPT if need_agree else None)

    def encode(text: str):
        return tokenizer(text, return_tensors="pt").input_ids.to(device)

    # what every config is run on, tokenized once (None: no generation, no ppl)
    prompt_ids = encode(prompt) if prompt else None
    ppl_ids = _ppl_ids(tokenizer, options, device) if "ppl" in options.evals else None
    passkeys = [(encode(text), key) for text, key in passkey_prompts(
        tokenizer, options.passkey_prompts, options.passkey_context, options.seed)] \
        if "passkey" in options.evals else []
    baseline: dict = {}

    def run(config: KVConfig) -> dict:
        return _run_config(model, tokenizer, config, options, progress, prompt_ids, ppl_ids,
                           passkeys)

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
    for res in results:  # against the exact reference (none when it did not finish)
        if ppl_ids is not None and baseline:
            res["ppl_fp16"] = baseline["ppl"]
            res["ppl_change"] = res["ppl"] / baseline["ppl"] - 1
        if need_agree and baseline:
            res["agreement"] = agreement(res["_tokens"], baseline["_tokens"])
    for res in results:  # the greedy tokens were kept for agreement only
        res.pop("_tokens", None)
    return results, interrupted


def _ppl_ids(tokenizer, options: EvalOptions, device):
    """The first ``options.ppl_tokens`` tokens of the evaluation text ``[1, T]``, on
    ``device``; refused when the text is shorter."""
    text, source = load_eval_text(options.text)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < options.ppl_tokens:
        raise InputError(f"The text from {source} has {ids.shape[1]} tokens; decode-mode "
                         f"perplexity needs {options.ppl_tokens} (lower {{ppl_tokens}} or "
                         "give a longer {text}).")
    return ids[:, :options.ppl_tokens].to(device)


def _run_config(model, tokenizer, config: KVConfig, options: EvalOptions,
                progress: Callable[[str], None], prompt_ids, ppl_ids, passkeys: list) -> dict:
    """One config's generation of ``prompt_ids``, decode-mode ppl of ``ppl_ids`` and answers to
    ``passkeys`` (``(ids, key)`` pairs) in one session, with the held bytes of its biggest cache
    (the greedy tokens kept under ``_tokens`` for agreement)."""
    res: dict = {"name": config.name}
    caches = []
    with open_session(model, config, options.backend) as session:
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
        correct = 0
        for i, (ids, key) in enumerate(passkeys):  # greedy answers to the prompts
            progress(f"{config.name}: passkey {i + 1}/{len(passkeys)}")
            new, cache = greedy(model, ids, session, 8)
            caches.append(cache)
            correct += key in tokenizer.decode(new[0], skip_special_tokens=True)
        if passkeys:
            res["passkey"] = {"correct": correct, "total": len(passkeys), "context_tokens": round(
                sum(ids.shape[1] for ids, _ in passkeys) / len(passkeys))}
    res["backend_reason"] = session.backend_reason
    if caches:  # the bytes of the biggest cache
        res.update(max((held_bytes(config, c) for c in caches), key=lambda r: r["kv_bytes_fp16"]))
    return res


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Position-by-position token agreement with the reference continuation."""
    n = min(len(tokens), len(reference))
    matching = sum(a == b for a, b in zip(tokens[:n], reference[:n]))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) != len(reference):
        first = n
    return {"matching": matching, "total": len(reference), "first_divergence": first}
