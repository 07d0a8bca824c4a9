"""Where ``recommend``'s time goes: wall seconds per stage, exclusive of nested stages.

``measure`` and ``choose`` open a ``Profile`` (``profiling()``); code below them marks its work
with ``stage(name)``, a no-op when none is open. Each stage's runs are also kept as wall-clock
``spans``, so a memory sampler outside the process can say which stage its peak fell in. A
per-layer stage (``kvlens.recommend.parallel.map_layers``) records what it is predicted to take
once its first round of layers has finished (``expect``), the rest at their rate
(``extrapolate``), each layer counted by its work where that differs (``perturbed_work``), and
tells the profile's ``log``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from kvlens.units import format_seconds

_current: ContextVar[Profile | None] = ContextVar("kvlens_recommend_profile", default=None)
_log: ContextVar[Callable[[str], None] | None] = ContextVar("kvlens_recommend_log", default=None)


@dataclass
class Profile:
    """Exclusive wall seconds per stage, in the order stages were first entered."""

    stages: dict[str, float] = field(default_factory=dict)
    # [name, start, end] per run of a stage, in Unix seconds (``time.time()``), nested ones too
    spans: list[list] = field(default_factory=list)
    # predicted wall seconds of a stage (nested stages included), from its first units' time
    predicted: dict[str, float] = field(default_factory=dict)
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
def profiling(profile: Profile | None = None, log: Callable[[str], None] | None = None
              ) -> Iterator[Profile]:
    """Open ``profile`` (a new one by default) for ``stage`` calls inside the block; ``log``
    receives each prediction ``expect`` records."""
    profile = profile if profile is not None else Profile()
    token, said = _current.set(profile), _log.set(log)
    try:
        yield profile
    finally:
        _current.reset(token)
        _log.reset(said)


def expect(seconds_left: float, basis: str) -> None:
    """Record that the innermost open stage will take ``seconds_left`` more (``basis``: what
    that was extrapolated from), and say so; a no-op outside a stage."""
    profile = _current.get()
    if profile is None or not profile._open:
        return
    name, start, _nested = profile._open[-1]
    total = time.perf_counter() - start + seconds_left
    profile.predicted[name] = total
    log = _log.get()
    if log is not None:
        log(f"predicted: {name} about {format_seconds(total)} ({basis})")


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


def extrapolate(elapsed: float, done: float, total: float) -> float:
    """Predicted seconds for ``total`` units of work when ``done`` of them took ``elapsed``."""
    if not done > 0:
        raise ValueError(f"no finished work to extrapolate from (done={done})")
    return elapsed * total / done


def perturbed_work(positions: Sequence[int], runs: Sequence[int], layers: int,
                   layer_flops: float, head_flops: float) -> list[float]:
    """Work of the layout sensitivity's units, in FLOPs: the unit at decoder position
    ``positions[i]`` makes ``runs[i]`` perturbed runs, each through the decoder layers from its
    own to the last (``layers`` in all, ``layer_flops`` each) and the LM head (``head_flops``)."""
    return [r * ((layers - p) * layer_flops + head_flops) for p, r in zip(positions, runs)]
