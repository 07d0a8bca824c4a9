"""The smallest budget whose config loses at most a given KL divergence (``recommend
--max-kld``, per-layer target). The measurement does not depend on the budget, so each budget
tried only allocates (``choose``) and scores its config against the exact model (a ``Scorer``).
Budgets lie on a grid of ``RESOLUTION`` bits: the largest first (if even it misses, the search
stops and says so), then a bisection, which assumes the KLD falls as the budget grows (every
budget tried is reported). Two budgets that allocate the same config are scored once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvlens.config import KVConfig
from kvlens.errors import InputError
from kvlens.evaluation import EvalOptions, evaluate_configs
from kvlens.recommend.allocation import cheapest_bits
from kvlens.recommend.options import RecommendOptions
from kvlens.recommend.pipeline import LogFn, Measurements, choose
from kvlens.recommend.result import Recommendation

#: bits between the budgets tried
RESOLUTION = 0.25
#: a scorer: a config -> its ``kvlens.evaluation`` KLD document (``mean_kld`` {value, ci95}...)
Scorer = Callable[[KVConfig], dict]


@dataclass
class BudgetStep:
    """One budget tried: what its config holds and what it lost."""

    budget_bits: float
    mean_bits: float
    kld: dict  # the config's KLD document (kvlens.evaluation.summarize_kld)

    @property
    def mean_kld(self) -> float:
        return self.kld["mean_kld"]["value"]

    def to_dict(self) -> dict:
        return {"budget_bits": self.budget_bits, "mean_bits": self.mean_bits,
                "mean_kld": self.mean_kld, "ci95": self.kld["mean_kld"]["ci95"],
                "top1_agreement": self.kld["top1_agreement"]["value"],
                "ppl_change": self.kld["ppl_change"]["value"]}


@dataclass
class BudgetSearch:
    """The budgets tried (in order) and the recommendation at the smallest one that met
    ``max_kld``."""

    max_kld: float
    chosen: Recommendation
    steps: list[BudgetStep] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"max_kld": self.max_kld, "resolution_bits": RESOLUTION,
                "chosen_budget_bits": self.chosen.budget_bits,
                "steps": [s.to_dict() for s in self.steps]}


def budget_grid(m: Measurements, opts: RecommendOptions) -> list[float]:
    """The budgets the search may try, ascending: multiples of ``RESOLUTION`` from what the
    cheapest candidates need to what the allocation holds with no budget limit."""
    low = cheapest_bits(m.meta, opts)
    high = choose(m, replace(opts, budget_bits=16.0)).mean_bits
    first = math.ceil(low / RESOLUTION - 1e-9)
    last = max(first, math.ceil(high / RESOLUTION - 1e-9))
    return [min(16.0, i * RESOLUTION) for i in range(first, last + 1)]


def search_budget(m: Measurements, opts: RecommendOptions, max_kld: float, score: Scorer,
                  log: LogFn = lambda msg: None) -> BudgetSearch:
    """The smallest budget on ``budget_grid`` whose config's measured mean KLD (``score``) is
    at most ``max_kld`` (module doc), or ``InputError`` when even the largest misses it."""
    if not max_kld > 0:
        raise InputError(f"{{max_kld}} must be positive, got {max_kld}.")
    grid = budget_grid(m, opts)
    steps: list[BudgetStep] = []
    scored: dict[str, dict] = {}

    def attempt(budget: float) -> tuple[Recommendation | None, float]:
        try:
            rec = choose(m, replace(opts, budget_bits=budget))
        except InputError:  # the measured candidates need more than the priced cheapest
            return None, math.inf
        key = json.dumps(rec.config.to_dict(), sort_keys=True)
        if key not in scored:
            log(f"budget {budget:g} bits: scoring its config ({rec.mean_bits:.3f} bits held)")
            scored[key] = score(rec.config)
        steps.append(BudgetStep(budget, rec.mean_bits, scored[key]))
        log(f"budget {budget:g} bits: mean KLD {steps[-1].mean_kld:.4f} (target {max_kld:g})")
        return rec, steps[-1].mean_kld

    best, kld = attempt(grid[-1])
    if best is None or kld > max_kld:
        raise InputError(f"Even the largest useful budget, {grid[-1]:g} bits (every layer at "
                         f"its best candidate), loses KLD {kld:.4f} > {{max_kld}} {max_kld:g} on "
                         "the held-out text; raise {max_kld}, or use an engine target or a "
                         "16-bit cache.")
    low, high = 0, len(grid) - 1
    while low < high:
        mid = (low + high) // 2
        rec, kld = attempt(grid[mid])
        if rec is not None and kld <= max_kld:
            high, best = mid, rec
        else:
            low = mid + 1
    return BudgetSearch(max_kld, best, steps)


def kld_scorer(model, tokenizer, eval_tokens: int | None = None) -> Scorer:
    """A ``Scorer``: ``kvlens.evaluation``'s lockstep KLD of a config against the exact
    ``model`` on ``eval_tokens`` of the built-in held-out text (None: the evaluation default,
    capped by the model's context)."""
    options = EvalOptions(evals=("kld",), eval_tokens=eval_tokens)

    def score(config: KVConfig) -> dict:
        report = evaluate_configs(model, tokenizer, [config], options)
        if report["interrupted"]:
            raise KeyboardInterrupt
        return report["results"][0]["kld"]

    return score
