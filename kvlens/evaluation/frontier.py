"""The bits-vs-KLD frontier of ``kvlens generate --compare ... --eval kld``: which settings no
other setting beats on both memory and quality.

A point is one scored setting: the bits per element its cache held (measured) and its mean KL
divergence against the exact model. It is on the Pareto front when no other point has at most
its bits and at most its KLD, and strictly less of one. ``frontier_doc`` builds the JSON that
``generate`` carries as ``"frontier"`` (docs/generate.md) and ``kvlens.plots.frontier`` draws.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvlens.config import PRESETS, is_engine_setting
from kvlens.evaluation.baselines import is_baseline

# What told apart in the chart: engine settings (llamacpp:, vllm:, ...), kvlens presets,
# kvlens config files (e.g. recommend's output) and transformers' own caches (hf-*).
KINDS = ("engine", "preset", "config", "baseline")
#: a result's ``engine_arithmetic`` when it is a llama.cpp setting scored without the engine's
#: matrix products (``kvlens.deploy.engine_run.mark_partial_llamacpp``): the cache alone
PARTIAL_LLAMACPP = "partial"


@dataclass(frozen=True)
class FrontierPoint:
    name: str
    kind: str  # one of KINDS
    bits: float  # bits per element the cache held
    mean_kld: float
    ci95: tuple[float, float]
    partial: bool = False  # a llama.cpp setting scored without the engine's matrix products

    def dominates(self, other: FrontierPoint) -> bool:
        return (self.bits <= other.bits and self.mean_kld <= other.mean_kld
                and (self.bits < other.bits or self.mean_kld < other.mean_kld))


def setting_kind(item: str) -> str:
    """The kind of one ``--compare`` / ``--preset`` item as the user spelled it."""
    if is_baseline(item):
        return "baseline"
    if is_engine_setting(item):
        return "engine"
    return "preset" if item in PRESETS else "config"


def pareto_front(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point dominates, in order of bits (then KLD, then name)."""
    front = [p for p in points if not any(q.dominates(p) for q in points if q is not p)]
    return sorted(front, key=lambda p: (p.bits, p.mean_kld, p.name))


def points_from_results(results: Iterable[Mapping], kinds: Sequence[str]) -> list[FrontierPoint]:
    """One point per result that has a mean KLD and measured bits (an interrupted run's
    unfinished configs have none); ``kinds`` is aligned with ``results``."""
    out = []
    for r, kind in zip(results, kinds):
        k = r.get("kld") or {}
        stat = k.get("mean_kld") or {}
        bits, value = r.get("bits_per_element"), stat.get("value")
        if not _finite(bits) or not _finite(value):
            continue
        lo, hi = stat.get("ci95") or (value, value)
        out.append(FrontierPoint(str(r["name"]), kind, float(bits), float(value),
                                 (float(lo), float(hi)),
                                 r.get("engine_arithmetic") == PARTIAL_LLAMACPP))
    return out


def frontier_doc(points: Sequence[FrontierPoint]) -> dict:
    """``{"points": [{name, kind, bits, mean_kld, ci95, on_front[, partial]}], "front": [names
    in bits order]}``: the points in the order given (``partial``: true for a llama.cpp setting
    scored without the engine's matrix products)."""
    front = pareto_front(points)
    on = {id(p) for p in front}
    return {"points": [{"name": p.name, "kind": p.kind, "bits": p.bits,
                        "mean_kld": p.mean_kld, "ci95": list(p.ci95),
                        "on_front": id(p) in on, **({"partial": True} if p.partial else {})}
                       for p in points],
            "front": [p.name for p in front]}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
