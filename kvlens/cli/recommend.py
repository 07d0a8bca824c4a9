"""``kvlens recommend``: a per-layer KV quantization config under a memory budget."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli import app
from kvlens.cli.common import (
    console,
    device_map_option,
    err_console,
    max_memory_option,
    offload_folder_option,
    print_json,
    progress_bar,
    run_library_call,
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


@app.command()
def recommend(
    capture: Path = typer.Argument(..., help="Capture file from `kvlens capture`."),
    budget_bits: float = typer.Option(None, "--budget-bits", "-b",
                                      help="Bits per cached K/V element the cache may hold at "
                                           "--context tokens, every part counted (16 = the "
                                           "size of an fp16 cache of the same tokens). "
                                           "Required for --target kvlens."),
    target: str = typer.Option("kvlens", "--target",
                               help="Engine to deploy on: kvlens (a per-layer kvlens config), "
                                    "llama.cpp (one -ctk and one -ctv type), vllm (one "
                                    "--kv-cache-dtype plus skipped layers), sglang (one fp8 "
                                    "dtype), transformers (QuantizedCache nbits/axis/group). "
                                    "docs/deploy/README.md."),
    max_kld: float = typer.Option(None, "--max-kld",
                                  help="Engine targets: the cheapest setting whose predicted "
                                       "KL divergence (fitted on --kld-anchors settings "
                                       "measured on the held-out text) is at most this."),
    kld_anchors: int = typer.Option(3, "--kld-anchors",
                                    help="--max-kld: settings whose KLD is measured to fit "
                                         "the predictor."),
    output: Path = typer.Option(None, "--output", "-o",
                                help="Write the config JSON here (and beside it "
                                     "CONFIG.recommend.json: the choices, memory and --validate "
                                     "results, for `kvlens report`)."),
    context: int = typer.Option(4096, "--context", help="Reference context length for the "
                                                        "budget accounting."),
    residual: int = typer.Option(None, "--residual",
                                 help="One full-precision window for every layer (tokens), as "
                                      "before --windows; not with --windows."),
    windows: str = typer.Option(None, "--windows",
                                help="Full-precision window sizes each layer chooses among "
                                     "(tokens), priced as the cache holds them and measured "
                                     "on the same late queries (default 32,64,128; "
                                     "docs/recommend.md)."),
    flush: int = typer.Option(32, "--flush",
                              help="Sliding window: quantize the oldest N tokens at a time when "
                                   "the window fills (raised to per-channel group sizes); 0 = "
                                   "the whole window at once (KIVI)."),
    sinks: int = typer.Option(4, "--sinks", help="First tokens kept at full precision "
                                                 "(attention sinks)."),
    bits: str = typer.Option("2,4,8", "--bits", help="Candidate bit widths (allowed 2, 3, 4, 8; "
                             "3 measured not to earn, docs/recommend.md)."),
    group_sizes: str = typer.Option("32,64,128", "--group-sizes",
                                    help="Candidate group sizes (per-token ones must divide "
                                         "head_dim; per-channel ones the layer's flush "
                                         "block, so some are skipped at small windows)."),
    key_fits: str = typer.Option("minmax", "--key-fits",
                                 help="How each key group's scale and zero are chosen: minmax "
                                      "(span the group, as KIVI), mse (least-squares refit that "
                                      "clips rare extremes; same storage), or both."),
    value_fits: str = typer.Option("minmax,mse", "--value-fits",
                                   help="The same for values (both measured by default)."),
    window_dtype: str = typer.Option("float16", "--window-dtype",
                                     help="Dtype of the full-precision parts (window, sinks, "
                                          "sets): float16, or float8_e4m3fn at one byte per "
                                          "element (priced; the error proxy reads them exact: "
                                          "measured to pay at 3.0 bits, to cost at 4.0; "
                                          "docs/recommend.md#fp8-windows)."),
    scale_dtype: str = typer.Option("8bit", "--scale-dtype",
                                    help="How each quantization group's scale and zero are "
                                         "stored: 8bit (one byte each: half of float16's "
                                         "metadata, e.g. 0.5 bits per element less for 32-token "
                                         "groups; priced and measured; "
                                         "docs/recommend.md#8-bit-group-metadata) or float16. "
                                         "Default: 8bit (the Triton kernel decodes it)."),
    pre_rope: str = typer.Option("auto", "--pre-rope",
                                 help="Pre-RoPE key candidates: auto (if the capture has RoPE), "
                                      "on (required), off."),
    no_balancer: bool = typer.Option(False, "--no-balancer", help="No balancer candidates."),
    no_rotation: bool = typer.Option(False, "--no-rotation",
                                     help="No Hadamard-rotated (per-token) candidates."),
    no_mikv: bool = typer.Option(False, "--no-mikv",
                                 help="No MiKV importance-set candidates (heavy hitters by "
                                      "accumulated attention, stored at --mikv-bits)."),
    mikv_bits: str = typer.Option("4,8", "--mikv-bits",
                                  help="MiKV set widths to try (allowed: 4, 8); one width and "
                                       "fraction is chosen for the whole config."),
    mikv_fractions: str = typer.Option("0.1,0.2", "--mikv-fractions",
                                       help="MiKV heavy-hitter fractions to try (each in "
                                            "(0, 0.5]; MiKV published 0.2)."),
    exponent: float = typer.Option(0.5, "--balancer-exponent",
                                   help="Balancer b = (max|q|/max|k|)^exponent."),
    samples: int = typer.Option(None, "--samples", min=1,
                                help="Capture samples used to measure errors (default: all "
                                     "of them; engine targets: 1)."),
    tokens: int = typer.Option(None, "--tokens",
                               help="First N tokens of each sample used (default 256 with one "
                                    "window; with several, 4x the largest, of which the last "
                                    "quarter is scored)."),
    sensitivity: str = typer.Option("auto", "--sensitivity",
                                    help="Error weights: layout (measure the KL damage per "
                                         "unit error on the real model, per layer and storage "
                                         "family), model (one weight per layer: faster), "
                                         "uniform, or auto (layout when the capture's model "
                                         "can be loaded)."),
    retrieval: str = typer.Option("auto", "--retrieval",
                                  help="Add errors at the answer position of a built-in "
                                       "long-context retrieval prompt: auto (when the model "
                                       "loads), on, off."),
    retrieval_weight: float = typer.Option(1.0, "--retrieval-weight",
                                           help="Weight of the retrieval errors."),
    prefer_fast: bool = typer.Option(False, "--prefer-fast",
                                     help="Only layouts the fused (Triton) decode kernel reads "
                                          "(no pre-RoPE keys, GEAR or MiKV heavy hitters): every "
                                          "decode step on CUDA stays in the kernel."),
    name: str = typer.Option("recommended", "--name", help="Name stored in the config."),
    validate: bool = typer.Option(False, "--validate",
                                  help="Evaluate the recommendation beside the presets "
                                       f"({', '.join(VALIDATE_PRESETS)}) on the built-in "
                                       "held-out text: KL divergence, top-1 agreement and "
                                       "perplexity vs the exact model, with intervals."),
    eval_tokens: int = typer.Option(None, "--eval-tokens",
                                    help="--validate: tokens of held-out text to score "
                                         "(default 4096, capped by the model's context)."),
    retrieval_prompts: int = typer.Option(0, "--retrieval-prompts",
                                          help="--validate: also run the retrieval grid at "
                                               "1k tokens with this many prompts per task "
                                               "and depth (0 = skip)."),
    model: str = typer.Option(None, "--model", "-m",
                              help="Model for sensitivity and --validate (default: the "
                                   "capture's own model)."),
    device_map: str = device_map_option(),
    max_memory: str = max_memory_option(),
    offload_folder: Path = offload_folder_option(),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --output."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Fit balancers and choose axis/bits/group/pre-RoPE per layer under a memory budget, or
    (--target) the best setting an engine runs, with the exact command to deploy."""
    from kvlens.recommend import DEFAULT_WINDOWS, RecommendOptions, default_tokens
    from kvlens.recommend import recommend as run

    if target != "kvlens":
        from kvlens.cli.targets import run_target

        run_target(capture, target=target, budget_bits=budget_bits, max_kld=max_kld,
                   anchors=kld_anchors, context=context,
                   samples=1 if samples is None else samples,
                   tokens=default_tokens(()) if tokens is None else tokens,
                   rotation=not no_rotation, model=model, output=output,
                   overwrite=overwrite, validate=validate, eval_tokens=eval_tokens,
                   as_json=as_json)
        return

    def prepare():
        from kvlens.errors import InputError

        if output is not None and output.exists() and not overwrite:
            raise InputError(f"{output} already exists; pass --overwrite to replace it.")
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
                                rotation=not no_rotation, mikv=not no_mikv,
                                mikv_set_bits=_ints(mikv_bits, "--mikv-bits"),
                                mikv_fractions=_numbers(mikv_fractions, "--mikv-fractions",
                                                        float, "numbers"),
                                balancer_exponent=exponent, samples=samples,
                                tokens=default_tokens(sizes) if tokens is None else tokens,
                                sensitivity=sensitivity, model=model, name=name,
                                flush_tokens=flush, sink_tokens=sinks, retrieval=retrieval,
                                retrieval_weight=retrieval_weight, prefer_fast=prefer_fast,
                                device_map=device_map, max_memory=max_memory,
                                offload_folder=str(offload_folder) if offload_folder else None)

    opts = run_library_call(prepare)
    with progress_bar("measuring candidates") as update:
        rec = run_library_call(lambda: run(capture, opts, progress=update))
    if output is not None:
        from kvlens.config import save_config

        save_config(rec.config, output)
        err_console.print(f"config written: {output}")
    validation = None
    if validate:
        from kvlens.capture.store import open_capture
        from kvlens.recommend import model_spec_from_capture

        def model_for_validation():
            if model:
                return model
            with open_capture(capture) as cap:
                return model_spec_from_capture(cap.meta)

        validation = run_library_call(lambda: _validate(rec.config, model_for_validation(),
                                                        eval_tokens, retrieval_prompts, opts))
    doc = rec.to_dict()
    doc["deploy"] = {"target": "kvlens", "command": "kvlens generate --config "
                     f"{output or 'kv.json'} --prompt ...",
                     "config": str(output) if output else None}
    if validation is not None:
        doc["validation"] = validation["results"]
        doc["validation_evaluation"] = validation["evaluation"]
    if output is not None:
        from kvlens.report.artifacts import write_config_doc

        data = write_config_doc("recommend", doc, output)
        err_console.print(f"results for `kvlens report` written: {data}")
    if as_json:
        print_json(doc)
        return
    _render(rec)
    if validation is not None:
        from kvlens.cli.generate import _render_long

        _render_long(validation)


def _validate(config, model, eval_tokens: int | None, retrieval_prompts: int, ropts=None):
    """The recommendation and the presets, scored against the exact model on the held-out text
    (``kvlens.evaluation``: nothing `recommend` calibrates on)."""
    from kvlens.config import preset, validate_for
    from kvlens.errors import ConfigError
    from kvlens.evaluation import EvalOptions, evaluate_configs
    from kvlens.model.architecture import describe
    from kvlens.model.load import load_model

    err_console.print(f"Validating on {model or 'SmolLM2-135M-Instruct (embedded)'} ...")
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
            err_console.print(f"  skipping preset {name}: {exc}")
            continue
        configs.append(preset(name))
    evals = ("kld", "retrieval") if retrieval_prompts else ("kld",)
    opts = EvalOptions(evals=evals, eval_tokens=eval_tokens,
                       retrieval_prompts=max(retrieval_prompts, 1), retrieval_lengths=(1024,))
    report = evaluate_configs(mdl, tok, configs, opts,
                              progress=lambda msg: err_console.print(f"  {msg}"))
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
        t.add_row(str(layer), f"{rec.weights[layer]:.2f}", k.candidate.short, f"{k.bits:.2f}",
                  f"{k.output_error:.3f}", v.candidate.short, f"{v.bits:.2f}",
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
        console.print(f"note: {note}")


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
        t.add_row(name, f"{c.read_bytes / 2**20:.1f} MiB", f"{c.ratio_fp16:.3f}", fused,
                  f"{c.torch_unpack_bytes / 2**20:.1f} MiB")
    console.print(t)
    console.print("read: codes, scales/zeros, the filled window, sink copies, positions "
                  "(kvlens.cache.decode_cost); a memory-bound step takes time in proportion. "
                  "fused: the Triton decode kernel reads every layer (CUDA); otherwise those "
                  "layers take the torch path. torch-path unpack: float32 codes the eager CPU "
                  "path writes and reads per step (one chunk at a time).")
    for name, c in rec.decode_cost[:1]:
        for layer, why in sorted(c.unfused.items())[:3]:
            console.print(f"  {name} layer {layer}: {why}")
