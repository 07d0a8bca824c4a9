"""Where ``recommend``'s time goes: wall seconds per stage, exclusive of nested stages.

``measure`` and ``choose`` open a ``Profile`` (``profiling()``); code below them marks its work
with ``stage(name)``, a no-op when none is open. Each stage's runs are also kept as wall-clock
``spans``, so a memory sampler outside the process can say which stage its peak fell in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

_current: ContextVar[Profile | None] = ContextVar("kvlens_recommend_profile", default=None)


@dataclass
class Profile:
    """Exclusive wall seconds per stage, in the order stages were first entered."""

    stages: dict[str, float] = field(default_factory=dict)
    # [name, start, end] per run of a stage, in Unix seconds (``time.time()``), nested ones too
    spans: list[list] = field(default_factory=list)
    # [name, start, nested] per stage now open: the run's state, never a constructor argument
    _open: list[list] = field(default_factory=list, init=False, repr=False)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def merge(self, other: Profile) -> None:
        for name, seconds in other.stages.items():
            self.add(name, seconds)
        self.spans.extend(other.spans)

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def to_dict(self) -> dict:
        return {"stages": dict(self.stages), "total_seconds": self.total,
                "spans": [list(s) for s in self.spans]}


@contextmanager
def profiling(profile: Profile | None = None) -> Iterator[Profile]:
    """Open ``profile`` (a new one by default) for ``stage`` calls inside the block."""
    profile = profile if profile is not None else Profile()
    token = _current.set(profile)
    try:
        yield profile
    finally:
        _current.reset(token)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Charge the block's wall time, less that of stages nested in it, to ``name``."""
    profile = _current.get()
    if profile is None:
        yield
        return
    profile.stages.setdefault(name, 0.0)
    entry = [name, time.perf_counter(), 0.0]
    started = time.time()
    profile._open.append(entry)
    try:
        yield
    finally:
        profile._open.pop()
        profile.spans.append([name, started, time.time()])
        elapsed = time.perf_counter() - entry[1]
        profile.add(name, elapsed - entry[2])
        if profile._open:
            profile._open[-1][2] += elapsed
