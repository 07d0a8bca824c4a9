"""What a stage of ``recommend`` will take, from its own progress.

A per-layer stage (``kvlens.recommend.parallel.map_layers``) runs one unit per capture layer.
Once its first round has finished (one layer per worker process), the rest is extrapolated at
the rate of the finished layers: ``extrapolate``. Nothing is fitted on a machine: the rate is
this run's own, on this machine under its load at the time (docs/benchmarks.md compares it
with the fitted cost model it replaced).
"""

from __future__ import annotations


def extrapolate(elapsed: float, done: float, total: float) -> float:
    """Predicted seconds for ``total`` units of work when ``done`` of them took ``elapsed``."""
    if not done > 0:
        raise ValueError(f"no finished work to extrapolate from (done={done})")
    return elapsed * total / done
