"""Intervals for evaluation results: Wilson intervals for proportions, seeded bootstrap.

Every config's statistic is recomputed on the same resampled units (``bootstrap_indices``), so
a difference between two configs gets a paired interval; one that contains 0 is "not
distinguishable" (docs/evaluation.md, "Intervals and paired comparisons").
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # standard normal quantile for a two-sided 95% interval
RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def wilson(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``successes`` out of ``total`` (``(0, 1)`` when ``total = 0``).

    Unlike the normal approximation it stays inside [0, 1] and is sensible at 0/n and n/n."""
    if total <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= total:
        raise ValueError(f"successes must be in 0..{total}, got {successes}")
    p = successes / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_indices(units: int, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
                      ) -> np.ndarray:
    """``[resamples, units]`` unit indices drawn with replacement (numpy PCG64, ``seed``)."""
    if units < 1:
        raise ValueError("bootstrap needs at least one unit")
    return np.random.default_rng(seed).integers(0, units, size=(resamples, units))


def percentile_interval(samples: np.ndarray) -> list[float]:
    """The central 95% of bootstrap ``samples`` (NaNs ignored) as ``[low, high]``."""
    lo, hi = np.nanpercentile(np.asarray(samples, dtype=np.float64), [2.5, 97.5])
    return [float(lo), float(hi)]


def paired_difference(value: float, reference: float, samples: np.ndarray,
                      reference_samples: np.ndarray) -> dict:
    """``value - reference`` with the paired bootstrap interval of the per-resample differences.

    ``distinguishable`` is false (and ``verdict`` says "not distinguishable") when the interval
    contains 0."""
    ci = percentile_interval(np.asarray(samples) - np.asarray(reference_samples))
    same = ci[0] <= 0.0 <= ci[1]
    return {"diff": float(value - reference), "ci95": ci, "distinguishable": not same,
            "verdict": "not distinguishable" if same else
            ("higher" if value > reference else "lower")}
