"""What ``kvlens generate --eval`` runs: the evaluation names (``EVALS``), their options
(``EvalOptions``, which checks its own values) and the parser of ``--eval`` lists, all checked
before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

from kvlens.cache.backend import BACKENDS
from kvlens.errors import InputError
from kvlens.evaluation.kld import DEFAULT_CHUNK
from kvlens.evaluation.needles import DEFAULT_DEPTHS, DEFAULT_SEED

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
    seed: int = DEFAULT_SEED
    backend: str = "auto"
    eval_tokens: int | None = None  # kld: None = 4096 capped by the model's context
    chunk: int = DEFAULT_CHUNK  # kld: tokens per forward (1 = decode mode)
    retrieval_prompts: int = 1  # prompts per task, length and depth
    retrieval_lengths: tuple[int, ...] | None = None  # None: 1k, 2k, 4k that fit the model
    retrieval_depths: tuple[float, ...] = DEFAULT_DEPTHS

    def __post_init__(self) -> None:
        _check_evals(self.evals)
        if self.backend not in BACKENDS:
            raise InputError(f"Unknown {{backend}} {self.backend!r}; allowed: "
                             f"{', '.join(BACKENDS)}.")
        if self.chunk < 1:
            raise InputError(f"{{chunk}} must be at least 1 (1 = decode mode); got {self.chunk}.")
        for field, low in (("eval_tokens", 2), ("max_new_tokens", 1), ("retrieval_prompts", 1),
                           ("passkey_prompts", 1), ("passkey_context", 64), ("ppl_tokens", 40)):
            value = getattr(self, field)  # None: the default (eval_tokens)
            if value is not None and value < low:
                raise InputError(f"{{{field}}} must be at least {low} (got {value}).")
        if self.eval_tokens is not None and self.chunk > self.eval_tokens:
            raise InputError(f"{{chunk}} must be between 1 (decode mode) and {{eval_tokens}} "
                             f"({self.eval_tokens}); got {self.chunk}.")


def parse_evals(spec: str | None) -> tuple[str, ...]:
    if not spec:
        return ()
    return _check_evals(tuple(s.strip() for s in spec.split(",") if s.strip()))


def _check_evals(names: tuple[str, ...]) -> tuple[str, ...]:
    bad = [n for n in names if n not in EVALS]
    if bad:
        raise InputError(f"Unknown evaluation(s) {', '.join(bad)}; allowed: {', '.join(EVALS)}.")
    return names


def parse_lengths(spec: str | None) -> tuple[int, ...] | None:
    """A ``--retrieval-lengths`` comma list (``None``: not given)."""
    if not spec:
        return None
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{{retrieval_lengths}} must be a comma list of integers (got "
                         f"{spec!r}).") from None
