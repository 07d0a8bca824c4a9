"""Prompt builders shared by recommend's retrieval probe and the evaluations: the passkey
sentence in filler text (short passkey check, long-context retrieval grid) and the locker-code
probe.

The probe is a long prompt whose answer is one distant fact, so that recommend's allocation
minimises retrieval error too and not only the text average, which local attention dominates
(docs/lab-notes/recommend.md). It is about ``tokens`` tokens of the second half of the built-in
corpus (capture and perplexity read its first half), a five-digit code sentence at a seeded
depth and a question asking for it; its wording differs from the passkey prompts on purpose:
the probe must not be the test.
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
