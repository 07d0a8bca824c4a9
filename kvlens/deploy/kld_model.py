"""Predicted KL divergence from the capture's error model: ``KLD = c * S^alpha``.

``S`` is a setting's error score: the sum over layers of ``e_K^2 + e_V^2``, the squared relative
attention-output errors of its keys and values on the capture (``kvlens.deploy.targets``). A
small logit perturbation costs KLD quadratically and each layer's error moves the logits about
linearly, so independent errors add as squares; ``alpha`` absorbs what that misses. ``c`` and
``alpha`` are fitted per model on settings whose KLD was measured (one point: ``alpha = 1``),
for the protocol those were measured with (text, ``--eval-tokens``, chunk).

A prediction passes through every measured setting: the fit times the measured-to-fitted ratio
interpolated linearly in ``log S`` between the measured settings on either side (the nearest
one's ratio beyond the ends). One power law over the whole front misses where it bends, and the
``--max-kld`` search (``kvlens.deploy.kld_search``) then creeps towards the bound one setting
at a time; the ratio carries what each measurement taught to its neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvlens.errors import InputError


@dataclass(frozen=True)
class KLDModel:
    """``fitted(S) = c * S^alpha``; ``predict(S)``: the fit through ``points``, the
    ``(S, KLD)`` pairs it was fitted on (module docstring)."""

    c: float
    alpha: float
    points: tuple[tuple[float, float], ...] = ()

    def fitted(self, score: float) -> float:
        return 0.0 if score <= 0 else self.c * score ** self.alpha

    def predict(self, score: float) -> float:
        return 0.0 if score <= 0 else self.fitted(score) * math.exp(
            self._log_ratio(math.log(score)))

    def _log_ratio(self, x: float) -> float:
        """``log(measured / fitted)`` at ``log S = x``, interpolated between the points (the
        mean where several share one ``S``)."""
        by_x: dict[float, list[float]] = {}
        for s, k in self.points:
            by_x.setdefault(math.log(s), []).append(math.log(k / self.fitted(s)))
        pts = sorted((px, sum(r) / len(r)) for px, r in by_x.items())
        if not pts:
            return 0.0
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    @property
    def log_rmse(self) -> float:
        """Root-mean-square residual of the fit in natural-log units (0 = exact)."""
        if not self.points:
            return 0.0
        r = [math.log(k) - math.log(self.fitted(s)) for s, k in self.points]
        return math.sqrt(sum(x * x for x in r) / len(r))

    def to_dict(self) -> dict:
        return {"form": "kld = c * S^alpha, S = sum over layers of e_K^2 + e_V^2, times the "
                        "measured/fitted ratio interpolated in log S between the points",
                "c": self.c, "alpha": self.alpha, "log_rmse": self.log_rmse,
                "points": [{"score": s, "kld": k} for s, k in self.points]}


def fit_kld_model(points: Sequence[tuple[float, float]]) -> KLDModel:
    """Least-squares fit of ``log KLD = log c + alpha log S`` over the points with ``S > 0`` and
    ``KLD > 0``; one usable point fixes ``alpha = 1``."""
    pts = [(float(s), float(k)) for s, k in points if s > 0 and k > 0]
    if not pts:
        raise InputError("Cannot fit the KLD model: no setting with a positive error score and "
                         "a positive measured KLD.")
    xs = [math.log(s) for s, _ in pts]
    ys = [math.log(k) for _, k in pts]
    n = len(pts)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n == 1 or sxx < 1e-12:
        alpha = 1.0
    else:
        alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    c = math.exp(my - alpha * mx)
    return KLDModel(c, alpha, tuple(pts))
