"""What a stage of ``recommend`` will take, from its own progress.

A per-layer stage (``kvlens.recommend.parallel.map_layers``) runs one unit per capture layer.
Once its first round has finished (one layer per worker process), the rest is extrapolated at
the rate of the finished work: ``extrapolate``. Units whose work differs say how much each
holds (``perturbed_work``: a layout sensitivity run starts at its own layer), so that the first,
longest units do not stretch the estimate. Nothing is fitted on a machine: the rate is this
run's own, on this machine under its load at the time (docs/benchmarks.md compares it with the
fitted cost model it replaced).
"""

from __future__ import annotations

from collections.abc import Sequence


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
