"""An engine target's ``--max-kld`` choice: the cheapest setting whose KLD is at most the
bound, with the chosen setting's KLD measured, never only predicted.

1. **Anchors**: ``anchors`` settings of the front spread over ``log S`` are measured on the
   held-out text and ``KLD = c * S^alpha`` is fitted to them (``kvlens.deploy.kld_model``).
2. **Choice**: the cheapest setting (within ``budget_bits`` when given) whose *known* KLD is at
   most the bound: its measured KLD when it was measured, else the predicted one.
3. **Check**: a choice that was not measured is measured (it becomes an anchor), the predictor
   is refitted on every measurement and step 2 runs again, until the choice is a measured
   setting (its measured KLD is then within the bound). No setting is measured twice.
4. **Nothing within**: when no setting's known KLD is within the bound, ``ConfigError``; after
   ``checks`` checks without a measured choice, the cheapest measured setting within the bound
   is the answer (a note names the cheaper, unchecked prediction), or ``ConfigError`` when no
   measured setting is within it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlens.deploy.kld_model import KLDModel, fit_kld_model
from kvlens.errors import ConfigError

#: settings measured after the anchors, at most, before the search stops (step 4)
MAX_CHECKS = 4
ANCHOR, CHECK = "anchor", "check"  # why a setting was measured


@dataclass
class KLDChoice:
    """The search's answer: ``chosen`` (a front candidate, measured), the predictor fitted on
    every measurement, the measurements in the order they were taken (setting -> measure_kld's
    dict with ``score``, ``role`` (``ANCHOR`` or ``CHECK``) and, for a check, the
    ``predicted_kld`` that chose it before it was measured) and notes for the answer."""

    chosen: Any
    model: KLDModel
    measured: dict[str, dict]
    notes: list[str] = field(default_factory=list)


def spread_anchors(front: Sequence, n: int) -> list:
    """Up to ``n`` candidates of the front spread over ``log S`` (scores > 0)."""
    pos = sorted((c for c in front if c.score > 0), key=lambda c: c.score)
    if len(pos) <= n:
        return pos
    lo, hi = math.log(pos[0].score), math.log(pos[-1].score)
    picks = []
    for j in range(n):
        want = lo + (hi - lo) * j / max(n - 1, 1)
        best = min(pos, key=lambda c: abs(math.log(c.score) - want))
        if best not in picks:
            picks.append(best)
    return picks


def known_kld(cand, model: KLDModel, measured: dict[str, dict]) -> tuple[float, str]:
    """``(KLD, "measured" | "predicted")`` of a candidate: measured where it was."""
    if cand.setting in measured:
        return measured[cand.setting]["mean_kld"], "measured"
    return model.predict(cand.score), "predicted"


def _fits(cand, kld: float, opts) -> bool:
    """Within the bound, and within ``budget_bits`` when given."""
    return kld <= opts.max_kld and (opts.budget_bits is None or cand.bits <= opts.budget_bits)


def choose_within(front: Sequence, opts, model: KLDModel, measured: dict[str, dict]):
    """Step 2 (module docstring), then the lowest ``S``; ``ConfigError`` when none fits."""
    ok = [c for c in front if _fits(c, known_kld(c, model, measured)[0], opts)]
    if not ok:
        best = min(front, key=lambda c: c.score)
        kld, how = known_kld(best, model, measured)
        raise ConfigError(f"No {opts.target} setting is predicted or measured under KLD "
                          f"{opts.max_kld}: the most accurate, {best.setting} ({best.bits:.2f} "
                          f"bits), is {how} at {kld:.4g}; raise {{max_kld}}.")
    return min(ok, key=lambda c: (c.bits, c.score))


def search_kld(front: Sequence, opts, measure: Callable[[list], list[dict]],
               log: Callable[[str], None] = lambda m: None, checks: int = MAX_CHECKS
               ) -> KLDChoice:
    """The ``--max-kld`` choice over ``front`` (module docstring). ``opts``: ``max_kld``,
    ``budget_bits``, ``anchors``, ``eval_tokens``, ``target``; ``measure(candidates)``: their
    KLD measurements (``kvlens.deploy.targets.measure_kld``'s dicts), in order."""
    measured: dict[str, dict] = {}

    def take(cands: list, role: str, predicted: float | None = None) -> None:
        for c, got in zip(cands, measure(cands)):  # none of them measured before
            measured[c.setting] = dict(got, score=c.score, role=role, predicted_kld=predicted,
                                       eval_tokens=opts.eval_tokens)

    picks = spread_anchors(front, opts.anchors)
    log(f"KLD anchors ({opts.eval_tokens} tokens): {', '.join(c.setting for c in picks)}")
    take(picks, ANCHOR)
    for done in range(checks + 1):
        model = fit_kld_model([(m["score"], m["mean_kld"]) for m in measured.values()])
        choice = choose_within(front, opts, model, measured)
        if choice.setting in measured:
            return KLDChoice(choice, model, measured)
        if done == checks:
            break
        predicted = model.predict(choice.score)
        log(f"KLD check {done + 1}/{checks}: {choice.setting} ({choice.bits:.3f} bits) is "
            f"predicted at {predicted:.4f} <= {opts.max_kld:g}; measuring it")
        take([choice], CHECK, predicted)
        got = measured[choice.setting]["mean_kld"]
        log(f"  {choice.setting}: measured KLD {got:.4f}, "
            + ("within the bound" if got <= opts.max_kld else "over the bound: refitting"))
    return _capped(front, opts, model, measured, choice, checks)


def _capped(front, opts, model: KLDModel, measured: dict[str, dict], unchecked, checks: int
            ) -> KLDChoice:
    """Step 4 after ``checks`` checks (module docstring); ``unchecked``: the choice left."""
    pred = model.predict(unchecked.score)
    ok = [c for c in front if c.setting in measured
          and _fits(c, measured[c.setting]["mean_kld"], opts)]
    if not ok:
        tried = ", ".join(f"{s} {m['mean_kld']:.4g}" for s, m in measured.items())
        raise ConfigError(f"No {opts.target} setting is measured under KLD {opts.max_kld} after "
                          f"{checks} checks of the predictor (measured: {tried}); the next "
                          f"choice, {unchecked.setting}, is predicted at {pred:.4g} but the "
                          "predictor has fallen short of the measurements. Raise {max_kld}.")
    chosen = min(ok, key=lambda c: (c.bits, c.score))
    note = (f"--max-kld stopped after {checks} checks: {chosen.setting} is the cheapest setting "
            f"measured within {opts.max_kld:g}; {unchecked.setting} ({unchecked.bits:.3f} bits) "
            f"is predicted within it ({pred:.4g}) but was not measured")
    return KLDChoice(chosen, model, measured, [note])
