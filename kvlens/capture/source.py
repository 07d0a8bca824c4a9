"""The model a capture came from: the ``--model`` string that reloads it
(``model_spec_from_capture``) and ``CaptureModel``, the one way kvlens loads a model beside a
capture, once, when first needed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlens.capture.store import open_capture
from kvlens.errors import InputError
from kvlens.model.load import load_model


def model_spec_from_capture(meta) -> str | None:
    """The ``--model`` string that reloads the captured model, if the capture says."""
    kind, _, where = meta.model_source.partition(":")
    return where if kind in ("gguf", "dir", "hub") and where else None


class CaptureModel:
    """``model`` (a ``--model`` string), else the model the capture came from, loaded once when
    first asked for (``get``) with ``place`` (``load_model``'s keywords); ``log`` hears ``Loading
    SPEC{for_what} ...`` first."""

    def __init__(self, capture: str | Path, model: str | None = None,
                 place: dict[str, Any] | None = None,
                 log: Callable[[str], None] | None = None, for_what: str = ""):
        self.capture, self.model, self.place = Path(capture), model, dict(place or {})
        self.log, self.for_what = log, for_what
        self.loaded: tuple | None = None

    def spec(self) -> str | None:
        """The ``--model`` string loaded: ``model``, else the capture's own (None: the
        capture does not say)."""
        if self.model:
            return self.model
        with open_capture(self.capture) as cap:
            return model_spec_from_capture(cap.meta)

    def get(self) -> tuple:
        """``(model, tokenizer)``; ``InputError`` where no model is named and the capture does
        not say which it came from."""
        if self.loaded is None:
            spec = self.spec()
            if spec is None:
                raise InputError(f"{self.capture} does not say which model it came from; pass "
                                 "--model.")
            if self.log is not None:
                self.log(f"Loading {spec}{self.for_what} ...")
            mdl, tok, _ = load_model(spec, **self.place)
            self.loaded = (mdl, tok)
        return self.loaded
