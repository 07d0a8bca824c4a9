"""The one call behind ``kvlens recommend``: ``recommend_run(request)`` checks a
``RecommendRequest`` before any work, measures, chooses (per layer: ``kvlens.recommend.answer``;
an engine: ``kvlens.deploy.targets``), validates and returns the answer with its result
documents (writing files and rendering are the caller's); ``request_for`` builds the request
from a command line's options.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvlens.analysis.compare.config import parse_int_list
from kvlens.capture.source import CaptureModel
from kvlens.capture.store import open_capture
from kvlens.deploy import hf_cache
from kvlens.deploy.exports import MODELOPT_FILE, export_path
from kvlens.deploy.plans import (
    FILE_ENGINES,
    engine_exports,
    layer_exports,
    measure_layer_exports,
)
from kvlens.deploy.targets import (
    TargetOptions,
    TargetRecommendation,
    canonical_target,
    measure_kld,
    recommend_target,
)
from kvlens.deploy.targets import validate as validate_target
from kvlens.errors import OptionError
from kvlens.evaluation.kld import max_positions
from kvlens.model.load import check_load_options, parse_dtype
from kvlens.model.placement import make_placement
from kvlens.recommend import RecommendOptions, check
from kvlens.recommend.answer import LayerAnswer, budget_list, output_for, recommend_layers
from kvlens.recommend.extension import fold_levers, lever_fields

LogFn = Callable[[str], None]


@dataclass(frozen=True)
class RecommendRequest:
    """What ``kvlens recommend`` is asked. ``options``: the fields given of
    ``RecommendOptions`` (target ``kvlens``) or ``TargetOptions``; ``budgets``: several budgets
    from one measurement; ``max_kld``: the smallest budget (an engine: the cheapest setting)
    whose KLD is at most this; ``place``: ``load_model``'s placement of the model
    ``--max-kld`` and validation load; ``outputs``: where each config is written."""

    capture: Path
    target: str = "kvlens"
    options: dict[str, Any] = field(default_factory=dict)
    budgets: tuple[float, ...] = ()
    max_kld: float | None = None
    validate: bool = False
    eval_tokens: int | None = None
    retrieval_prompts: int = 0
    tokens: int | None = None
    model: str | None = None
    place: dict[str, Any] = field(default_factory=dict)
    remeasure: bool = False
    outputs: tuple[Path, ...] = ()


@dataclass
class EngineAnswer:
    """An engine target's answer: the recommendation, its validation and its document."""

    recommendation: TargetRecommendation
    validation: dict | None
    document: dict


PER_LAYER, ENGINE = "kvlens", "engine"  # the per-layer target, and any engine target
PLACEMENT = ("dtype", "device_map", "max_memory", "offload_folder")
#: The targets that read each option ``request_for`` takes that is not a field of the target's
#: options (``RecommendOptions``, ``TargetOptions``) of the same name (``readers``).
REQUEST_READERS = {
    **dict.fromkeys(("max_kld", "validate", "eval_tokens", "output", *PLACEMENT),
                    frozenset({PER_LAYER, ENGINE})),
    **dict.fromkeys(("budgets", "retrieval_prompts", "remeasure"),
                    frozenset({PER_LAYER})),
}
#: the request's own fields ``request_for`` fills from the options given
REQUEST_FIELDS = ("max_kld", "validate", "eval_tokens", "retrieval_prompts", "tokens", "model",
                  "remeasure")


def readers(name: str) -> frozenset[str]:
    """The targets that read option (or ``--set`` lever field) ``name``: ``PER_LAYER`` for a
    ``RecommendOptions`` or extension lever field, ``ENGINE`` for a ``TargetOptions`` field,
    else ``REQUEST_READERS`` (empty: neither)."""
    if name in REQUEST_READERS:
        return REQUEST_READERS[name]
    per_layer = name in _fields(RecommendOptions) or name in lever_fields()
    return frozenset({PER_LAYER} if per_layer else ()) | \
        frozenset({ENGINE} if name in _fields(TargetOptions) else ())


def _fields(cls) -> set[str]:
    return {f.name for f in fields(cls)} - {"target"}


def request_for(capture: str | Path, target: str = "kvlens", given: dict[str, Any] | None = None,
                levers: dict[str, Any] | None = None) -> RecommendRequest:
    """The request a command line makes. ``given``: the options given, by ``kvlens
    recommend``'s parameter names (``windows`` and ``budgets`` as comma lists, ``output`` the
    config's path); ``levers``: the target's research levers
    (``kvlens.research.parse_settings``). The per-layer target takes exactly one of
    ``budget_bits``, ``budgets`` and ``max_kld`` (``budget_list``)."""
    target, given = canonical_target(target), dict(given or {})
    engine = target != "kvlens"
    unread = sorted(k for k in given if (ENGINE if engine else PER_LAYER) not in readers(k))
    if unread:
        raise TypeError(f"request_for: --target {target} reads no {unread}")
    names = _fields(TargetOptions) if engine else _fields(RecommendOptions) | set(lever_fields())
    output = given.pop("output", None)
    budgets = [] if engine else budget_list(given.pop("budgets", None),
                                            given.get("budget_bits"), given.get("max_kld"),
                                            output)
    outputs = [] if output is None else [output_for(output, b) for b in budgets] \
        if budgets else [output]
    if given.get("offload_folder") is not None:
        given["offload_folder"] = str(given["offload_folder"])
    place = {k: given.get(k) for k in PLACEMENT[1:]} | (
        {"dtype": given["dtype"]} if given.get("dtype") else {})
    options = {k: v for k, v in given.items() if k in names and k not in ("max_kld", "eval_tokens")}
    if not engine:
        if isinstance(options.get("windows"), str):
            options["windows"] = parse_int_list(options["windows"], "--windows")
        # the measurement does not read the budget: --budgets and --max-kld allocate later
        options["budget_bits"] = given.get("budget_bits") or min(budgets, default=16.0)
    own = {k: given[k] for k in REQUEST_FIELDS if k in given}
    return RecommendRequest(Path(capture), target, options | dict(levers or {}),
                            budgets=tuple(budgets), place=place, outputs=tuple(outputs), **own)


#: the file an engine target writes beside its config
BESIDE = {"vllm": "kv_scales.json", "vllm:cpu": "kv_scales.json", "sglang": "kv_scales.json",
          "trtllm": "hf_quant_config.json", "transformers": hf_cache.FILE_NAME}


def files_beside(out: Path, target: str) -> list[Path]:
    """The files a recommendation written to ``out`` may write beside it (its result document
    aside): an engine target's ``BESIDE`` file, the per-layer target's transformers export and
    the configs its engine exports run (``kvlens.deploy.exports.export_path``)."""
    if target == "kvlens":
        return [export_path(out, name) for name in (
            hf_cache.FILE_NAME, *(f"{e}.json" for e in FILE_ENGINES), MODELOPT_FILE)]
    return [out.parent / BESIDE[target]] if target in BESIDE else []


def check_request(request: RecommendRequest) -> None:
    """What can be refused before any work, cheapest first: a missing, foreign or incomplete
    capture, the per-layer target's ``tokens`` beyond its samples (they would be cut short
    without a word), then the model (``--model``: every check ``load_model`` makes before it
    reads a weight) and its placement."""
    with open_capture(request.capture) as cap:
        n = cap.meta.num_tokens
    if request.target == "kvlens" and request.tokens is not None and request.tokens > n:
        raise OptionError(f"{{tokens}} {request.tokens}: {request.capture} holds {n} tokens per "
                          f"sample; give at most {n} (or omit it).")
    place = request.place
    if request.model is not None:
        check_load_options(request.model, device="cpu", **place)
        return
    if place.get("dtype"):
        parse_dtype(place["dtype"])
    make_placement(place.get("device_map"), place.get("max_memory"),
                   place.get("offload_folder"))


def recommend_run(request: RecommendRequest, *, save: Callable | None = None,
                  progress=None, log: LogFn | None = None) -> LayerAnswer | EngineAnswer:
    """Answer ``request`` (a ``LayerAnswer`` or an ``EngineAnswer``). ``save(rec, output)`` is
    called for each config as soon as it is chosen; ``progress(done, total, what)`` follows the
    measurement; ``log`` receives the messages for the user."""
    say = log or (lambda _msg: None)
    check_request(request)
    if request.target != "kvlens":
        return _engine(request, save, progress, say)
    opts = RecommendOptions(**fold_levers(request.options))
    check(request.capture, opts)
    answer = recommend_layers(request.capture, opts, budgets=request.budgets,
                              max_kld=request.max_kld, validate=request.validate,
                              eval_tokens=request.eval_tokens,
                              retrieval_prompts=request.retrieval_prompts, model=request.model,
                              place=request.place, remeasure=request.remeasure,
                              outputs=request.outputs, save=save, progress=progress, log=say)
    _layer_exports(request, answer, say)
    return answer


def _layer_exports(request: RecommendRequest, answer: LayerAnswer, say: LogFn) -> None:
    """The engines' forms of each config (``kvlens.deploy.plans.layer_exports``), the configs
    they run written beside it (``answer.files``); with validation, each distinct one measured
    on the validation's model and held-out tokens, else the command that measures it."""
    with open_capture(request.capture) as cap:
        shape = cap.meta.shape
    spec = answer.model.spec() if answer.model is not None else request.model
    # the tokens the chosen configs were measured on (none: not validated, or interrupted)
    scored = (answer.validation or {}).get("evaluation", {}).get("kld")
    tokens = request.eval_tokens if scored is None else scored["tokens"]
    flags = "".join(f" --{k} {shlex.quote(str(v))}" for k, v in (
        ("model", spec or "MODEL"), ("dtype", request.place.get("dtype"))) if v) + \
        (f" --eval-tokens {tokens}" if tokens else "")
    made = []
    outputs = list(request.outputs) or [None] * len(answer.recommendations)
    for rec, doc, out in zip(answer.recommendations, answer.documents, outputs):
        ex = layer_exports(rec.config, shape, rec.context, out,
                           lambda item: f"kvlens generate{flags} --compare {shlex.quote(item)} "
                           "--eval kld")
        doc["exports"] = ex.documents
        answer.files.update(ex.files)
        made.append(ex)
    if scored is not None:
        say("Measuring what each engine runs of the config ...")
        measure_layer_exports(made, lambda cfgs: measure_kld(
            answer.model.get(), cfgs, tokens, lambda m: say(f"  {m}")))


def _engine(request: RecommendRequest, save, progress, say: LogFn) -> EngineAnswer:
    given = {k: v for k, v in (("max_kld", request.max_kld), ("eval_tokens", request.eval_tokens))
             if v is not None}
    opts = TargetOptions(target=request.target, **(request.options | given))
    # the model, loaded once, before any measurement: a model that cannot load fails first
    loaded = CaptureModel(request.capture, opts.model or request.model, request.place, say)
    if opts.max_kld is not None or request.validate:
        mdl = loaded.get()[0]
        if request.eval_tokens is None:  # the default, capped by the model's context
            opts = replace(opts, eval_tokens=min(opts.eval_tokens,
                                                 max_positions(mdl) or opts.eval_tokens))
    rec = recommend_target(request.capture, opts, progress=progress or (lambda *_: None),
                           log=lambda m: say(f"  {m}"),
                           model_bundle=loaded.get() if opts.max_kld is not None else None)
    # the per-layer exports (kvlens.deploy.plans): what each engine runs of the choice,
    # their files written with the config; the choice measured by --max-kld, what an engine
    # runs instead measured below when validating
    rec.chosen.deploy["exports"] = engine_exports(rec, rec.measured_kld)
    if save is not None and request.outputs:
        save(rec, request.outputs[0])
    validation = None
    if request.validate:
        validation = validate_target(rec, loaded.get(), opts.eval_tokens,
                                     lambda m: say(f"  {m}"))
        rec.chosen.deploy["exports"] = engine_exports(
            rec, validation, lambda cfgs: measure_kld(loaded.get(), cfgs, opts.eval_tokens))
    doc = rec.to_dict()
    doc["files"] = rec.files
    if validation is not None:
        doc["validation"] = validation
    return EngineAnswer(rec, validation, doc)
