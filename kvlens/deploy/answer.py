"""The one call behind ``kvlens recommend``: ``recommend_run(request)``.

A ``RecommendRequest`` says what is asked: the capture, the target (``kvlens``: a per-layer
config, ``kvlens.recommend.answer``; an engine: the setting it runs,
``kvlens.deploy.targets``), the target's options (``RecommendOptions`` or ``TargetOptions``
fields), one budget, several budgets or a KLD bound, and whether to validate against the exact
model. ``recommend_run`` checks it against the capture, measures, chooses, validates and
returns the answer with its result documents; writing files and rendering are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlens.capture.source import CaptureModel
from kvlens.capture.store import open_capture
from kvlens.deploy.targets import TargetOptions, TargetRecommendation, recommend_target
from kvlens.deploy.targets import validate as validate_target
from kvlens.errors import InputError
from kvlens.evaluation.kld import max_positions
from kvlens.recommend import RecommendOptions, check
from kvlens.recommend.answer import LayerAnswer, recommend_layers

LogFn = Callable[[str], None]


@dataclass(frozen=True)
class RecommendRequest:
    """What ``kvlens recommend`` is asked.

    ``options``: the fields given of ``RecommendOptions`` (target ``kvlens``) or
    ``TargetOptions`` (an engine target), the rest are their defaults; ``budgets``: several
    budgets from one measurement (per-layer target); ``max_kld``: the smallest budget whose
    config's measured KLD is at most this (an engine target reads it from ``options``);
    ``place``: where the model ``--max-kld`` and validation load goes (``load_model``'s
    ``dtype``, ``device_map``, ``max_memory``, ``offload_folder``); ``outputs``: where each
    config is written (named in the documents)."""

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


def recommend_run(request: RecommendRequest, *, save: Callable | None = None,
                  progress=None, log: LogFn | None = None) -> LayerAnswer | EngineAnswer:
    """Answer ``request``: the per-layer recommendation(s) (``LayerAnswer``) or the engine
    setting (``EngineAnswer``). ``save(recommendation, output)`` is called for each config as
    soon as it is chosen (before a validation); ``progress(done, total, what)`` follows the
    measurement; ``log`` receives the messages for the user."""
    say = log or (lambda _msg: None)
    if request.target != "kvlens":
        return _engine(request, save, progress, say)
    opts = RecommendOptions(**request.options)
    check(request.capture, opts)
    if request.tokens is not None:
        check_tokens(request.capture, request.tokens)
    return recommend_layers(request.capture, opts, budgets=request.budgets,
                            max_kld=request.max_kld, validate=request.validate,
                            eval_tokens=request.eval_tokens,
                            retrieval_prompts=request.retrieval_prompts, model=request.model,
                            place=request.place, remeasure=request.remeasure,
                            outputs=request.outputs, save=save, progress=progress, log=say)


def check_tokens(capture: Path, tokens: int) -> None:
    """``--tokens`` beyond the capture's samples would be cut short without a word: refuse."""
    with open_capture(capture) as cap:
        n = cap.meta.num_tokens
    if tokens > n:
        raise InputError(f"--tokens {tokens}: {capture} holds {n} tokens per sample; give at "
                         f"most {n} (or omit it).")


def _engine(request: RecommendRequest, save, progress, say: LogFn) -> EngineAnswer:
    given = {"eval_tokens": request.eval_tokens} if request.eval_tokens is not None else {}
    opts = TargetOptions(target=request.target, **request.options, **given)
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
    if save is not None and request.outputs:
        save(rec, request.outputs[0])
    validation = None
    if request.validate:
        validation = validate_target(rec, loaded.get(), opts.eval_tokens,
                                     lambda m: say(f"  {m}"))
    doc = rec.to_dict()
    doc["files"] = rec.files
    if validation is not None:
        doc["validation"] = validation
    return EngineAnswer(rec, validation, doc)
