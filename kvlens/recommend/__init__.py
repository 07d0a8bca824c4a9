"""``kvlens recommend``: a per-layer KV quantization config under a memory budget.
docs/internals/architecture.md (layer 10) lists its modules; import the public names from here.
"""

from kvlens.recommend.allocation import COST_RESOLUTION, allocate
from kvlens.recommend.build import build_config
from kvlens.recommend.catalog import candidates, family, family_probes
from kvlens.recommend.extension import CandidateExtension, Twin, TwinMeasurer, register
from kvlens.recommend.options import (
    DEFAULT_WINDOWS,
    Candidate,
    RecommendOptions,
    Stream,
    default_tokens,
)
from kvlens.recommend.pipeline import Measurements, choose, measure
from kvlens.recommend.pricing import option_bytes
from kvlens.recommend.result import Choice, Recommendation
from kvlens.recommend.run import check, measurement, recommend
from kvlens.recommend.search import BudgetSearch, kld_scorer, search_budget

__all__ = [
    "COST_RESOLUTION",
    "BudgetSearch",
    "DEFAULT_WINDOWS",
    "Candidate",
    "CandidateExtension",
    "Choice",
    "Measurements",
    "Recommendation",
    "RecommendOptions",
    "Stream",
    "Twin",
    "TwinMeasurer",
    "allocate",
    "build_config",
    "candidates",
    "check",
    "choose",
    "default_tokens",
    "family",
    "family_probes",
    "kld_scorer",
    "measure",
    "measurement",
    "option_bytes",
    "recommend",
    "register",
    "search_budget",
]
