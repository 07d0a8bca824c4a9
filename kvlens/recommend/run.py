"""One budget's call (per-layer target): ``check`` the capture and the options before any work,
read a measurement an earlier run kept (``kvlens.recommend.reuse``) or measure and keep it
(``measurement``), then allocate for the budget (``recommend``).
"""

from __future__ import annotations

from pathlib import Path

from kvlens.capture.store import open_capture
from kvlens.recommend.allocation import check_budget
from kvlens.recommend.options import RecommendOptions
from kvlens.recommend.pipeline import (
    LogFn,
    Measurements,
    ProgressFn,
    check_capture,
    choose,
    measure,
)
from kvlens.recommend.result import Recommendation
from kvlens.recommend.reuse import keep, kept_file, read_kept, reused_note


def check(path: str | Path, opts: RecommendOptions) -> None:
    """Everything about ``opts`` on this capture that can be refused before measuring
    (``check_capture``), and a budget the cheapest candidates exceed (``check_budget``)."""
    with open_capture(path) as cap:
        meta = cap.meta
    check_capture(path, meta, opts)
    check_budget(meta, opts)


def measurement(path: str | Path, opts: RecommendOptions, progress: ProgressFn | None = None,
                *, remeasure: bool = False, log: LogFn | None = None
                ) -> tuple[Measurements, dict[str, float] | None]:
    """``(measurements, predicted seconds per stage)`` of ``opts`` on the capture at ``path``:
    checked (``check``), then read back from an earlier run with the same measuring options
    (predicted None) or measured and kept (``remeasure`` measures again). ``log`` receives
    each stage's prediction as its first layers finish, or the note that the measurement was
    reused."""
    say = log or (lambda _msg: None)
    check(path, opts)
    kept = kept_file(path, opts)
    measured = None if remeasure else read_kept(kept)
    if measured is not None:
        say(reused_note(kept))
        return measured, None
    measured = measure(path, opts, progress, log=say)
    keep(measured, kept)
    return measured, dict(measured.profile.predicted)


def recommend(path: str | Path, opts: RecommendOptions, progress: ProgressFn | None = None, *,
              remeasure: bool = False, log: LogFn | None = None) -> Recommendation:
    """The per-layer recommendation for ``opts`` on the capture at ``path``: ``measurement``,
    then allocated under ``opts.budget_bits``."""
    measured, predicted = measurement(path, opts, progress, remeasure=remeasure, log=log)
    rec = choose(measured, opts)
    rec.predicted = predicted
    return rec
