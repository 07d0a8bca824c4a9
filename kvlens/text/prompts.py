"""Prompt builders shared by recommend's retrieval probe and the evaluations: the passkey
sentence in filler text (short passkey check and the long-context retrieval grid) and the
locker-code probe.

A retrieval probe for ``recommend``: a long prompt whose answer is one distant fact.

Attention error averaged over ordinary text is dominated by local attention (recent tokens,
sinks) and under-weights what long-context retrieval needs: a query near the end reading one
far-back token sharply, so an allocation by the text average alone can keep perplexity and
still lose passkey retrieval. The probe's errors make retrieval part of what the allocation
minimises (the measurements: docs/lab-notes/recommend.md).

The probe: about ``tokens`` tokens of the second half of the built-in corpus (the default
capture windows and the perplexity evaluation read its first half), a sentence stating a
five-digit code inserted at a seeded depth (on a sentence boundary), and a question asking for
it at the end. ``recommend`` runs the model on it, and measures each candidate's attention
output error on the **last few queries** (the answer position), with the same streaming view
of the cache (window and sinks exact) as the text errors. The wording and filler differ from
``kvlens.evaluation.short``'s passkey prompts on purpose: the probe must not be the test.
"""

from __future__ import annotations

import random

from kvlens.errors import InputError
from kvlens.text.corpus import load_text

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
PASSKEY_HEAD = ("There is important info hidden inside a lot of irrelevant text. Find it and "
                "memorize it. ")
PASSKEY_TAIL = "What is the pass key? The pass key is"


def passkey_text(key: str, before: int, after: int) -> str:
    """The passkey prompt: ``before`` fillers, the sentence naming ``key``, ``after`` fillers."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return PASSKEY_HEAD + FILLER * before + needle + FILLER * after + PASSKEY_TAIL

QUESTION = "\n\nQuestion: What is the locker code mentioned above?\nAnswer: The locker code is"


def retrieval_text(tokenizer, tokens: int = 960, seed: int = 7) -> tuple[str, str]:
    """``(prompt, code)``: about ``tokens`` tokens, the code sentence at a seeded depth."""

    corpus, _ = load_text(None)
    held_out = corpus[len(corpus) // 2:]
    sentences = [s.strip() + "." for s in held_out.replace("\n", " ").split(". ") if s.strip()]
    rng = random.Random(seed)
    code = f"{rng.randint(10000, 99999)}"
    needle = f"Note for later: the locker code is {code}."
    budget = tokens - len(tokenizer(needle + QUESTION, add_special_tokens=False).input_ids)
    filler, used = [], 0
    for s in sentences:
        n = len(tokenizer(" " + s, add_special_tokens=False).input_ids)
        if used + n > budget:
            break
        filler.append(s)
        used += n
    if len(filler) < 4:
        raise InputError(f"The retrieval probe needs more text than {tokens} tokens allow; "
                         "raise the probe length.")
    depth = rng.randint(1, len(filler) - 1)
    body = filler[:depth] + [needle] + filler[depth:]
    return " ".join(body) + QUESTION, code
