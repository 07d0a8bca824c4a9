"""``kvlens recommend``: a per-layer KV quantization config under a memory budget, or the
setting an engine runs (``--target``). The options given become a ``RecommendRequest``
(``kvlens.deploy.answer.request_for``), research levers arrive as ``--set NAME=VALUE``
(``kvlens.research``), ``recommend_run`` answers and ``kvlens.cli.recommend_show`` shows it.
An option the run would not read is refused before any work (``CONDITIONS``, ``readers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    BUDGET,
    ENGINE,
    INPUT,
    MEASUREMENT,
    OUTPUT,
    VALIDATION,
    LibraryDefaults,
    ReadOnly,
    console,
    err_console,
    escape,
    flag_of,
    given_options,
    open_range,
    progress_bar,
    refuse_unread,
    run_library_call,
    shared_option,
    write_output,
    write_text_output,
)

RESEARCH = "Knobs and experiments (--set)"
#: parameters the command reads itself, for either target; the rest make the request
#: (``kvlens.deploy.answer.request_for``), whose ``readers`` say which target reads which
COMMAND_ONLY = ("capture", "target", "settings", "overwrite", "as_json")


@dataclass(frozen=True)
class Asked:
    """What a ``kvlens recommend`` command line asks for, as its refusal table reads it:
    ``levers``, the per-layer recommendation's ``--set`` levers (field -> value)."""

    target: str
    validate: bool
    max_kld: float | None
    levers: dict[str, Any]

    @property
    def engine(self) -> bool:
        return self.target != "kvlens"

    def lever(self, name: str, default: Any = None) -> Any:
        return self.levers.get(name, default)

    def twins_on(self) -> bool:
        """Whether a research candidate extension is switched on (``--set NAME=on``)."""
        from kvlens.recommend.extension import registered

        return any(self.lever(name) for name in registered())

    def loads_model(self) -> bool:
        measures = not self.engine and (self.lever("sensitivity", "auto") != "uniform"
                                        or self.lever("retrieval", "auto") != "off")
        return measures or self.validate or self.max_kld is not None


PER_LAYER = ReadOnly("--target kvlens (options of the per-layer kvlens recommendation)",
                     lambda a: not a.engine, lambda a: f"--target {a.target}",
                     "use --target kvlens")
ENGINE_ONLY = ReadOnly("an engine target (--target llama.cpp, vllm, sglang, trtllm or "
                       "transformers)", lambda a: a.engine, "--target kvlens",
                       "name one with --target")
BY_TARGET = {frozenset({"kvlens"}): (PER_LAYER,), frozenset({"engine"}): (ENGINE_ONLY,),
             frozenset({"kvlens", "engine"}): ()}
MODEL_STAGES = ReadOnly(
    lambda a: "a run that loads the model (" + ("--max-kld or --validate" if a.engine else
                                                "--validate, --max-kld, or research levers that "
                                                "measure on it: --set sensitivity, --set "
                                                "retrieval") + ")",
    Asked.loads_model, "this one: no model is loaded here")
TORCH_PATH = ReadOnly("the torch decode path (research twins are not read by the fused "
                      "kernel)", lambda a: not (a.lever("prefer_fast") and a.twins_on()),
                      "--set prefer-fast=on, which keeps to that kernel",
                      "drop --set prefer-fast=on")
LAYOUT = ReadOnly("the layout sensitivity (--set sensitivity=auto or layout)",
                  lambda a: a.lever("sensitivity", "auto") not in ("uniform", "model"),
                  lambda a: f"--set sensitivity={a.lever('sensitivity')}, which does not run it")
#: What an option needs besides its target (``BY_TARGET``): the command's refusal table.
CONDITIONS = {
    "anchors": (ReadOnly("--max-kld (settings whose KLD is measured to fit its predictor)",
                         lambda a: a.max_kld is not None, "a run without it",
                         "give --max-kld too"),),
    "eval_tokens": (ReadOnly("--validate or --max-kld (the held-out tokens they score)",
                             lambda a: a.validate or a.max_kld is not None,
                             "a run without them", "add one of them"),),
    "retrieval_prompts": (ReadOnly("--validate (its retrieval grid)", lambda a: a.validate,
                                   "a run without it", "add --validate"),),
    "balancer_exponent": (ReadOnly("balancer candidates", lambda a: a.lever("balancer", True),
                                   "--set balancer=off, which removes them",
                                   "drop --set balancer=off"),),
    "layout_layers": (LAYOUT,), "layout_tokens": (LAYOUT,),
    "retrieval_weight": (ReadOnly("the retrieval probe",
                                  lambda a: a.lever("retrieval", "auto") != "off",
                                  "--set retrieval=off, which skips it",
                                  "drop --set retrieval=off"),),
    **{name: (MODEL_STAGES,) for name in ("model", "dtype", "device_map", "max_memory",
                                          "offload_folder")},
}


def _switched_on(name: str) -> ReadOnly:
    """A research extension's settings are read with its switch on (``--set NAME=on``)."""
    return ReadOnly(f"--set {name}=on", lambda a: a.lever(name, False),
                    lambda a: f"--set {name}=off" if name in a.levers else "a run without it",
                    f"add --set {name}=on")


def refuse_unread_options(given: dict[str, str], levers: dict[str, dict], asked: Asked) -> None:
    """Refuse the options (``given``: parameter -> flag) and ``--set`` levers (parsed per
    owner, ``kvlens.research.parse_settings``) that ``asked`` would not read: the options of
    the other target (``kvlens.deploy.answer.readers``), then ``CONDITIONS``."""
    from kvlens.deploy.answer import readers
    from kvlens.recommend.extension import lever_fields
    from kvlens.research import levers as all_levers

    by_field = {lv.field: lv for lv in all_levers().values()}
    spelled = dict(given) | {f: f"--set {by_field[f].name}" for owned in levers.values()
                             for f in owned}
    conditions = CONDITIONS | {f: (_switched_on(ext),) if sub else (TORCH_PATH,)
                               for f, (ext, sub) in lever_fields().items()}
    table = {name: conditions.get(name, ()) if name in COMMAND_ONLY else
             BY_TARGET[readers(name)] + conditions.get(name, ()) for name in spelled}
    refuse_unread(table, spelled, asked)


class _LibraryDefaults(LibraryDefaults):
    not_shown = ("target",)

    def library_options(self) -> tuple[type, ...]:
        from kvlens.deploy.targets import TargetOptions
        from kvlens.recommend import RecommendOptions

        return TargetOptions, RecommendOptions


def _list_levers(value: list[str] | None) -> list[str] | None:
    """``--set list``: print the research levers and stop (eager: no capture needed)."""
    if value and "list" in value:
        from kvlens.research import describe

        console.print(describe(), highlight=False, markup=False)
        raise typer.Exit()
    return value


@app.command(cls=_LibraryDefaults)
def recommend(
    ctx: typer.Context,
    capture: Path = typer.Argument(..., show_default=False, metavar="CAPTURE",
                                   help="Capture file from `kvlens capture`."),
    samples: int = typer.Option(None, "--samples", min=1, rich_help_panel=INPUT,
                                help="Capture samples to measure errors on (default: all; "
                                     "engine targets: the first)."),
    tokens: int = typer.Option(None, "--tokens", min=1, rich_help_panel=INPUT,
                               help="First N tokens of each sample to measure on (default: "
                                    "four times the largest window; the last quarter is "
                                    "scored)."),
    budget_bits: float = typer.Option(None, "--budget-bits", "-b", max=16,
                                      callback=open_range(0, math.inf), rich_help_panel=BUDGET,
                                      help="Bits per cached K/V element the cache may hold at "
                                           "--context tokens, every part counted (16 = an "
                                           "fp16 cache). Required unless an engine target "
                                           "takes --max-kld."),
    budgets: str = typer.Option(None, "--budgets", rich_help_panel=BUDGET,
                                help="Several budgets (comma list) from one measurement: one "
                                     "config each, written as NAME-<B>b.json beside --output."),
    context: int = typer.Option(None, "--context", min=1, rich_help_panel=BUDGET,
                                help="Context length the budget is counted at (tokens)."),
    windows: str = typer.Option(None, "--windows", rich_help_panel=BUDGET,
                                help="Full-precision window sizes each layer chooses among "
                                     "(tokens, comma list)."),
    fp_dtype: str = typer.Option(None, "--window-dtype", rich_help_panel=BUDGET,
                                 help="Dtype of the full-precision parts (window, sinks): "
                                      "float16, or float8_e4m3fn (one byte per element)."),
    target: str = typer.Option("kvlens", "--target", rich_help_panel=ENGINE,
                               help="What to recommend for: kvlens (a per-layer config for "
                                    "kvlens' cache), llama.cpp (-ctk/-ctv), vllm (--kv-cache-"
                                    "dtype), vllm:cpu (vLLM's CPU build), sglang, transformers "
                                    "(QuantizedCache), trtllm "
                                    "(TensorRT-LLM). docs/deploy/README.md."),
    max_kld: float = typer.Option(None, "--max-kld", callback=open_range(0, math.inf),
                                  rich_help_panel=ENGINE,
                                  help="The smallest budget (per-layer target) or the "
                                       "cheapest setting (engine targets) whose measured KL "
                                       "divergence is at most this."),
    workers: int = typer.Option(None, "--workers", min=1, rich_help_panel=MEASUREMENT,
                                help="Processes to measure on (default: every free core when "
                                     "the measurement is long)."),
    remeasure: bool = typer.Option(False, "--remeasure", rich_help_panel=MEASUREMENT,
                                   help="Measure again instead of reusing the measurement an "
                                        "earlier run on this capture kept "
                                        "(docs/recommend.md#time)."),
    model: str = shared_option("model", help="Model to measure sensitivity and validate on "
                                             "(default: the capture's own)."),
    dtype: str = shared_option("dtype", default=None,
                               help="Dtype the model runs in for sensitivity, --max-kld and "
                                    "--validate (the exact reference too): float32, bfloat16 or "
                                    "float16."),
    device_map: str = shared_option("device_map"),
    max_memory: str = shared_option("max_memory"),
    offload_folder: Path = shared_option("offload_folder"),
    validate: bool = typer.Option(False, "--validate", rich_help_panel=VALIDATION,
                                  help="Measure the result against the exact model on "
                                       "held-out text (KL divergence, top-1, perplexity, "
                                       "with intervals), beside kivi-2, kivi-4, per-token-4."),
    eval_tokens: int = typer.Option(None, "--eval-tokens", min=2, rich_help_panel=VALIDATION,
                                    help="Held-out tokens scored by --validate and --max-kld "
                                         "(at most the model's context)."),
    retrieval_prompts: int = typer.Option(0, "--retrieval-prompts", min=0,
                                          rich_help_panel=VALIDATION,
                                          help="With --validate: also run the retrieval grid "
                                               "at 1k tokens with this many prompts per task "
                                               "and depth (0 = skip)."),
    output: Path = typer.Option(None, "--output", "-o", rich_help_panel=OUTPUT,
                                help="Write the config JSON here (and the results for "
                                     "`kvlens report` beside it)."),
    name: str = typer.Option(None, "--name", rich_help_panel=OUTPUT,
                             help="Name stored in the config."),
    overwrite: bool = shared_option("overwrite"),
    as_json: bool = shared_option("as_json", "the result"),
    settings: list[str] = typer.Option(None, "--set", metavar="NAME=VALUE", is_eager=True,
                                       callback=_list_levers, rich_help_panel=RESEARCH,
                                       help="A knob of the default run or an experiment, "
                                            "NAME=VALUE (repeatable); `--set list` lists "
                                            "both groups."),
) -> None:
    """Choose how to quantize each layer's KV cache under a memory budget, or (--target) the
    setting an engine runs, with the command to deploy it.

    Examples:

      kvlens recommend run.h5 -b 3.0 -o kv.json --validate

      kvlens recommend run.h5 --target llama.cpp --max-kld 0.01 --validate

      kvlens recommend run.h5 --budgets 2.5,3,4 -o kv.json

    Every option given is used or refused before any measurement starts."""
    from kvlens.cli.recommend_show import show_layers, show_target
    from kvlens.deploy.answer import recommend_run, request_for
    from kvlens.deploy.targets import canonical_target
    from kvlens.research import RECOMMEND, TARGET, parse_settings

    target = run_library_call(lambda: canonical_target(target))  # llamacpp, VLLM...
    engine = target != "kvlens"
    given = given_options(ctx, [p.name for p in ctx.command.params])
    levers = run_library_call(lambda: parse_settings(list(settings or [])))
    asked = Asked(target, validate, max_kld, levers[RECOMMEND])
    run_library_call(lambda: refuse_unread_options(given, levers, asked))
    request = run_library_call(lambda: request_for(
        capture, target, {p: ctx.params[p] for p in given if p not in COMMAND_ONLY},
        levers[TARGET if engine else RECOMMEND]), name=_flag)
    run_library_call(lambda: _check_outputs(request.outputs, target, overwrite))
    with progress_bar("measuring engine cache types" if engine else "measuring candidates") \
            as update:
        answer = run_library_call(lambda: recommend_run(
            request, save=_save_engine if engine else _save_config, progress=update,
            log=lambda msg: err_console.print(escape(msg), highlight=False)), name=_flag)
    if engine:
        show_target(answer, output, as_json)
    else:
        show_layers(answer, request.outputs, as_json)


def _flag(field: str) -> str:
    """How the user gave a library field: ``option_name`` (recommend's), ``--set NAME`` (a
    lever), else its flag."""
    from kvlens.recommend.options import RecommendOptions, option_name
    from kvlens.research import levers

    if field in RecommendOptions.__dataclass_fields__:
        return option_name(field)
    return next((f"--set {lv.name}" for lv in levers().values() if lv.field == field),
                flag_of(field))


def _check_outputs(outputs, target: str, overwrite: bool) -> None:
    """Each config, its result document and the files beside it: refused where one exists
    without --overwrite, before any work."""
    from kvlens.deploy.answer import files_beside
    from kvlens.report.artifacts import check_output_file, config_doc_path

    for out in outputs:
        check_output_file(out, "--output", overwrite, example="kv.json")
        doc = config_doc_path(out, "recommend" if target == "kvlens" else "deploy")
        for path in (doc, *files_beside(out, target)):
            check_output_file(path, "--output", overwrite)


def _save_config(rec, out: Path) -> None:
    """Write a per-layer recommendation's config as soon as it is chosen, and beside it the
    transformers cache it maps to (``kvlens.deploy.hf_cache``), or say why it does not map."""
    from kvlens.config import save_config
    from kvlens.deploy import hf_cache

    write_output(out, lambda tmp: save_config(rec.config, tmp))
    err_console.print(f"config written: {escape(str(out))}")
    path, text = hf_cache.beside(rec.config, out)
    if path is not None:
        write_text_output(path, text)
        text = f"transformers cache written: {path}; load it with:\n{hf_cache.snippet(path)}"
    if text:
        err_console.print(escape(text), highlight=False)


def _save_engine(rec, out: Path) -> None:
    """Write an engine target's config and its scale files (``kv_scales.json``) beside it."""
    from kvlens.config import save_config

    write_output(out, lambda tmp: save_config(rec.chosen.config, tmp))
    for name, text in rec.files.items():
        write_text_output(out.parent / name, text)
    for path in (out, *(out.parent / name for name in rec.files)):
        err_console.print(f"written: {escape(str(path))}")
