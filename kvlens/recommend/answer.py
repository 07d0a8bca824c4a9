"""Everything ``kvlens recommend`` does for the per-layer target, as one call:
``recommend_layers``: one measurement (``kvlens.recommend.run.measurement``), then one budget,
several (one config each, ``NAME-<B>b``) or the smallest under ``max_kld``
(``kvlens.recommend.search``), optionally validated beside the presets, with the result
documents (``--json``, ``kvlens report``). Writing files and rendering are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvlens.capture.source import CaptureModel
from kvlens.config import KVConfig, preset, validate_for
from kvlens.errors import ConfigError, OptionError
from kvlens.evaluation import EvalOptions, evaluate_configs
from kvlens.model.architecture import describe
from kvlens.recommend.options import RecommendOptions
from kvlens.recommend.pipeline import LogFn, ProgressFn, choose
from kvlens.recommend.pricing import COMPARED_PRESETS
from kvlens.recommend.profile import Profile, profiling, stage
from kvlens.recommend.result import Recommendation
from kvlens.recommend.run import measurement
from kvlens.recommend.search import BudgetSearch, kld_scorer, search_budget


@dataclass
class LayerAnswer:
    """What ``recommend_layers`` found: the recommendation(s) (one per budget, or the one the
    search chose), the search, the validation (``kvlens.evaluation.evaluate_configs``'s report
    and its options) and one result document per recommendation; ``predicted``: each
    measured stage's predicted seconds (None: the measurement was reused); ``model``: the
    model validation and the search score on (loaded once, when first needed); ``files``:
    other files to write beside the configs (path -> a config, or a file's text)."""

    recommendations: list[Recommendation]
    documents: list[dict]
    search: BudgetSearch | None = None
    validation: dict | None = None
    predicted: dict[str, float] | None = None
    model: CaptureModel | None = None
    files: dict[Path, KVConfig | str] = field(default_factory=dict)


def budget_list(budgets: str | None, budget_bits: float | None, max_kld: float | None,
                output) -> list[float]:
    """``budgets`` (a comma list, ``--budgets``) as numbers, empty when not given, and the rule
    of the per-layer target: exactly one of a budget, several budgets and ``max_kld``."""
    given = [flag for flag, v in (("--budget-bits", budget_bits), ("--budgets", budgets),
                                  ("--max-kld", max_kld)) if v is not None]
    if len(given) != 1:
        raise OptionError("{target} kvlens takes one of {budget_bits} B (one config), {budgets} "
                         "B1,B2,... (one config each) and {max_kld} X (the smallest budget "
                         "whose config's measured KLD is at most X)"
                         + (f"; got {' and '.join(given)}." if given else "."))
    if budgets is None:
        return []
    try:
        values = sorted({float(x) for x in budgets.split(",") if x.strip()})
    except ValueError:
        raise OptionError(f"Invalid {{budgets}} {budgets!r}; expected a comma list of bit "
                         "budgets, e.g. 2.5,3,4.") from None
    if not values or any(not 0 < v <= 16 for v in values):
        raise OptionError(f"{{budgets}} {budgets}: each budget must be in (0, 16].")
    if output is None and len(values) > 1:
        raise OptionError("{budgets} writes one config per budget: give {output} (the configs "
                         "are named NAME-<B>b.json beside it).")
    return values


def output_for(output: Path, budget: float) -> Path:
    """Where several budgets write the config of ``budget``: ``kv.json`` -> ``kv-2.5b.json``."""
    return output.with_name(f"{output.stem}-{budget:g}b{output.suffix}")


def recommend_layers(capture: str | Path, opts: RecommendOptions, *,
                     budgets: list[float] | tuple[float, ...] = (), max_kld: float | None = None,
                     validate: bool = False, eval_tokens: int | None = None,
                     retrieval_prompts: int = 0, model: str | None = None,
                     place: dict | None = None, remeasure: bool = False,
                     outputs: list[Path] | tuple[Path, ...] = (),
                     save: Callable[[Recommendation, Path], None] | None = None,
                     progress: ProgressFn | None = None, log: LogFn | None = None
                     ) -> LayerAnswer:
    """The per-layer recommendation(s) for ``opts`` on ``capture``: at ``opts.budget_bits``,
    at each of ``budgets``, or the smallest budget meeting ``max_kld``; ``validate`` scores
    them and the presets against the exact model (``eval_tokens`` held-out tokens, a retrieval
    grid of ``retrieval_prompts`` prompts when > 0). ``outputs``: where the caller writes each
    config; ``save(rec, output)`` is called as soon as it is chosen, before any validation.
    ``log`` receives what to tell the user."""
    say = log or (lambda _msg: None)
    capture = Path(capture)
    measured, predicted = measurement(capture, opts, progress, remeasure=remeasure, log=say)
    loaded = CaptureModel(capture, model, dict(place or {}) | {"dtype": opts.dtype}, say,
                          " for the held-out scoring")
    search = None
    if max_kld is not None:
        search = _search(measured, opts, max_kld, loaded, eval_tokens, say)
        recs = [search.chosen]
    else:
        several = len(budgets) > 1
        recs = [choose(measured, replace(opts, budget_bits=b, **(
            {"name": f"{opts.name}-{b:g}b"} if several else {})))
            for b in (budgets or [opts.budget_bits])]
    for rec in recs:
        rec.predicted = predicted
    for rec, out in zip(recs, outputs if save is not None else ()):
        save(rec, out)
    validation = None
    if validate:
        with profiling(recs[0].profile), stage("validation"):
            validation = validate_configs([r.config for r in recs], loaded, eval_tokens,
                                          retrieval_prompts, say)
    docs = [_document(rec, out, search, validation)
            for rec, out in zip(recs, list(outputs) or [None] * len(recs))]
    return LayerAnswer(recs, docs, search, validation, predicted, loaded)


def _search(measured, opts, max_kld: float, loaded: CaptureModel, eval_tokens, say: LogFn):
    """``search_budget`` scored on the loaded model; its allocations and KLD runs join the
    chosen recommendation's profile."""
    searched = Profile()
    with profiling(searched), stage("budget search"):
        mdl, tok = loaded.get()
        found = search_budget(measured, opts, max_kld, kld_scorer(mdl, tok, eval_tokens),
                              log=lambda msg: say(f"  {msg}"))
    found.chosen.profile.merge(searched)
    return found


def validate_configs(configs: list, loaded: CaptureModel, eval_tokens: int | None,
                     retrieval_prompts: int, say: LogFn) -> dict:
    """The recommendation(s) and the presets that fit the model, scored against the exact
    model on the held-out text (nothing `recommend` calibrates on)."""
    mdl, tok = loaded.get()
    say(f"Validating on {loaded.spec() or 'the capture model'} ...")
    shape = describe(mdl)
    for config in configs:
        validate_for(config, shape)
    configs = list(configs)
    for name in COMPARED_PRESETS:
        try:
            validate_for(preset(name), shape)
        except ConfigError as exc:  # e.g. G=32 presets on a head_dim-16 model
            say(f"  skipping preset {name}: {exc}")
            continue
        configs.append(preset(name))
    evals = ("kld", "retrieval") if retrieval_prompts else ("kld",)
    opts = EvalOptions(evals=evals, eval_tokens=eval_tokens,
                       retrieval_prompts=max(retrieval_prompts, 1), retrieval_lengths=(1024,))
    report = evaluate_configs(mdl, tok, configs, opts, progress=lambda msg: say(f"  {msg}"))
    return {**report, "options": opts}


def _document(rec: Recommendation, out: Path | None, search, validation) -> dict:
    """The result document of one recommendation (``--json``; ``kvlens report`` reads it)."""
    doc = rec.to_dict()
    doc["deploy"] = {"target": "kvlens", "command": "kvlens generate --config "
                     f"{out or 'kv.json'} --prompt ...", "config": str(out) if out else None}
    if search is not None:
        doc["search"] = search.to_dict()
    if validation is not None:
        doc["validation"] = validation["results"]
        doc["validation_evaluation"] = validation["evaluation"]
    return doc
