"""The held-out evaluation text: never used to capture, calibrate or design anything.

``kvlens/text/data/heldout.txt`` is prose (with some code) from the Python Language Reference as it
ships with CPython 3.11.7 (``pydoc_data/topics.py``, PSF licence: ``heldout_NOTICE.txt`` beside
it). It is disjoint from the capture/calibration corpus ``kvlens/text/data/corpus.txt`` and from
``recommend``'s retrieval probe (built from that corpus): a test asserts they share no span of
50 tokens. It is long enough for a 4096- (or 8192-) token evaluation (its length in tokens:
docs/evaluation.md).
"""

from __future__ import annotations

from importlib import resources

HELDOUT_NAME = "builtin:heldout"
HELDOUT_FILE = "heldout.txt"


def heldout_text() -> str:
    return resources.files("kvlens.text.data").joinpath(HELDOUT_FILE).read_text(encoding="utf-8")


def paragraphs(text: str | None = None) -> list[str]:
    """Blank-line separated paragraphs of the held-out text (filler for needle prompts)."""
    text = heldout_text() if text is None else text
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]
