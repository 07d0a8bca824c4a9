"""``kvlens recommend``: a per-layer KV quantization config under a memory budget."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvlens.cli import app
from kvlens.cli.common import (
    BUDGET,
    ENGINE,
    INPUT,
    MEASUREMENT,
    MODEL,
    OUTPUT,
    VALIDATION,
    check_model_options,
    console,
    device_map_option,
    err_console,
    escape,
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
)

VALIDATE_PRESETS = ("kivi-2", "kivi-4", "per-token-4")


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(spec: str, what: str) -> tuple[int, ...]:
    return _numbers(spec, what, int, "integers")


def _numbers(spec: str, what: str, kind, words: str) -> tuple:
    from kvlens.errors import InputError

    try:
        return tuple(kind(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InputError(f"Invalid {what} {spec!r}; expected a comma list of {words}.") from None


# Options only the per-layer kvlens recommendation reads: refused with --target ENGINE.
KVLENS_ONLY = ("residual", "windows", "flush", "sinks", "bits", "group_sizes", "key_fits",
               "value_fits", "window_dtype", "scale_dtype", "pre_rope", "no_balancer",
               "exponent", "thorough", "no_mikv", "mikv_bits", "mikv_fractions", "sensitivity",
               "retrieval", "retrieval_weight", "prefer_fast", "name", "retrieval_prompts",
               "workers", "layout_layers", "layout_tokens", "codebooks", "centering",
               "remeasure")
TARGET_ONLY = ("max_kld", "kld_anchors")  # refused without --target ENGINE
PLACEMENT = ("device_map", "max_memory", "offload_folder")


@app.command()
def recommend(
    ctx: typer.Context,
    capture: Path = typer.Argument(..., help="Capture file from `kvlens capture`."),
    samples: int = typer.Option(None, "--samples", min=1, rich_help_panel=INPUT,
                                help="Capture samples used to measure errors (default: all "
                                     "of them; engine targets: 1)."),
    tokens: int = typer.Option(None, "--tokens", rich_help_panel=INPUT,
                               help="First N tokens of each sample used (default 256 with one "
                                    "window; with several, 4x the largest, of which the last "
                                    "quarter is scored)."),
    budget_bits: float = typer.Option(None, "--budget-bits", "-b", rich_help_panel=BUDGET,
                                      help="Bits per cached K/V element the cache may hold at "
                                           "--context tokens, every part counted (16 = the "
                                           "size of an fp16 cache of the same tokens). "
                                           "Required for --target kvlens."),
    context: int = typer.Option(4096, "--context", rich_help_panel=BUDGET,
                                help="Reference context length for the budget accounting."),
    residual: int = typer.Option(None, "--residual", rich_help_panel=BUDGET,
                                 help="One full-precision window for every layer (tokens); "
                                      "not with --windows."),
    windows: str = typer.Option(None, "--windows", rich_help_panel=BUDGET,
                                help="Full-precision window sizes each layer chooses among "
                                     "(tokens), priced as the cache holds them and measured "
                                     "on the same late queries (default 32,64,128; "
                                     "docs/recommend.md)."),
    flush: int = typer.Option(32, "--flush", rich_help_panel=BUDGET,
                              help="Sliding window: quantize the oldest N tokens at a time when "
                                   "the window fills (raised to per-channel group sizes); 0 = "
                                   "the whole window at once (KIVI)."),
    sinks: int = typer.Option(4, "--sinks", rich_help_panel=BUDGET,
                              help="First tokens kept at full precision (attention sinks)."),
    bits: str = typer.Option("2,4,8", "--bits", rich_help_panel=BUDGET,
                             help="Candidate bit widths (allowed 2, 3, 4, 8; "
                                  "docs/recommend.md)."),
    group_sizes: str = typer.Option("32,64,128", "--group-sizes", rich_help_panel=BUDGET,
                                    help="Candidate group sizes (per-token ones must divide "
                                         "head_dim; per-channel ones the layer's flush "
                                         "block, so some are skipped at small windows)."),
    key_fits: str = typer.Option("minmax", "--key-fits", rich_help_panel=BUDGET,
                                 help="How each key group's scale and zero are chosen: minmax "
                                      "(span the group, as KIVI), mse (least-squares refit that "
                                      "clips rare extremes; same storage), or both."),
    value_fits: str = typer.Option("minmax,mse", "--value-fits", rich_help_panel=BUDGET,
                                   help="The same for values."),
    window_dtype: str = typer.Option("float16", "--window-dtype", rich_help_panel=BUDGET,
                                     help="Dtype of the full-precision parts (window, sinks, "
                                          "sets): float16, or float8_e4m3fn at one byte per "
                                          "element (priced; the error proxy reads them exact; "
                                          "docs/recommend.md#fp8-windows)."),
    scale_dtype: str = typer.Option("8bit", "--scale-dtype", rich_help_panel=BUDGET,
                                    help="How each quantization group's scale and zero are "
                                         "stored: 8bit (one byte each, priced and measured; "
                                         "the Triton kernel decodes it; "
                                         "docs/recommend.md#8-bit-group-metadata) or float16."),
    pre_rope: str = typer.Option("auto", "--pre-rope", rich_help_panel=BUDGET,
                                 help="Pre-RoPE key candidates: auto (if the capture has RoPE), "
                                      "on (required), off."),
    no_balancer: bool = typer.Option(False, "--no-balancer", rich_help_panel=BUDGET,
                                     help="No balancer candidates."),
    exponent: float = typer.Option(0.5, "--balancer-exponent", rich_help_panel=BUDGET,
                                   help="Balancer b = (max|q|/max|k|)^exponent."),
    no_rotation: bool = typer.Option(False, "--no-rotation", rich_help_panel=BUDGET,
                                     help="No Hadamard-rotated (per-token) candidates (engine "
                                          "targets: llama.cpp without its rotation)."),
    codebooks: bool = typer.Option(False, "--codebooks", rich_help_panel=BUDGET,
                                   help="Also codebook key and value candidates (2- and 3-bit "
                                        "fitted codebooks of rotated vectors with a norm per "
                                        "vector; keys post-RoPE, centred with --centering; "
                                        "docs/codebooks.md; not with --no-rotation)."),
    centering: bool = typer.Option(False, "--centering", rich_help_panel=BUDGET,
                                   help="Offer the per-token (and codebook) key candidates "
                                        "centred instead of plain: the layer's mean key, "
                                        "computed on the capture, "
                                        "subtracted before quantizing, stored in the config and "
                                        "added back on read (docs/codebooks.md)."),
    thorough: bool = typer.Option(False, "--thorough", rich_help_panel=BUDGET,
                                  help="The full search: also GEAR twins and MiKV "
                                       "importance-set candidates (heavy hitters by accumulated "
                                       "attention, stored at --mikv-bits). Several times "
                                       "slower; the default search leaves them out."),
    no_mikv: bool = typer.Option(False, "--no-mikv", rich_help_panel=BUDGET,
                                 help="With --thorough: no MiKV importance-set candidates."),
    mikv_bits: str = typer.Option("4,8", "--mikv-bits", rich_help_panel=BUDGET,
                                  help="MiKV set widths to try (allowed: 4, 8); one width and "
                                       "fraction is chosen for the whole config."),
    mikv_fractions: str = typer.Option("0.1,0.2", "--mikv-fractions", rich_help_panel=BUDGET,
                                       help="MiKV heavy-hitter fractions to try (each in "
                                            "(0, 0.5])."),
    prefer_fast: bool = typer.Option(False, "--prefer-fast", rich_help_panel=BUDGET,
                                     help="Only layouts the fused (Triton) decode kernel reads "
                                          "(no pre-RoPE keys, GEAR or MiKV heavy hitters): every "
                                          "decode step on CUDA stays in the kernel."),
    sensitivity: str = typer.Option("auto", "--sensitivity", rich_help_panel=MEASUREMENT,
                                    help="Error weights: layout (measure the KL damage per "
                                         "unit error on the real model, per layer and storage "
                                         "family), model (one weight per layer: faster), "
                                         "uniform, or auto (layout when the capture's model "
                                         "can be loaded)."),
    retrieval: str = typer.Option("auto", "--retrieval", rich_help_panel=MEASUREMENT,
                                  help="Add errors at the answer position of a built-in "
                                       "long-context retrieval prompt: auto (when the model "
                                       "loads), on, off."),
    retrieval_weight: float = typer.Option(1.0, "--retrieval-weight",
                                           rich_help_panel=MEASUREMENT,
                                           help="Weight of the retrieval errors."),
    layout_layers: int = typer.Option(None, "--layout-layers", min=1,
                                      rich_help_panel=MEASUREMENT,
                                      help="Layout sensitivity: measure every storage family on "
                                           "this many layers spread over the depth and two "
                                           "anchor families on the others, sharing each "
                                           "family's ratio to its anchor (faster; default: every "
                                           "family on every layer)."),
    layout_tokens: int = typer.Option(None, "--layout-tokens", min=1,
                                      rich_help_panel=MEASUREMENT,
                                      help="Layout sensitivity: tokens of its model forwards "
                                           "(the capture's first sample, KL on the last half; "
                                           "above the largest window). Fewer is faster; "
                                           "default: --tokens."),
    workers: int = typer.Option(None, "--workers", min=1, rich_help_panel=MEASUREMENT,
                                help="Processes the per-layer measurement runs on (default: "
                                     "every free core when the measurement is long, else 1; "
                                     "the same numbers either way, up to float rounding in "
                                     "the layout sensitivity's model runs)."),
    remeasure: bool = typer.Option(False, "--remeasure", rich_help_panel=MEASUREMENT,
                                   help="Measure again even where an earlier run on this "
                                        "capture with the same measuring options kept its "
                                        "measurement (any budget, context, --window-dtype and "
                                        "--name reuse it; KVLENS_MEASUREMENT_CACHE=off keeps "
                                        "none; docs/recommend.md#time)."),
    target: str = typer.Option("kvlens", "--target", rich_help_panel=ENGINE,
                               help="Engine to deploy on: kvlens (a per-layer kvlens config), "
                                    "llama.cpp (one -ctk and one -ctv type), vllm (one "
                                    "--kv-cache-dtype plus skipped layers), sglang (one fp8 "
                                    "dtype), transformers (QuantizedCache nbits/axis/group). "
                                    "An engine target takes only --budget-bits/--max-kld, "
                                    "--context, --samples, --tokens, --no-rotation, the model, "
                                    "validation and output options. docs/deploy/README.md."),
    max_kld: float = typer.Option(None, "--max-kld", rich_help_panel=ENGINE,
                                  help="Engine targets: the cheapest setting whose predicted "
                                       "KL divergence (fitted on --kld-anchors settings "
                                       "measured on the held-out text) is at most this."),
    kld_anchors: int = typer.Option(3, "--kld-anchors", rich_help_panel=ENGINE,
                                    help="With --max-kld: settings whose KLD is measured to fit "
                                         "the predictor."),
    model: str = typer.Option(None, "--model", "-m", rich_help_panel=MODEL,
                              help="Model for sensitivity, the retrieval probe, --max-kld and "
                                   "--validate (default: the capture's own model). A model "
                                   "given here must load."),
    device_map: str = device_map_option(),
    max_memory: str = max_memory_option(),
    offload_folder: Path = offload_folder_option(),
    validate: bool = typer.Option(False, "--validate", rich_help_panel=VALIDATION,
                                  help="Evaluate the recommendation beside the presets "
                                       f"({', '.join(VALIDATE_PRESETS)}) on the built-in "
                                       "held-out text: KL divergence, top-1 agreement and "
                                       "perplexity vs the exact model, with intervals."),
    eval_tokens: int = typer.Option(None, "--eval-tokens", rich_help_panel=VALIDATION,
                                    help="Tokens of held-out text scored by --validate and by "
                                         "--max-kld's anchors (default: 4096, capped by the "
                                         "model's context)."),
    retrieval_prompts: int = typer.Option(0, "--retrieval-prompts", rich_help_panel=VALIDATION,
                                          help="With --validate: also run the retrieval grid at "
                                               "1k tokens with this many prompts per task "
                                               "and depth (0 = skip)."),
    output: Path = typer.Option(None, "--output", "-o", rich_help_panel=OUTPUT,
                                help="Write the config JSON here (and beside it "
                                     "CONFIG.recommend.json, or CONFIG.deploy.json and an "
                                     "engine's kv_scales.json: the results for `kvlens "
                                     "report`)."),
    name: str = typer.Option("recommended", "--name", rich_help_panel=OUTPUT,
                             help="Name stored in the config."),
    overwrite: bool = overwrite_option(),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT,
                                 help="Print the result as JSON on stdout."),
) -> None:
    """Fit balancers and choose axis/bits/group/pre-RoPE per layer under a memory budget, or
    (--target) the best setting an engine runs, with the exact command to deploy.

    Every option given is used or refused before any measurement starts."""
    from kvlens.recommend import DEFAULT_WINDOWS, RecommendOptions, choose, default_tokens, measure
    from kvlens.recommend.reuse import keep, kept_file, read_kept, reused_note

    engine = target != "kvlens"
    given = given_options(ctx, KVLENS_ONLY + TARGET_ONLY + PLACEMENT +
                          ("model", "eval_tokens"))

    def check_common() -> None:
        """The checks both paths share, cheapest first: option combinations, the output
        files, the capture, the model and its placement."""
        from kvlens.capture.store import open_capture
        from kvlens.model.placement import make_placement
        from kvlens.report.artifacts import check_output_file, config_doc_path

        _check_combinations(target, given, sensitivity=sensitivity, retrieval=retrieval,
                            validate=validate, max_kld=max_kld, no_mikv=no_mikv,
                            no_balancer=no_balancer, thorough=thorough)
        if output is not None:
            check_output_file(output, "--output", overwrite, example="kv.json")
            kind = "deploy" if engine else "recommend"
            check_output_file(config_doc_path(output, kind), "--output", overwrite)
            if target in ("vllm", "sglang"):
                check_output_file(output.parent / "kv_scales.json", "--output", overwrite)
        with open_capture(capture):
            pass  # a missing, foreign or incomplete capture fails here, before any work
        if model is not None:
            check_model_options(model, device="cpu", device_map=device_map,
                                max_memory=max_memory, offload_folder=offload_folder)
        else:
            make_placement(device_map, max_memory,
                           str(offload_folder) if offload_folder else None)

    run_library_call(check_common)
    place = {"device_map": device_map, "max_memory": max_memory,
             "offload_folder": str(offload_folder) if offload_folder else None}
    if engine:
        from kvlens.cli.targets import run_target

        run_target(capture, target=target, budget_bits=budget_bits, max_kld=max_kld,
                   anchors=kld_anchors, context=context,
                   samples=1 if samples is None else samples,
                   tokens=default_tokens(()) if tokens is None else tokens,
                   rotation=not no_rotation, model=model, place=place, output=output,
                   validate=validate, eval_tokens=eval_tokens, as_json=as_json)
        return

    def prepare():
        from kvlens.errors import InputError

        if budget_bits is None:
            raise InputError("--budget-bits is required for --target kvlens (engine targets "
                             "also take --max-kld).")
        if residual is not None and windows is not None:
            raise InputError("--residual R is one window for every layer and --windows a list "
                             "each layer chooses from; give one of them.")
        sizes = (_ints(windows, "--windows") if windows is not None else
                 (residual,) if residual is not None else DEFAULT_WINDOWS)
        return RecommendOptions(budget_bits=budget_bits, context=context,
                                residual_tokens=max(sizes, default=128), windows=sizes,
                                bits=_ints(bits, "--bits"),
                                group_sizes=_ints(group_sizes, "--group-sizes"),
                                key_fits=_words(key_fits), value_fits=_words(value_fits),
                                fp_dtype=window_dtype, scale_dtype=scale_dtype,
                                pre_rope=pre_rope, balancer=not no_balancer,
                                rotation=not no_rotation, mikv=thorough and not no_mikv,
                                gear=thorough, codebooks=codebooks, centering=centering,
                                mikv_set_bits=_ints(mikv_bits, "--mikv-bits"),
                                mikv_fractions=_numbers(mikv_fractions, "--mikv-fractions",
                                                        float, "numbers"),
                                balancer_exponent=exponent, samples=samples,
                                tokens=default_tokens(sizes) if tokens is None else tokens,
                                sensitivity=sensitivity, model=model, name=name,
                                flush_tokens=flush, sink_tokens=sinks, retrieval=retrieval,
                                retrieval_weight=retrieval_weight, prefer_fast=prefer_fast,
                                workers=workers, layout_layers=layout_layers,
                                layout_tokens=layout_tokens, **place)

    opts = run_library_call(prepare)
    kept = run_library_call(lambda: kept_file(capture, opts))
    measured = None if remeasure else run_library_call(lambda: read_kept(kept))
    if measured is not None:
        err_console.print(escape(reused_note(kept)), highlight=False)
        predicted = None
    else:
        predicted = run_library_call(lambda: _predict(capture, opts))
        with progress_bar("measuring candidates") as update:
            measured = run_library_call(lambda: measure(capture, opts, progress=update))
        keep(measured, kept)
    rec = run_library_call(lambda: choose(measured, opts))
    if output is not None:
        from kvlens.config import save_config

        run_library_call(lambda: write_output(output, lambda tmp: save_config(rec.config, tmp)))
        err_console.print(f"config written: {escape(str(output))}")
    validation = None
    if validate:
        from kvlens.capture.store import open_capture
        from kvlens.recommend import model_spec_from_capture

        def model_for_validation():
            if model:
                return model
            with open_capture(capture) as cap:
                return model_spec_from_capture(cap.meta)

        start = time.perf_counter()
        validation = run_library_call(lambda: _validate(rec.config, model_for_validation(),
                                                        eval_tokens, retrieval_prompts, opts))
        rec.profile.add("validation", time.perf_counter() - start)
    _print_profile(rec.profile, predicted)
    doc = rec.to_dict()
    doc["profile"]["predicted"] = predicted.to_dict() if predicted is not None else None
    doc["deploy"] = {"target": "kvlens", "command": "kvlens generate --config "
                     f"{output or 'kv.json'} --prompt ...",
                     "config": str(output) if output else None}
    if validation is not None:
        doc["validation"] = validation["results"]
        doc["validation_evaluation"] = validation["evaluation"]
    if output is not None:
        data = run_library_call(lambda: write_config_doc("recommend", doc, output))
        err_console.print(f"results for `kvlens report` written: {escape(str(data))}")
    if as_json:
        print_json(doc)
        return
    _render(rec)
    if validation is not None:
        from kvlens.cli.generate import _render_long

        _render_long(validation)


def _predict(capture: Path, opts):
    """Print (stderr) and return what the measurement is predicted to cost."""
    from kvlens.capture.store import open_capture
    from kvlens.recommend.pipeline import predict_cost

    with open_capture(capture) as cap:
        cost = predict_cost(cap.meta, opts)
    err_console.print(f"predicted: about {format_seconds(cost.seconds)} and {cost.peak_bytes / 2**30:.1f}"
                      " GiB peak memory (the reference machine's times x "
                      f"{cost.machine_factor:.2f}, this machine's speed from a timed matrix "
                      "product; kvlens.recommend.cost)", highlight=False)
    return cost


def _print_profile(profile, predicted) -> None:
    """Where the time went (stderr), stage by stage, beside the prediction (None: nothing was
    predicted, the measurement was reused)."""
    parts = ", ".join(f"{name} {format_seconds(sec)}" for name, sec in
                      sorted(profile.stages.items(), key=lambda kv: -kv[1]) if sec >= 0.05)
    said = "" if predicted is None else f", predicted {format_seconds(predicted.seconds)}"
    err_console.print(f"time by stage ({format_seconds(profile.total)} in all{said}): {parts}",
                      highlight=False)


def _check_combinations(target: str, given: dict[str, str], *, sensitivity: str,
                        retrieval: str, validate: bool, max_kld, no_mikv: bool,
                        no_balancer: bool, thorough: bool = False) -> None:
    """Refuse options that this combination would not read (never drop one silently).
    ``given``: the options the user gave, parameter name -> flag."""
    from kvlens.errors import InputError

    def flags(names) -> str:
        return ", ".join(given[n] for n in names if n in given)

    def _them(names) -> str:
        return "them" if sum(n in given for n in names) > 1 else "it"

    engine = target != "kvlens"
    if engine:
        if flags(KVLENS_ONLY):
            raise InputError(f"{flags(KVLENS_ONLY)}: not used by --target {target} (options "
                             "of the per-layer kvlens recommendation); drop "
                             f"{_them(KVLENS_ONLY)}, or use --target kvlens.")
        if "kld_anchors" in given and max_kld is None:
            raise InputError("--kld-anchors sets how many settings fit the --max-kld "
                             "predictor; give --max-kld too, or drop it.")
        needs_model = max_kld is not None or validate
        why = "--max-kld or --validate"
    else:
        if flags(TARGET_ONLY):
            raise InputError(f"{flags(TARGET_ONLY)}: only for an engine target (--target "
                             "llama.cpp, vllm, sglang or transformers); the kvlens target "
                             "takes --budget-bits.")
        if not thorough and flags(("no_mikv", "mikv_bits", "mikv_fractions")):
            raise InputError(f"{flags(('no_mikv', 'mikv_bits', 'mikv_fractions'))}: MiKV "
                             "candidates are offered only by the full search; add --thorough "
                             "or drop it.")
        if no_mikv and flags(("mikv_bits", "mikv_fractions")):
            raise InputError(f"{flags(('mikv_bits', 'mikv_fractions'))}: describe MiKV "
                             "candidates, which --no-mikv removes; give one or the other.")
        if no_balancer and "exponent" in given:
            raise InputError("--balancer-exponent shapes balancer candidates, which "
                             "--no-balancer removes; give one or the other.")
        if sensitivity in ("uniform", "model") and flags(("layout_layers", "layout_tokens")):
            raise InputError(f"{flags(('layout_layers', 'layout_tokens'))}: shape the layout "
                             f"sensitivity, which --sensitivity {sensitivity} does not run; "
                             f"use --sensitivity layout or auto, or drop "
                             f"{_them(('layout_layers', 'layout_tokens'))}.")
        if retrieval == "off" and "retrieval_weight" in given:
            raise InputError("--retrieval-weight weighs the retrieval probe, which --retrieval "
                             "off skips; give one or the other.")
        if "retrieval_prompts" in given and not validate:
            raise InputError("--retrieval-prompts applies to --validate; add --validate or "
                             "drop it.")
        needs_model = sensitivity != "uniform" or retrieval != "off" or validate
        why = "--sensitivity other than uniform, --retrieval other than off, or --validate"
    if "eval_tokens" in given and not (validate or (engine and max_kld is not None)):
        raise InputError("--eval-tokens sets the held-out tokens scored by --validate"
                         + (" or --max-kld" if engine else "") + "; add that option or drop it.")
    loaders = flags(("model",) + PLACEMENT)
    if loaders and not needs_model:
        raise InputError(f"{loaders}: no model is loaded here (only with {why}); drop "
                         f"{_them(('model',) + PLACEMENT)}.")


def _validate(config, model, eval_tokens: int | None, retrieval_prompts: int, ropts=None):
    """The recommendation and the presets, scored against the exact model on the held-out text
    (``kvlens.evaluation``: nothing `recommend` calibrates on)."""
    from kvlens.config import preset, validate_for
    from kvlens.errors import ConfigError
    from kvlens.evaluation import EvalOptions, evaluate_configs
    from kvlens.model.architecture import describe
    from kvlens.model.load import load_model

    err_console.print(f"Validating on {escape(model or 'SmolLM2-135M-Instruct (embedded)')} ...")
    place = {} if ropts is None else {"device_map": ropts.device_map,
                                      "max_memory": ropts.max_memory,
                                      "offload_folder": ropts.offload_folder}
    mdl, tok, _ = load_model(model, **place)
    validate_for(config, describe(mdl))
    configs = [config]
    for name in VALIDATE_PRESETS:
        try:
            validate_for(preset(name), describe(mdl))
        except ConfigError as exc:  # e.g. G=32 presets on a head_dim-16 model
            err_console.print(f"  skipping preset {name}: {escape(str(exc))}")
            continue
        configs.append(preset(name))
    evals = ("kld", "retrieval") if retrieval_prompts else ("kld",)
    opts = EvalOptions(evals=evals, eval_tokens=eval_tokens,
                       retrieval_prompts=max(retrieval_prompts, 1), retrieval_lengths=(1024,))
    report = evaluate_configs(mdl, tok, configs, opts,
                              progress=lambda msg: err_console.print(f"  {escape(msg)}"))
    return {**report, "options": opts}


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
    for layer, pair in sorted(by_layer.items()):
        k, v = pair["key"], pair["value"]
        t.add_row(str(layer), f"{rec.weights[layer]:.2f}", escape(k.candidate.short), f"{k.bits:.2f}",
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
        m.add_row(f"{ctx:,}", f"{b / 2**20:.1f} MiB", f"{f / 2**20:.1f} MiB", f"{f / b:.2f}x")
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
        t.add_row(escape(name), f"{c.read_bytes / 2**20:.1f} MiB", f"{c.ratio_fp16:.3f}", fused,
                  f"{c.torch_unpack_bytes / 2**20:.1f} MiB")
    console.print(t)
    console.print("read: codes, scales/zeros, the filled window, sink copies, positions "
                  "(kvlens.cache.decode_cost); a memory-bound step takes time in proportion. "
                  "fused: the Triton decode kernel reads every layer (CUDA); otherwise those "
                  "layers take the torch path. torch-path unpack: float32 codes the eager CPU "
                  "path writes and reads per step (one chunk at a time).")
    for name, c in rec.decode_cost[:1]:
        for layer, why in sorted(c.unfused.items())[:3]:
            console.print(f"  {escape(name)} layer {layer}: {escape(why)}")
