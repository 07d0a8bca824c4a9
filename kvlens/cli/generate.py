"""``kvlens generate``: real generation with the compressed KV cache, and what it loses."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    CACHES,
    EVALUATION,
    INPUT,
    OUTPUT,
    LibraryDefaults,
    console,
    err_console,
    escape,
    given_options,
    new_table,
    print_json,
    read_with,
    refuse_unread,
    run_library_call,
    shared_option,
    write_artifact_output,
)
from kvlens.units import format_bytes, format_bytes_by_device, format_interval

# The options only some evaluations read (refuse_unread): given without any of them, refused.
READ_BY = {"text": read_with("--eval", "kld", "ppl"), "ppl_tokens": read_with("--eval", "ppl"),
           "passkey_prompts": read_with("--eval", "passkey"),
           "passkey_context": read_with("--eval", "passkey"),
           "seed": read_with("--eval", "passkey", "retrieval"),
           "eval_tokens": read_with("--eval", "kld"), "chunk": read_with("--eval", "kld"),
           "frontier": read_with("--eval", "kld"),  # it draws each setting's mean KLD
           "retrieval_prompts": read_with("--eval", "retrieval"),
           "retrieval_lengths": read_with("--eval", "retrieval")}


class _GenerateHelp(LibraryDefaults):
    """--help shows the evaluation options' defaults from ``EvalOptions`` and ends with what the
    help of --preset and --compare calls "the grammar above": the one definition in
    kvlens.config.engine, added when the help is shown (its import loads torch, which
    ``kvlens --help`` does not)."""

    def library_options(self) -> tuple[type, ...]:
        from kvlens.evaluation.options import EvalOptions

        return (EvalOptions,)

    def format_help(self, ctx, formatter) -> None:
        from kvlens.config.engine import setting_grammar

        if not getattr(self, "_appended", False):
            grammar = "Engine settings (docs/deploy/README.md):\n" + setting_grammar()
            self.help = f"{self.help or ''}\n\n{escape(grammar)}"
            self._appended = True
        super().format_help(ctx, formatter)


@app.command(cls=_GenerateHelp)
def generate(
    ctx: typer.Context,
    config: Path = typer.Option(None, "--config", rich_help_panel=CACHES,
                                help="KV config JSON (as `recommend` writes)."),
    preset_name: str = typer.Option(None, "--preset", rich_help_panel=CACHES,
                                    help="exact, fp16, kivi-2, kivi-4, per-token-2, "
                                         "per-token-4, kivi-2-sinks, kivi-2-rot, "
                                         "per-token-2-rot, per-token-4-rot, kivi-2-prerope "
                                         "(research presets: docs/lab-notes/); or an engine "
                                         "setting (grammar above)."),
    compare: str = typer.Option(None, "--compare", rich_help_panel=CACHES,
                                help="Comma list run side by side on the same inputs: presets "
                                     "(see --preset), config files, engine settings (grammar "
                                     "above) and transformers' real caches: hf-fp8, hf- + a "
                                     "transformers: setting (hf-quanto-4, hf-hqq-4:axis_key=1), "
                                     "hf-layers:FILE (a recommend export)."),
    calibration: Path = typer.Option(None, "--calibration", rich_help_panel=CACHES,
                                     help="Capture file (kvlens capture) for the static fp8 "
                                          "scales of vllm:/sglang: settings (default: the "
                                          "engines' scale 1.0)."),
    backend: str = typer.Option(None, "--backend", rich_help_panel=CACHES,
                                help="auto, torch or triton."),
    prompt: str = typer.Option(None, "--prompt", rich_help_panel=INPUT,
                               help="Prompt to continue."),
    prompt_file: Path = typer.Option(None, "--prompt-file", rich_help_panel=INPUT,
                                     help="UTF-8 file with the prompt."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       rich_help_panel=INPUT,
                                       help="Tokens to generate."),
    text: Path = typer.Option(None, "--text", rich_help_panel=INPUT,
                              help="Text for kld and ppl (default: the built-in held-out text; "
                                   "builtin:corpus for the capture corpus)."),
    evals: str = typer.Option(None, "--eval", rich_help_panel=EVALUATION,
                              help="Comma list: kld (long-context KL divergence, top-1 and ppl "
                                   "vs the exact model), retrieval (passkey + key-value grid); "
                                   "short-context checks: ppl, passkey, agreement."),
    eval_tokens: int = typer.Option(None, "--eval-tokens", min=2,
                                    rich_help_panel=EVALUATION,
                                    help="kld: tokens of text to score (default: 4096, capped by "
                                         "the model's context)."),
    chunk: int = typer.Option(None, "--chunk", min=1, rich_help_panel=EVALUATION,
                              help="kld: tokens per forward call (1 = decode mode)."),
    retrieval_prompts: int = typer.Option(None, "--retrieval-prompts", min=1,
                                          rich_help_panel=EVALUATION,
                                          help="retrieval: prompts per task, length and depth "
                                               "(raise for tighter intervals)."),
    retrieval_lengths: str = typer.Option(None, "--retrieval-lengths",
                                          rich_help_panel=EVALUATION,
                                          help="retrieval: comma list of prompt lengths in "
                                               "tokens (default 1024,2048,4096 where they fit)."),
    ppl_tokens: int = typer.Option(None, "--ppl-tokens", min=40,
                                   rich_help_panel=EVALUATION,
                                   help="ppl: tokens of text (short-context check)."),
    passkey_prompts: int = typer.Option(None, "--passkey-prompts", min=1,
                                        rich_help_panel=EVALUATION,
                                        help="passkey: prompts (short-context check)."),
    passkey_context: int = typer.Option(None, "--passkey-context", min=64,
                                        rich_help_panel=EVALUATION,
                                        help="passkey: approximate tokens per prompt."),
    seed: int = typer.Option(None, "--seed", rich_help_panel=EVALUATION,
                             help="Seed for passkey and retrieval prompts."),
    model: str = shared_option("model"),
    dtype: str = shared_option("dtype"),
    device: str = shared_option("device"),
    device_map: str = shared_option("device_map"),
    max_memory: str = shared_option("max_memory"),
    offload_folder: Path = shared_option("offload_folder"),
    as_json: bool = shared_option("as_json", "the results"),
    report_json: Path = typer.Option(None, "--report-json", rich_help_panel=OUTPUT,
                                     help="Also write the results as JSON to this file "
                                          "(e.g. out/eval.generate.json; read by `kvlens "
                                          "report`)."),
    frontier: Path = typer.Option(None, "--frontier", rich_help_panel=OUTPUT,
                                  help="Also draw each setting's bits held against its mean "
                                       "KLD, with the Pareto front, to this PNG or SVG file "
                                       "(needs --eval kld)."),
    overwrite: bool = shared_option("overwrite"),
) -> None:
    """Generate with a compressed KV cache and measure what it loses against the exact model.

    Examples:

      kvlens generate --preset kivi-2 --prompt "The capital of France is"
      kvlens generate --compare fp16,llamacpp:q8_0/q4_0,kivi-2 --eval kld
      kvlens generate --config out/kv.json --eval kld,retrieval

    --eval kld scores a long held-out text (KL divergence, top-1 agreement, perplexity with bootstrap intervals and paired comparisons); --eval retrieval runs a passkey and key-value grid over lengths and depths (docs/evaluation.md). Ctrl-C prints what was finished and exits with code 130.
    """
    given = given_options(ctx, (*READ_BY, "calibration", "overwrite"))

    def prepare():
        from dataclasses import fields

        from kvlens.deploy.generate import generate_request
        from kvlens.errors import InputError
        from kvlens.evaluation import parse_evals
        from kvlens.evaluation.options import EvalOptions, parse_lengths
        from kvlens.plots.frontier import FORMATS
        from kvlens.report.artifacts import check_output_file

        names = parse_evals(evals)
        refuse_unread(READ_BY, given, names)
        request = generate_request(
            {f.name: ctx.params[f.name] for f in fields(EvalOptions)
             if ctx.params.get(f.name) is not None}
            | {"evals": names, "text": str(text) if text else None,
               "retrieval_lengths": parse_lengths(retrieval_lengths)},
            config=config, preset=preset_name, compare=compare, calibration=calibration,
            prompt_file=prompt_file, model=model,
            place={"dtype": dtype, "device": device, "device_map": device_map,
                   "max_memory": max_memory,
                   "offload_folder": str(offload_folder) if offload_folder else None})
        check_output_file(report_json, "--report-json", overwrite)
        if frontier is not None and Path(frontier).suffix.lower() not in FORMATS:
            raise InputError(f"--frontier {frontier}: the chart is written as PNG or SVG; name a "
                             f"{' or '.join(FORMATS)} file, e.g. out/frontier.png.")
        check_output_file(frontier, "--frontier", overwrite, example="out/frontier.png")
        return request

    request = run_library_call(prepare)
    opts = request.options

    def run():
        from kvlens.deploy.generate import generate_run

        return generate_run(request, say=lambda msg: err_console.print(escape(msg),
                                                                       highlight=False),
                            progress=lambda msg: err_console.print(f"  {escape(msg)}"))

    report = run_library_call(run)
    front = None
    if "kld" in report["evaluation"]:  # every setting kld scored, and its Pareto front
        from kvlens.evaluation.frontier import frontier_doc, points_from_results

        front = frontier_doc(points_from_results(report["results"], request.settings.kinds))
    # --json's document; the file for `kvlens report` leaves out the placement
    doc = {k: report[k] for k in ("results", "evaluation", "placement", "interrupted")} | (
        {} if front is None else {"frontier": front})
    if report_json is not None:
        run_library_call(lambda: write_artifact_output(
            "generate", {k: v for k, v in doc.items() if k != "placement"}, report_json))
        err_console.print(f"results written: {escape(str(report_json))}")
    if frontier is not None and front is not None:
        run_library_call(lambda: _draw_frontier(front, report, model, frontier))
        err_console.print(f"frontier written: {escape(str(frontier))}")
    elif frontier is not None:
        err_console.print("frontier not drawn: the kld evaluation did not run to its end.")
    err_console.print(f"backend: {report['results'][0].get('backend', '?')} "
                      f"({escape(str(report['backend_reason']))})")
    if as_json:
        print_json(doc)
    else:
        _render(report["results"], opts)
        _render_long(report)
        _render_devices(report)
    if report["interrupted"]:
        err_console.print("[bold red]interrupted:[/] the results above are what was finished "
                          "before Ctrl-C.", highlight=False)
        raise typer.Exit(130)


def _draw_frontier(front: dict, report: dict, model, path) -> None:
    from kvlens.plots.frontier import write_frontier

    p = report["evaluation"]["kld"]
    name = Path(str(model)).name if model else "SmolLM2-135M-Instruct"
    write_frontier(front, path, f"{name}: {p['tokens']} tokens of "
                                f"{p['text_source']}" + (" (interrupted: partial)"
                                                         if report["interrupted"] else ""))


def _render(results, opts) -> None:
    if not (set(opts.evals) & {"ppl", "passkey", "agreement"}) and opts.prompt is None:
        return
    cols = ["config", "bits/elem", "KV bytes", "vs fp16"]
    if "ppl" in opts.evals:
        cols += ["ppl", "ppl change"]
    if "passkey" in opts.evals:
        cols += ["passkey"]
    if "agreement" in opts.evals:
        cols += ["agreement", "first diverge"]
    table = new_table("kvlens generate: compressed KV cache vs fp16 (short-context checks)", cols)
    short = [e for e in ("ppl", "passkey", "agreement") if e in opts.evals]
    for r in results:
        if any(e not in r for e in short) or (opts.prompt is not None and "text" not in r) \
                or ("ppl" in r and "ppl_change" not in r):
            continue  # not finished (Ctrl-C)
        row = [escape(r["name"]), f"{r.get('bits_per_element', 0):.2f}", format_bytes(r.get("kv_bytes", 0)),
               f"{r.get('kv_bytes', 0) / max(r.get('kv_bytes_fp16', 1), 1):.2f}x"]
        if "ppl" in opts.evals:
            row += [f"{r['ppl']:.3f}", f"{100 * r['ppl_change']:+.2f}%"]
        if "passkey" in opts.evals:
            p = r["passkey"]
            row += [f"{p['correct']}/{p['total']} @{p['context_tokens']}"]
        if "agreement" in opts.evals:
            a = r["agreement"]
            row += [f"{a['matching']}/{a['total']}",
                    "-" if a["first_divergence"] is None else str(a["first_divergence"])]
        table.add_row(*row)
    console.print(table)
    for r in results:
        if "text" in r and opts.prompt is not None:
            console.print(f"[bold]{escape(r['name'])}[/]: {escape(r['text'])}", highlight=False)


def _render_devices(report: dict) -> None:
    """Weights and each config's held cache bytes per device (where a device map spreads the
    model, each layer's cache lives on its layer's device)."""
    placement = report["placement"]
    console.print(f"weights by device: {format_bytes_by_device(placement['weights_by_device'])}",
                  highlight=False)
    for r in report["results"]:
        if r.get("kv_bytes_by_device"):
            console.print(f"{escape(r['name'])}: KV cache held by device: "
                          f"{format_bytes_by_device(r['kv_bytes_by_device'])}", highlight=False)


def _diff(d: dict, fmt: str, scale: float = 1.0) -> str:
    """A paired difference with its interval, said not distinguishable where it is not."""
    text = format_interval(d, fmt, scale=scale, sign="+", key="diff")
    return text + (" not distinguishable" if not d["distinguishable"] else "")


def _render_long(report: dict) -> None:
    """Tables for --eval kld and --eval retrieval, with the paired comparisons."""
    results, ev = report["results"], report["evaluation"]
    if "kld" in ev:
        _render_kld(results, ev["kld"])
    if "retrieval" in ev:
        _render_retrieval(results, ev["retrieval"])


def _render_kld(results: list[dict], p: dict) -> None:
    """The --eval kld table, the excess-NLL line and each config's paired comparisons."""
    exact = f"the exact model ({p['model_dtype']})" if p.get("model_dtype") else \
        "the exact model"
    title = (f"KL divergence vs {exact}: {p['scored']} predictions over "
             f"{p['tokens']} tokens of {escape(str(p['text_source']))}, chunk {p['chunk']}"
             + (" (INTERRUPTED: partial)" if p["interrupted"] else ""))
    t = new_table(title, ("config", "bits/elem", "quantized share", "mean KLD", "median KLD",
                          "p99 KLD", "top-1 agree", "ppl", "ppl change"))
    ex = p.get("exact")
    if ex:
        t.add_row("exact", "-", "-", "0", "0", "0", "1",
                  format_interval(ex["ppl"], ".3f", sep="\n"), "0")
    for r in results:
        k = r.get("kld")
        if not k:
            continue
        t.add_row(escape(r["name"]), f"{r.get('bits_per_element', 0):.2f}",
                  f"{k['quantized_share']:.3f}", format_interval(k["mean_kld"], sep="\n"),
                  f"{k['median_kld']['value']:.4f}", f"{k['p99_kld']['value']:.3f}",
                  format_interval(k["top1_agreement"], ".3f", sep="\n"),
                  format_interval(k["ppl"], ".3f", sep="\n"),
                  format_interval(k["ppl_change"], ".2f", scale=100, sign="+", unit="%", sep="\n"))
    console.print(t)
    console.print("Second lines: 95% bootstrap intervals over blocks of "
                  f"{p['bootstrap']['unit_tokens']} tokens ({p['bootstrap']['resamples']} "
                  "resamples). quantized share: predictions whose attention read at least "
                  "one quantized entry.")
    excess = [(r["name"], r["kld"]["excess_nll"]) for r in results
              if r.get("kld") and "excess_nll" in r["kld"] and r["kld"]["quantized_share"]]
    if excess:
        console.print("NLL change of the text's tokens minus mean KLD (nats; ppl change = "
                      "exp(mean KLD + this) - 1; 0 on average for text drawn from the exact "
                      "model): " + "; ".join(
                          f"{escape(name)} {format_interval(e, '.4f', sign='+')}"
                          for name, e in excess), highlight=False)
    for r in results:
        k = r.get("kld") or {}
        v = k.get("vs_first")
        if v:
            console.print(f"{escape(r['name'])} - {escape(v['reference'])}: mean KLD "
                          f"{_diff(v['mean_kld'], '.4f')}; top-1 "
                          f"{_diff(v['top1_agreement'], '.3f')}; ppl change "
                          f"{_diff(v['ppl_change'], '.2f', 100)} points"
                          + (f"; excess NLL {_diff(v['excess_nll'], '.4f')}"
                             if "excess_nll" in v else ""), highlight=False)
        if k and not k["vs_exact"]["mean_kld"]["distinguishable"]:
            console.print(f"{escape(r['name'])} vs exact: not distinguishable (mean KLD interval "
                          "covers 0)", highlight=False)


def _render_retrieval(results: list[dict], p: dict) -> None:
    """The --eval retrieval table and each config's paired comparison with the first."""
    ex = p.get("exact")
    t = new_table(f"Retrieval (passkey + key-value), {p['prompts']} prompts per config, "
                  f"depths {p['depths']}; correct/total [Wilson 95%]"
                  + (" (INTERRUPTED: partial)" if p["interrupted"] else ""),
                  ["config", *(f"{length} tok" for length in p["lengths"]), "all",
                   "vs exact [95% CI]"])
    rows = ([("exact", ex, None)] if ex else []) + \
        [(r["name"], r["retrieval"], r["retrieval"]["vs_exact"]["accuracy"])
         for r in results if r.get("retrieval")]
    for name, doc, vs in rows:
        cells = [f"{c['correct']}/{c['total']} [{c['wilson95'][0]:.2f}-"
                 f"{c['wilson95'][1]:.2f}]" for c in doc["by_length"]]
        t.add_row(escape(name), *cells, f"{doc['correct']}/{doc['total']}",
                  "-" if vs is None else _diff(vs, ".2f"))
    console.print(t)
    for r in results:
        v = (r.get("retrieval") or {}).get("vs_first")
        if v:
            console.print(f"{escape(r['name'])} - {escape(v['reference'])}: accuracy "
                          f"{_diff(v['accuracy'], '.2f')}", highlight=False)
