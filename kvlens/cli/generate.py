"""``kvlens generate``: real generation with the compressed KV cache, and what it loses."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli import app
from kvlens.cli.common import console, err_console, print_json, run_library_call


@app.command()
def generate(
    model: str = typer.Option(None, "--model", "-m",
                              help="Model: omit for the embedded SmolLM2-135M-Instruct, or a "
                                   "local HF directory, a .gguf file, or a hub id."),
    config: Path = typer.Option(None, "--config", help="KV config JSON (as `recommend` writes)."),
    preset_name: str = typer.Option(None, "--preset",
                                    help="exact, fp16, kivi-2, kivi-4, per-token-2, "
                                         "per-token-4, mikv-2, mikv-4, kivi-2-prerope, "
                                         "kivi-2-sinks."),
    prompt: str = typer.Option(None, "--prompt", help="Prompt to continue."),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="UTF-8 file with the prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate."),
    evals: str = typer.Option(None, "--eval", help="Comma list of ppl, passkey, agreement."),
    text: Path = typer.Option(None, "--text", help="Text for ppl (default: built-in corpus)."),
    compare: str = typer.Option(None, "--compare",
                                help="Comma list of presets, config files and transformers "
                                     "baselines (hf-quanto-2/4, hf-hqq-2/4, hf-fp8) to run side "
                                     "by side on the same inputs."),
    backend: str = typer.Option("auto", "--backend", help="auto, torch or triton."),
    ppl_tokens: int = typer.Option(512, "--ppl-tokens", help="Tokens of text for ppl."),
    passkey_prompts: int = typer.Option(5, "--passkey-prompts", help="Passkey prompts."),
    passkey_context: int = typer.Option(1000, "--passkey-context",
                                        help="Approximate tokens per passkey prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed for passkey keys and depths."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="Model compute dtype."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Generate with a compressed KV cache and measure ppl / passkey / agreement vs the exact
    (uncompressed) cache."""
    configs, opts = run_library_call(lambda: _options(
        config, preset_name, compare, prompt, prompt_file, max_new_tokens, evals, text, backend,
        ppl_tokens, passkey_prompts, passkey_context, seed))

    def work():
        from kvlens.evaluate import evaluate_configs
        from kvlens.models import load_model

        err_console.print(f"Loading {model or 'SmolLM2-135M-Instruct (embedded)'} ...")
        mdl, tok, _ = load_model(model, dtype=dtype, device=device)
        return evaluate_configs(mdl, tok, configs, opts,
                                progress=lambda msg: err_console.print(f"  {msg}"))

    report = run_library_call(work)
    err_console.print(f"backend: {report['results'][0].get('backend', '?')} "
                      f"({report['backend_reason']})")
    if as_json:
        print_json({"results": report["results"]})
        return
    _render(report["results"], opts)


def _options(config, preset_name, compare, prompt, prompt_file, max_new_tokens, evals, text,
             backend, ppl_tokens, passkey_prompts, passkey_context, seed):
    from kvlens.errors import InputError
    from kvlens.evaluate import EvalOptions, parse_evals
    from kvlens.kvconfig import load_config, preset, resolve

    if config is not None and preset_name is not None:
        raise InputError("Give either --config FILE or --preset NAME, not both.")
    if prompt is not None and prompt_file is not None:
        raise InputError("Give either --prompt or --prompt-file, not both.")
    configs = []
    if config is not None:
        configs.append(load_config(config))
    if preset_name is not None:
        configs.append(preset(preset_name))
    if compare:
        from kvlens.baselines import baseline, is_baseline

        names = [s.strip() for s in compare.split(",") if s.strip()]
        configs.extend(baseline(n) if is_baseline(n) else resolve(n) for n in names)
    if not configs:
        raise InputError("Choose a cache: --preset NAME, --config FILE or --compare P1,P2,...")
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"Cannot read --prompt-file {prompt_file}: {exc}.") from None
    names = parse_evals(evals)
    if not names and prompt is None:
        raise InputError("Nothing to do: give --prompt/--prompt-file and/or --eval "
                         "ppl,passkey,agreement.")
    for flag, value, low in (("--max-new-tokens", max_new_tokens, 1),
                             ("--passkey-prompts", passkey_prompts, 1),
                             ("--passkey-context", passkey_context, 64),
                             ("--ppl-tokens", ppl_tokens, 40)):
        if value < low:
            raise InputError(f"{flag} must be at least {low} (got {value}).")
    opts = EvalOptions(evals=names, prompt=prompt, max_new_tokens=max_new_tokens,
                       text=str(text) if text else None, ppl_tokens=ppl_tokens,
                       passkey_prompts=passkey_prompts, passkey_context=passkey_context,
                       seed=seed, backend=backend)
    return configs, opts


def _render(results, opts) -> None:
    from rich.table import Table

    table = Table(title="kvlens generate: compressed KV cache vs fp16")
    cols = ["config", "bits/elem", "KV bytes", "vs fp16"]
    if "ppl" in opts.evals:
        cols += ["ppl", "ppl change"]
    if "passkey" in opts.evals:
        cols += ["passkey"]
    if "agreement" in opts.evals:
        cols += ["agreement", "first diverge"]
    for c in cols:
        table.add_column(c, justify="left" if c == "config" else "right")
    for r in results:
        row = [r["name"], f"{r.get('bits_per_element', 0):.2f}", _bytes(r.get("kv_bytes", 0)),
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
            console.print(f"[bold]{r['name']}[/]: {r['text']}", highlight=False)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
