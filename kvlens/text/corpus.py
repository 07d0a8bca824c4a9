"""Input text: the built-in default corpus, ``--text FILE``, and cutting token windows."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvlens.errors import InputError

DEFAULT_CORPUS_NAME = "builtin:corpus"


def load_text(path: str | Path | None) -> tuple[str, str]:
    """Return ``(text, source_label)``; ``None`` means the built-in corpus."""
    if path is None:
        text = resources.files("kvlens.text.data").joinpath("corpus.txt").read_text(encoding="utf-8")
        return text, DEFAULT_CORPUS_NAME
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"Text file not found: {p}.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{p} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    if not text.strip():
        raise InputError(f"{p} is empty; give a text file with some content.")
    return text, str(p)


def token_windows(tokenizer, text: str, samples: int, tokens: int, source: str = "text"):
    """``samples`` non-overlapping windows of ``tokens`` tokens of ``text`` (int64 ``[samples,
    tokens]``), evenly spaced from the start; ``InputError`` when the text is too short."""
    import torch

    if samples < 1 or tokens < 2:
        raise InputError(f"Need {{samples}} >= 1 and {{tokens}} >= 2 (got {samples}, {tokens}).")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    need = samples * tokens
    if ids.numel() < need:
        raise InputError(
            f"The text from {source} has {ids.numel()} tokens but {samples} samples x {tokens} "
            f"tokens = {need} are needed. Give a longer {{text}} file or lower "
            "{samples}/{tokens}.")
    stride = (ids.numel() - tokens) // max(samples - 1, 1) if samples > 1 else 0
    stride = max(stride, tokens)
    starts = [i * stride for i in range(samples)]
    return torch.stack([ids[s:s + tokens] for s in starts]).long()
