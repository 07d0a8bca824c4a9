"""What ``kvlens generate --eval`` runs: the evaluation names (``EVALS``), their options
(``EvalOptions``) and the parser of ``--eval`` lists, checked before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.errors import InputError

EVALS = ("ppl", "passkey", "agreement", "kld", "retrieval")
LONG_EVALS = ("kld", "retrieval")


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
