"""``kvlens recommend``: a per-layer KV quantization config under a memory budget.

Modules, in dependency order: ``options`` (what is asked, ``Candidate``, ``Stream``),
``candidates`` (what is offered, storage families), ``pricing`` (bytes held and read),
``measure`` (errors per layer), ``probe`` (the model and the retrieval probe),
``sensitivity`` (layer weights), ``result``, ``build`` (the config), ``allocate`` (the
knapsack), ``pipeline`` (``measure`` a capture once, ``choose`` for any budget).

Import the public names from here (``from kvlens.recommend import measure``). Three of them
share a module's name (``candidates``, ``measure``, ``allocate``): as attributes of this package
they are the functions; reach those modules' other names with ``from kvlens.recommend.measure
import measure_layer``.
"""

from kvlens.recommend.allocate import COST_RESOLUTION, allocate
from kvlens.recommend.build import build_config
from kvlens.recommend.candidates import candidates, family, family_probes, gear_settings
from kvlens.recommend.options import (
    DEFAULT_WINDOWS,
    Candidate,
    RecommendOptions,
    Stream,
    default_tokens,
)
from kvlens.recommend.pipeline import Measurements, choose, measure, recommend
from kvlens.recommend.pricing import option_bytes
from kvlens.recommend.probe import model_spec_from_capture
from kvlens.recommend.result import Choice, Recommendation

__all__ = [
    "COST_RESOLUTION",
    "DEFAULT_WINDOWS",
    "Candidate",
    "Choice",
    "Measurements",
    "Recommendation",
    "RecommendOptions",
    "Stream",
    "allocate",
    "build_config",
    "candidates",
    "choose",
    "default_tokens",
    "family",
    "family_probes",
    "gear_settings",
    "measure",
    "model_spec_from_capture",
    "option_bytes",
    "recommend",
]
