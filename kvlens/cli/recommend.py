"""``kvlens recommend``: a per-layer KV quantization config under a memory budget, or the
setting an engine runs (``--target``).

The command is a thin call: its options become ``kvlens.recommend.RecommendOptions`` (or the
engine targets' ``TargetOptions``) with only the options given, so every default is the
library's (``--help`` shows them from there); research levers arrive through one option,
``--set NAME=VALUE`` (``kvlens.research``). Which options each target reads is derived from
those two dataclasses (``readers``); an option the chosen target or combination would not read
is refused before any work.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    BUDGET,
    ENGINE,
    INPUT,
    MEASUREMENT,
    MODEL,
    OUTPUT,
    VALIDATION,
    KvlensCommand,
    check_model_options,
    console,
    device_map_option,
    err_console,
    escape,
    format_bytes,
    format_seconds,
    given_options,
    max_memory_option,
    offload_folder_option,
    overwrite_option,
    print_json,
    progress_bar,
    run_library_call,
    write_config_doc,
    write_output,
    write_text_output,
)

RESEARCH = "Knobs and experiments (--set)"
KVLENS, ENGINES = "kvlens", "engine"
#: Who reads the command's parameters that are not a field of ``RecommendOptions`` or
#: ``TargetOptions`` of the same name (the rest: ``readers``).
CLI_READERS = {
    "capture": {KVLENS, ENGINES}, "target": {KVLENS, ENGINES}, "settings": {KVLENS, ENGINES},
    "validate": {KVLENS, ENGINES}, "eval_tokens": {KVLENS, ENGINES},
    "output": {KVLENS, ENGINES}, "overwrite": {KVLENS, ENGINES}, "as_json": {KVLENS, ENGINES},
    # the placement of the model a target's --max-kld or --validate loads (run_target's place)
    "dtype": {KVLENS, ENGINES}, "device_map": {KVLENS, ENGINES}, "max_memory": {KVLENS, ENGINES},
    "offload_folder": {KVLENS, ENGINES},
    "max_kld": {KVLENS, ENGINES},  # kvlens: the budget search (kvlens.recommend.search)
    "thorough": {KVLENS}, "remeasure": {KVLENS}, "retrieval_prompts": {KVLENS},
    "budgets": {KVLENS},
}
PLACEMENT = ("dtype", "device_map", "max_memory", "offload_folder")


def readers(param: str) -> set[str]:
    """The targets that read the command's parameter ``param``: ``KVLENS`` (the per-layer
    recommendation) where it is a ``RecommendOptions`` field, ``ENGINES`` where it is a
    ``TargetOptions`` field, else ``CLI_READERS``."""
    from dataclasses import fields

    from kvlens.deploy.targets import TargetOptions
    from kvlens.recommend import RecommendOptions

    if param in CLI_READERS:
        return CLI_READERS[param]
    return ({KVLENS} if param in {f.name for f in fields(RecommendOptions)} else set()) | \
        ({ENGINES} if param in {f.name for f in fields(TargetOptions)} else set())


class _LibraryDefaults(KvlensCommand):
    """``--help`` shows each option's default from ``RecommendOptions`` / ``TargetOptions``
    (the one source), read when help is asked for (so that ``kvlens --help`` loads no torch)."""

    def format_help(self, ctx, formatter) -> None:
        from dataclasses import MISSING, fields

        from kvlens.deploy.targets import TargetOptions
        from kvlens.recommend import RecommendOptions

        defaults: dict[str, set] = {}
        for cls in (TargetOptions, RecommendOptions):
            for f in fields(cls):
                if f.default is not MISSING:
                    shown = f.default
                    shown = ",".join(map(str, shown)) if isinstance(shown, tuple) else shown
                    defaults.setdefault(f.name, set()).add(str(shown))
        for p in self.params:
            shown = defaults.get(p.name, set())
            if len(shown) == 1 and "None" not in shown and not isinstance(p.default, bool) \
                    and p.name != "target":
                # shown only: the command passes the library only what the user gave
                p.default, p.show_default = shown.pop(), True
        super().format_help(ctx, formatter)


def _list_levers(value: list[str] | None) -> list[str] | None:
    """``--set list``: print the research levers and stop (eager: no capture needed)."""
    if value and "list" in value:
        from kvlens.research import describe

        console.print(describe(), highlight=False, markup=False)
        raise typer.Exit()
    return value


def _above_zero(value: float | None) -> float | None:
    """A number that must be positive: outside that range is a usage error (exit 2), as
    click's ``min=`` ranges are."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value} is not above 0.")
    return value


def _ints(spec: str, what: str) -> tuple[int, ...]:
    from kvlens.errors import InputError

    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InputError(f"Invalid {what} {spec!r}; expected a comma list of integers.") from None


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
                                      callback=_above_zero, rich_help_panel=BUDGET,
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
    thorough: bool = typer.Option(False, "--thorough", rich_help_panel=BUDGET,
                                  help="Also offer MiKV candidates: several times "
                                       "slower."),
    target: str = typer.Option("kvlens", "--target", rich_help_panel=ENGINE,
                               help="What to recommend for: kvlens (a per-layer config for "
                                    "kvlens' cache), llama.cpp (-ctk/-ctv), vllm "
                                    "(--kv-cache-dtype), sglang, transformers "
                                    "(QuantizedCache). docs/deploy/README.md."),
    max_kld: float = typer.Option(None, "--max-kld", callback=_above_zero,
                                  rich_help_panel=ENGINE,
                                  help="The smallest budget (per-layer target: measured "
                                       "KLD of its config; engine targets: predicted KLD of "
                                       "a setting) at most this KL divergence."),
    workers: int = typer.Option(None, "--workers", min=1, rich_help_panel=MEASUREMENT,
                                help="Processes to measure on (default: every free core when "
                                     "the measurement is long)."),
    remeasure: bool = typer.Option(False, "--remeasure", rich_help_panel=MEASUREMENT,
                                   help="Measure again instead of reusing the measurement an "
                                        "earlier run on this capture kept "
                                        "(docs/recommend.md#time)."),
    model: str = typer.Option(None, "--model", "-m", rich_help_panel=MODEL,
                              help="Model to measure sensitivity and validate on (default: "
                                   "the capture's own)."),
    dtype: str = typer.Option(None, "--dtype", rich_help_panel=MODEL,
                              help="Dtype the model runs in for sensitivity, --max-kld and "
                                   "--validate (the exact reference too): float32, bfloat16 or "
                                   "float16."),
    device_map: str = device_map_option(),
    max_memory: str = max_memory_option(),
    offload_folder: Path = offload_folder_option(),
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
    overwrite: bool = overwrite_option(),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT,
                                 help="Print the result as JSON on stdout."),
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

      kvlens recommend run.h5 -b 2.5 --set mikv=on

    Every option given is used or refused before any measurement starts."""
    from kvlens.deploy.answer import RecommendRequest, recommend_run
    from kvlens.deploy.targets import canonical_target
    from kvlens.research import RECOMMEND, TARGET, parse_settings

    target = run_library_call(lambda: canonical_target(target))  # llamacpp, VLLM...
    engine = target != "kvlens"
    given = given_options(ctx, [p.name for p in ctx.command.params])
    levers = run_library_call(lambda: parse_settings(list(settings or [])))
    budget_list = run_library_call(lambda: _budgets(budgets, output, budget_bits, max_kld,
                                                    engine))
    outputs = [] if output is None else [_output_for(output, b) for b in budget_list] \
        if budget_list else [output]
    run_library_call(lambda: _check_common(
        capture, target, given, levers, outputs, overwrite, validate=validate, max_kld=max_kld,
        thorough=thorough, model=model, dtype=dtype, device_map=device_map,
        max_memory=max_memory, offload_folder=offload_folder))
    place = {"device_map": device_map, "max_memory": max_memory,
             "offload_folder": str(offload_folder) if offload_folder else None} | (
        {"dtype": dtype} if dtype else {})
    owner, lever_owner = (ENGINES, TARGET) if engine else (KVLENS, RECOMMEND)
    values = {p: ctx.params[p] for p in given if owner in readers(p) and p not in CLI_READERS}
    if not engine:
        values |= {k: v for k, v in place.items() if k in given}
        if "windows" in values:
            values["windows"] = run_library_call(lambda: _ints(windows, "--windows"))
        # the measurement does not read the budget: --budgets and --max-kld allocate later
        values["budget_bits"] = budget_bits or min(budget_list, default=16.0)
        if thorough:
            from kvlens.recommend import THOROUGH

            values |= THOROUGH
    request = RecommendRequest(
        capture, target, values | levers[lever_owner], tuple(budget_list), max_kld, validate,
        eval_tokens, retrieval_prompts, tokens, model, place, remeasure, tuple(outputs))
    with progress_bar("measuring engine cache types" if engine else "measuring candidates") \
            as update:
        answer = run_library_call(lambda: recommend_run(
            request, save=_save_engine if engine else _save_config, progress=update,
            log=lambda msg: err_console.print(escape(msg), highlight=False)))
    if engine:
        from kvlens.cli.targets import show_target

        show_target(answer, output, as_json)
        return
    _print_profile(answer.recommendations[0].profile, answer.predicted)
    for doc, out in zip(answer.documents, outputs):
        data = run_library_call(lambda d=doc, o=out: write_config_doc("recommend", d, o))
        err_console.print(f"results for `kvlens report` written: {escape(str(data))}")
    if as_json:
        docs = answer.documents
        print_json(docs[0] if len(docs) == 1 else {"recommendations": docs})
        return
    if answer.search is not None:
        _render_search(answer.search)
    if len(answer.recommendations) > 1:
        _render_budgets(answer.recommendations)
    else:
        _render(answer.recommendations[0])
    if answer.validation is not None:
        from kvlens.cli.generate import _render_long

        _render_long(answer.validation)


def _budgets(spec: str | None, output, budget_bits, max_kld, engine: bool) -> list[float]:
    """``kvlens.recommend.answer.budget_list`` (the per-layer target's one-mode rule); an
    engine target runs one setting per engine."""
    from kvlens.errors import InputError
    from kvlens.recommend.answer import budget_list

    if engine:
        if spec is not None:
            raise InputError("--budgets: not used by an engine target (one setting per "
                             "engine); give --budget-bits or --max-kld.")
        return []
    return budget_list(spec, budget_bits, max_kld, output)


def _output_for(output: Path, budget: float) -> Path:
    from kvlens.recommend.answer import output_for

    return output_for(output, budget)


def _check_common(capture, target, given, levers, outputs, overwrite, *, validate, max_kld,
                  thorough, model, dtype, device_map, max_memory, offload_folder) -> None:
    """The checks both targets share, cheapest first: option combinations, the output files,
    the capture, the model and its placement."""
    from kvlens.capture.store import open_capture
    from kvlens.model.load import parse_dtype
    from kvlens.model.placement import make_placement
    from kvlens.report.artifacts import check_output_file, config_doc_path

    _check_combinations(target, given, levers, validate=validate, max_kld=max_kld,
                        thorough=thorough)
    engine = target != "kvlens"
    for out in outputs:
        check_output_file(out, "--output", overwrite, example="kv.json")
        check_output_file(config_doc_path(out, "deploy" if engine else "recommend"), "--output",
                          overwrite)
        if target in ("vllm", "sglang"):
            check_output_file(out.parent / "kv_scales.json", "--output", overwrite)
    with open_capture(capture):
        pass  # a missing, foreign or incomplete capture fails here, before any work
    if model is not None:
        check_model_options(model, **({"dtype": dtype} if dtype else {}), device="cpu",
                            device_map=device_map, max_memory=max_memory,
                            offload_folder=offload_folder)
        return
    if dtype:
        parse_dtype(dtype)
    make_placement(device_map, max_memory, str(offload_folder) if offload_folder else None)


def _save_config(rec, out: Path) -> None:
    """Write a per-layer recommendation's config as soon as it is chosen."""
    from kvlens.config import save_config

    write_output(out, lambda tmp: save_config(rec.config, tmp))
    err_console.print(f"config written: {escape(str(out))}")


def _save_engine(rec, out: Path) -> None:
    """Write an engine target's config and its scale files (``kv_scales.json``) beside it."""
    from kvlens.config import save_config

    write_output(out, lambda tmp: save_config(rec.chosen.config, tmp))
    written = [str(out)]
    for name, text in rec.files.items():
        write_text_output(out.parent / name, text)
        written.append(str(out.parent / name))
    for w in written:
        err_console.print(f"written: {escape(w)}")


def _render_search(search) -> None:
    from rich.table import Table

    t = Table(title=f"Budgets tried for --max-kld {search.max_kld:g} (held-out text, mean KLD "
                    "with its 95% interval)")
    for col in ("budget", "bits held", "mean KLD", "95% interval", "top-1", ""):
        t.add_column(col, justify="right")
    for st in search.steps:
        lo, hi = st.kld["mean_kld"]["ci95"]
        mark = "chosen" if st.budget_bits == search.chosen.budget_bits else (
            "meets" if st.mean_kld <= search.max_kld else "misses")
        t.add_row(f"{st.budget_bits:g}", f"{st.mean_bits:.3f}", f"{st.mean_kld:.4f}",
                  f"[{lo:.4f}, {hi:.4f}]", f"{st.kld['top1_agreement']['value']:.3f}", mark)
    console.print(t)


def _render_budgets(recs) -> None:
    from rich.table import Table

    t = Table(title="Configs at each budget (one measurement)")
    for col in ("config", "budget", "bits held", "expected output error"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for rec in recs:
        t.add_row(escape(rec.config.name), f"{rec.budget_bits:g}", f"{rec.mean_bits:.3f}",
                  f"{rec.expected_output_error:.4f}")
    console.print(t)


def _print_profile(profile, predicted) -> None:
    """Where the time went (stderr), stage by stage, beside the prediction (None: nothing was
    predicted, the measurement was reused)."""
    parts = ", ".join(f"{name} {format_seconds(sec)}" for name, sec in
                      sorted(profile.stages.items(), key=lambda kv: -kv[1]) if sec >= 0.05)
    said = "" if predicted is None else f", predicted {format_seconds(predicted.seconds)}"
    err_console.print(f"time by stage ({format_seconds(profile.total)} in all{said}): {parts}",
                      highlight=False)


def _check_combinations(target: str, given: dict[str, str], levers: dict[str, dict], *,
                        validate: bool, max_kld, thorough: bool) -> None:
    """Refuse options that this combination would not read (never drop one silently).
    ``given``: the options the user gave, parameter name -> flag; ``levers``: the parsed
    ``--set`` levers per owner (``kvlens.research.parse_settings``)."""
    from kvlens.errors import InputError
    from kvlens.research import RECOMMEND, TARGET
    from kvlens.research import levers as all_levers

    by_field = {lv.field: lv for lv in all_levers().values()}
    names = dict(given)  # parameter or lever field -> how the user spelled it
    for owner in (RECOMMEND, TARGET):
        names |= {f: f"--set {by_field[f].name}" for f in levers[owner]}

    def flags(keys) -> str:
        return ", ".join(names[k] for k in keys if k in names)

    def them(keys) -> str:
        return "them" if sum(k in names for k in keys) > 1 else "it"

    engine = target != "kvlens"
    if engine:
        unread = [p for p in given if ENGINES not in readers(p)] + \
            [f for f in levers[RECOMMEND] if f not in levers[TARGET]]
        if unread:
            raise InputError(f"{flags(unread)}: not used by --target {target} (options of the "
                             f"per-layer kvlens recommendation); drop {them(unread)}, or use "
                             "--target kvlens.")
        if "anchors" in levers[TARGET] and max_kld is None:
            raise InputError("--set kld-anchors sets how many settings fit the --max-kld "
                             "predictor; give --max-kld too, or drop it.")
        needs_model = max_kld is not None or validate
        why = "--max-kld or --validate"
    else:
        unread = [p for p in given if KVLENS not in readers(p)] + \
            [f for f in levers[TARGET] if f not in levers[RECOMMEND]]
        if unread:
            raise InputError(f"{flags(unread)}: only for an engine target (--target "
                             "llama.cpp, vllm, sglang or transformers); the kvlens target "
                             "takes --budget-bits.")
        opts = levers[RECOMMEND]
        mikv = opts.get("mikv", thorough)
        if not mikv and flags(("mikv_set_bits", "mikv_fractions")):
            raise InputError(f"{flags(('mikv_set_bits', 'mikv_fractions'))}: describe MiKV "
                             "candidates, which are not offered; add --thorough (or --set "
                             f"mikv=on), or drop {them(('mikv_set_bits', 'mikv_fractions'))}.")
        if not opts.get("balancer", True) and "balancer_exponent" in opts:
            raise InputError("--set balancer-exponent shapes balancer candidates, which "
                             "--set balancer=off removes; give one or the other.")
        if opts.get("prefer_fast") and (thorough or opts.get("mikv")):
            raise InputError(f"{flags(('thorough', 'mikv'))}: MiKV "
                             "candidates are not read by the fused kernel, which --set "
                             "prefer-fast=on keeps to; give one or the other.")
        sensitivity = opts.get("sensitivity", "auto")
        if sensitivity in ("uniform", "model") and flags(("layout_layers", "layout_tokens")):
            keys = ("layout_layers", "layout_tokens")
            raise InputError(f"{flags(keys)}: shape the layout sensitivity, which --set "
                             f"sensitivity={sensitivity} does not run; drop {them(keys)}.")
        retrieval = opts.get("retrieval", "auto")
        if retrieval == "off" and "retrieval_weight" in opts:
            raise InputError("--set retrieval-weight weighs the retrieval probe, which --set "
                             "retrieval=off skips; give one or the other.")
        if "retrieval_prompts" in given and not validate:
            raise InputError("--retrieval-prompts applies to --validate; add --validate or "
                             "drop it.")
        needs_model = sensitivity != "uniform" or retrieval != "off" or validate or \
            max_kld is not None
        why = ("--validate, --max-kld, or research levers that measure on the model (--set "
               "sensitivity, --set retrieval)")
    if "eval_tokens" in given and not (validate or max_kld is not None):
        raise InputError("--eval-tokens sets the held-out tokens scored by --validate or "
                         "--max-kld; add one of them or drop it.")
    loaders = flags(("model",) + PLACEMENT)
    if loaders and not needs_model:
        raise InputError(f"{loaders}: no model is loaded here (only with {why}); drop "
                         f"{them(('model',) + PLACEMENT)}.")


def _render(rec) -> None:
    from rich.table import Table

    t = Table(title=f"Recommendation: {rec.mean_bits:.3f} bits/element (budget "
                    f"{rec.budget_bits}) at {rec.context} tokens; windows "
                    f"{'/'.join(map(str, rec.windows))} offered, {rec.sink_tokens} sink tokens")
    for col in ("layer", "weight", "key", "bits", "K out", "value", "bits", "V out", "R", "F"):
        t.add_column(col, justify="left" if col in ("key", "value") else "right",
                     no_wrap=True)
    by_layer: dict[int, dict] = {}
    for ch in rec.choices:
        by_layer.setdefault(ch.layer, {})[ch.tensor] = ch
    for j, (layer, pair) in enumerate(sorted(by_layer.items())):  # weights: in layer order
        k, v = pair["key"], pair["value"]
        t.add_row(str(layer), f"{rec.weights[j]:.2f}", escape(k.candidate.short), f"{k.bits:.2f}",
                  f"{k.output_error:.3f}", escape(v.candidate.short), f"{v.bits:.2f}",
                  f"{v.output_error:.3f}", str(k.residual_tokens),
                  str(k.flush_tokens or "R"))
    console.print(t)
    console.print("K out / V out: relative attention-output error when only that tensor is "
                  "quantized (where it is consumed), on the capture's text plus, when the "
                  "retrieval probe ran, at its answer position: the metric each choice "
                  "minimises, weighted by the layer's sensitivity (weight). Score and "
                  "reconstruction errors of every choice are in --json. ch = "
                  "per-channel (groups of G tokens), tok = per-token (groups of G channels), "
                  "pre = keys quantized before RoPE, bal = MiKV channel balancer, rot = Hadamard "
                  "rotation. R = the layer's full-precision window (tokens), F = tokens "
                  "quantized at a time when the window fills (R = the whole window). Errors "
                  "are measured as decoding reads the cache: the window and sink tokens "
                  "exact.")
    m = Table(title="KV cache memory (all layers, batch 1)")
    for col in ("context", "recommended", "fp16", "ratio"):
        m.add_column(col, justify="right")
    for ctx, b in rec.kv_bytes.items():
        f = rec.kv_bytes_fp16[ctx]
        m.add_row(f"{ctx:,}", format_bytes(b), format_bytes(f), f"{f / b:.2f}x")
    console.print(m)
    _render_decode_cost(rec)
    console.print(f"expected mean attention-output error: {rec.expected_output_error:.4f}")
    for note in rec.notes:
        console.print(f"note: {escape(note)}")


def _render_decode_cost(rec) -> None:
    from rich.table import Table

    if not rec.decode_cost:
        return
    t = Table(title=f"Decode cost at {rec.context:,} tokens (model: bytes one decode step "
                    "reads, all layers, batch 1)")
    for col in ("config", "read", "vs fp16", "fused kernel path", "torch-path unpack"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for name, c in rec.decode_cost:
        fused = "yes" if c.fused else f"no ({len(c.unfused)} layers)"
        t.add_row(escape(name), format_bytes(c.read_bytes), f"{c.ratio_fp16:.3f}", fused,
                  format_bytes(c.torch_unpack_bytes))
    console.print(t)
    console.print("read: codes, scales/zeros, the filled window, sink copies, positions "
                  "(kvlens.cache.decode_cost); a memory-bound step takes time in proportion. "
                  "fused: the Triton decode kernel reads every layer (CUDA); otherwise those "
                  "layers take the torch path. torch-path unpack: float32 codes the eager CPU "
                  "path writes and reads per step (one chunk at a time).")
    for name, c in rec.decode_cost[:1]:
        for layer, why in sorted(c.unfused.items())[:3]:
            console.print(f"  {escape(name)} layer {layer}: {escape(why)}")
