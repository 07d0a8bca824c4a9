"""The one call behind ``kvlens generate``: ``generate_run(request)`` on the
``GenerateRequest`` that ``generate_request`` builds from a command line's values; writing
files and rendering are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlens.deploy.engine_run import llamacpp_matmul_plan, mark_partial_llamacpp
from kvlens.deploy.settings import Settings, check_against_model, resolve_settings
from kvlens.errors import InputError
from kvlens.evaluation import EvalOptions, evaluate_configs, load_eval_text
from kvlens.model import load as model_load  # a module attribute: tests substitute the load
from kvlens.model.architecture import describe
from kvlens.model.engine_matmul import engine_matmuls
from kvlens.model.placement import placement_summary
from kvlens.units import format_bytes_by_device

LogFn = Callable[[str], None]
DEFAULT_MODEL = "SmolLM2-135M-Instruct (embedded)"  # what no --model loads


@dataclass(frozen=True)
class GenerateRequest:
    """What ``kvlens generate`` is asked: the caches to compare (``settings``), the evaluation
    (``options``), the model (None: the embedded default) and ``load_model``'s ``place``."""

    settings: Settings
    options: EvalOptions
    model: str | None = None
    place: dict[str, Any] = field(default_factory=dict)


def generate_request(options: dict[str, Any], *, config=None, preset: str | None = None,
                     compare: str | None = None, calibration=None, prompt_file=None,
                     model: str | None = None, place: dict[str, Any] | None = None
                     ) -> GenerateRequest:
    """The request for ``options`` (``EvalOptions`` fields) and the settings named, nothing
    loaded: the prompt given once (text or ``prompt_file``), the settings resolved, something to
    do (a prompt or an evaluation) and a ``text`` that reads."""
    if options.get("prompt") is not None and prompt_file is not None:
        raise InputError("Give either {prompt} or {prompt_file}, not both.")
    if config is not None and preset is not None:  # before any file is read
        raise InputError("Give either {config} FILE or {preset} NAME, not both.")
    opts = EvalOptions(**options)
    settings = resolve_settings(config, preset, compare,
                                None if calibration is None else str(calibration))
    if prompt_file is not None:
        try:
            opts = replace(opts, prompt=Path(prompt_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"Cannot read {{prompt_file}} {prompt_file}: {exc}.") from None
    if not opts.evals and opts.prompt is None:
        raise InputError("Nothing to do: give {prompt}/{prompt_file} and/or {eval} "
                         "kld,retrieval,ppl,passkey,agreement.")
    if opts.text is not None:
        load_eval_text(opts.text)  # a missing or empty text fails now, not after the load
    return GenerateRequest(settings, opts, model, dict(place or {}))


def generate_run(request: GenerateRequest, say: LogFn = lambda msg: None,
                 progress: LogFn = lambda msg: None) -> dict:
    """Check, load the model, evaluate every setting (module docstring): the report of
    ``kvlens.evaluation.evaluate_configs`` with ``placement`` (where the weights are).
    ``say`` gets the notes and the loading lines, ``progress`` the evaluation's."""
    settings, place = request.settings, request.place
    source, _ = model_load.check_load_options(request.model, **place)
    check_against_model(settings, request.options, source)
    for note in settings.notes:
        say(f"note: {note}")
    say(f"Loading {request.model or DEFAULT_MODEL} ...")
    mdl, tok, source = model_load.load_model(request.model, **place)
    shape = describe(mdl)
    for line in settings.for_model(shape.num_layers, shape.is_hybrid):
        say(f"note: {line}")
    placement = placement_summary(mdl)
    say(f"weights: {format_bytes_by_device(placement['weights_by_device'])}")
    types, notes = llamacpp_matmul_plan(settings, source, mdl)
    for note in notes:
        say(f"note: {note}")
    with engine_matmuls(mdl, types):
        report = evaluate_configs(mdl, tok, settings, request.options, progress=progress)
    mark_partial_llamacpp(report["results"], settings, types)
    return {**report, "placement": placement}
