"""The held-out evaluation text: never used to capture, calibrate or design anything.

``data/heldout.txt`` is prose (with some code) from the Python Language Reference of CPython
3.11.7 (``pydoc_data/topics.py``, PSF licence: ``heldout_NOTICE.txt``), disjoint from the
corpus ``data/corpus.txt`` and the retrieval probe built from it (a test checks).
"""

from __future__ import annotations

from importlib import resources

HELDOUT_NAME = "builtin:heldout"
HELDOUT_FILE = "heldout.txt"


def heldout_text() -> str:
    return resources.files("kvlens.text.data").joinpath(HELDOUT_FILE).read_text(encoding="utf-8")


def paragraphs() -> list[str]:
    """Blank-line separated paragraphs of the held-out text (filler for needle prompts)."""
    return [p.strip("\n") for p in heldout_text().split("\n\n") if p.strip()]
