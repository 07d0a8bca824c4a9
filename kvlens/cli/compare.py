"""``kvlens compare-axes``: per-token vs per-channel quantization error of K and V, measured on
the tensor and on attention (scores, weights, output)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    ANALYSIS,
    INPUT,
    OUTPUT,
    LibraryDefaults,
    console,
    err_console,
    escape,
    given_options,
    new_table,
    open_range,
    output_errors,
    print_json,
    progress_bar,
    read_with,
    refuse_unread,
    run_library_call,
    shared_option,
    write_artifact_output,
)
from kvlens.report.sections import METRIC_LABELS, axis_rows, config_label

# The options only some variants read (refuse_unread): given without any of them, refused.
READ_BY = {"outlier_fraction": read_with("--variants", "outliers"),
           "rotation_seed": read_with("--variants", "rotate")}


class _LibraryDefaults(LibraryDefaults):
    def library_options(self) -> tuple[type, ...]:
        from kvlens.analysis.compare import CompareConfig

        return (CompareConfig,)


@app.command("compare-axes", cls=_LibraryDefaults)
def compare_axes_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., metavar="RUN", show_default=False,
                               help="Capture file written by `kvlens capture`."),
    layers: str = typer.Option(None, "--layers", rich_help_panel=INPUT,
                               help="Layers to analyse, e.g. 0,4,8-11 (default: all captured)."),
    samples: int = typer.Option(None, "--samples", min=1, rich_help_panel=INPUT,
                                help="Use only the first N samples (faster; at most the "
                                     "capture's)."),
    bits: str = typer.Option(None, "--bits", rich_help_panel=ANALYSIS,
                             help="Bit widths, comma-separated (1-8)."),
    group_sizes: str = typer.Option(None, "--group-sizes", rich_help_panel=ANALYSIS,
                                    help="Group sizes G, comma-separated: per-token groups are "
                                         "G channels of a token (G must divide head_dim), "
                                         "per-channel groups G tokens of a channel."),
    stages: str = typer.Option(None, "--stages", rich_help_panel=ANALYSIS,
                               help="Key stages: post (post-RoPE, as cached) and/or pre "
                                    "(quantize before RoPE, re-rotate), e.g. post,pre."),
    variants: str = typer.Option("", "--variants", rich_help_panel=ANALYSIS,
                                 help="Extra transforms beside plain quantization: balancer, "
                                      "outliers, rotate (Hadamard along head_dim). "
                                      "Comma-separated; default none."),
    outlier_fraction: float = typer.Option(None, "--outlier-fraction",
                                           callback=open_range(0.0, 1.0),
                                           rich_help_panel=ANALYSIS,
                                           help="outliers variant: share of each quantized "
                                                "vector kept exact (0 < f < 1)."),
    rotation_seed: int = typer.Option(None, "--rotation-seed", min=0,
                                      rich_help_panel=ANALYSIS,
                                      help="rotate variant: random sign flips "
                                           "drawn with this seed (randomized Hadamard); "
                                           "default none (plain Hadamard)."),
    formats: str = typer.Option("", "--formats", rich_help_panel=ANALYSIS,
                                help=escape(
                                    "Engine settings swept beside the integer specs, "
                                    "comma-separated, spelled as generate --compare takes them "
                                    "and recommend --target prints them: llamacpp:T (q8_0, "
                                    "q4_0, q4_1, q5_0, q5_1, iq4_nl; Hadamard-rotated when "
                                    "head_dim % 64 == 0, :norot / :rot to force), vllm:D "
                                    "(fp8_e4m3, fp8_e5m2: static scale calibrated per layer on "
                                    "the capture; @head per KV head; :p99.9 percentile; :s1 "
                                    "the fixed default scale), vllm:int8-pth / int4-pth / "
                                    "fp8-pth (per-token-head). Default none.")),
    sink_tokens: int = typer.Option(None, "--sinks", min=0, rich_help_panel=ANALYSIS,
                                    help="Score/output metrics read the first N tokens exact (a "
                                         "cache that keeps the attention sinks at full "
                                         "precision)."),
    threads: int = typer.Option(1, "--threads", min=1, rich_help_panel=ANALYSIS,
                                help="torch threads while sweeping (1 is fastest for these "
                                     "small ops)."),
    plots: Path = typer.Option(None, "--plots", rich_help_panel=OUTPUT,
                               help="Directory for heatmaps, per-layer line plots and "
                                    "compare-axes.json (the summary and per-layer means "
                                    "`kvlens report` reads); created if missing."),
    overwrite: bool = shared_option("overwrite"),
    as_json: bool = shared_option("as_json", "all records and the summary"),
) -> None:
    """Which quantization axis wins for keys and values, under which error metric.

    Examples:

      kvlens compare-axes out/run.h5 --plots out/compare
      kvlens compare-axes out/run.h5 --bits 2 --variants rotate,outliers --outlier-fraction 0.02
      kvlens compare-axes out/run.h5 --formats llamacpp:q4_0,vllm:fp8_e4m3
    """
    from kvlens.analysis.compare import (
        CompareConfig,
        compare_axes,
        parse_int_list,
        parse_layers,
        parse_name_list,
    )
    from kvlens.config.engine import measured_cache_types
    from kvlens.report.artifacts import check_output_folder

    given = given_options(ctx, READ_BY)

    def configure() -> CompareConfig:
        if plots is not None:
            check_output_folder(plots, "--plots", "compare-axes.json", overwrite)
        given_values = {  # an option not given takes CompareConfig's default
            "bits": bits if bits is None else parse_int_list(bits, "bits"),
            "group_sizes": group_sizes if group_sizes is None else
            parse_int_list(group_sizes, "group sizes"),
            "stages": stages if stages is None else parse_name_list(stages),
            "outlier_fraction": outlier_fraction, "sink_tokens": sink_tokens}
        config = CompareConfig(
            variants=parse_name_list(variants), layers=parse_layers(layers), samples=samples,
            rotation_seed=rotation_seed, formats=measured_cache_types(formats),
            **{k: v for k, v in given_values.items() if v is not None})
        refuse_unread(READ_BY, given, config.variants)
        _check_against_capture(run, config)
        return config

    config = run_library_call(configure)
    with progress_bar("compare-axes") as update:
        result = run_library_call(lambda: compare_axes(run, config, progress=update,
                                                       threads=threads))
    if plots is not None:
        from kvlens.plots.compare import write_plots
        from kvlens.report.artifacts import compare_doc

        def write_figures():
            with output_errors(f"figures in --plots {plots}"):
                return write_plots(result, plots)

        written = run_library_call(write_figures)
        data = run_library_call(lambda: write_artifact_output(
            "compare-axes", compare_doc(result, written, plots), plots / "compare-axes.json"))
        err_console.print(f"Wrote {len(written)} figures and {escape(str(data))} to "
                          f"{escape(str(plots))}")
    if as_json:
        print_json(result.to_dict())
        return
    _render(result.summary)


def _check_against_capture(run: Path, config) -> None:
    """What depends on the capture, before the sweep starts: --samples at most its samples."""
    from kvlens.capture.store import open_capture
    from kvlens.errors import InputError

    with open_capture(run) as cap:
        have = cap.meta.num_samples
    if config.samples is not None and config.samples > have:
        raise InputError(f"--samples {config.samples}: {run} holds {have} samples; allowed: "
                         f"1-{have}.")


def _fmt(value: float | None, best: bool) -> str:
    if value is None:
        return "[dim]-[/]"
    # the star keeps the winner visible without colour (pipes, NO_COLOR)
    text = f"{value:.4f}" if value == 0 or value >= 1e-3 else f"{value:.2e}"
    return f"[bold green]{text}*[/]" if best else f"{text} "


def _render(summary: dict) -> None:
    cap = summary["capture"]
    table = new_table(
        f"compare-axes: {escape(str(cap['model']))}, {len(cap['layers'])} layers, "
        f"{cap['samples']} x {cap['tokens']} tokens",
        ("config", "axis", *METRIC_LABELS.values()), left=(0, 1),
        caption="Relative Frobenius error ||X - X_hat|| / ||X||, mean over layers and heads. "
                "* = the better axis. recon: the quantized tensor; score: pre-softmax logits "
                "(causal); weights: post-softmax; output: attention output. K b G stage: keys, "
                "bits, group size, post/pre-RoPE; V: values.")
    for r, axis, cells in axis_rows(summary):
        table.add_row(config_label(r, "b", "") if axis == "per-token" else "", axis,
                      *(_fmt(v, best) for v, best in cells), end_section=axis == "per-channel")
    console.print(table)
    for r in summary["disagreements"]:
        console.print(f"[yellow]disagreement[/] {r['tensor']}s {r['bits']}-bit G{r['group_size']}"
                      f"{' ' + r['stage'] + '-RoPE' if r['stage'] else ''} {r['variant']}: "
                      f"reconstruction favours {r['reconstruction']}, attention output favours "
                      f"{r['attention_output']}.", highlight=False)
    for k in summary["kivi_pattern"]:
        verdict = "[green]holds[/]" if k["holds"] else "[red]does not hold[/]"
        failed = [n for n, c in k["checks"].items() if not c["holds"]]
        console.print(f"KIVI pattern at {k['bits']}-bit G{k['group_size']}: {verdict}"
                      + (f" (fails: {', '.join(failed)})" if failed else ""), highlight=False)
    if summary.get("format_means"):
        _render_formats(summary)
    err_console.print(f"{summary['seconds']:.1f} s")


def _render_formats(summary: dict) -> None:
    means = {(m["tensor"], m["format"], m["metric"]): m["mean"] for m in summary["format_means"]}
    info = {f["format"]: f for f in summary.get("formats", [])}
    best = {}
    for (tensor, _, metric), value in means.items():
        best[(tensor, metric)] = min(value, best.get((tensor, metric), value))
    table = new_table("engine KV-cache formats",
                      ("tensor", "format", "bits", "rot", *METRIC_LABELS.values()),
                      left=(0, 1, 3),
                      caption="Relative Frobenius error, mean over layers and heads (keys "
                              "post-RoPE). * = lowest error among the formats. bits: storage "
                              "bits per element including scales. rot: Hadamard-rotated as the "
                              "engine does. " + summary["format_calibration"] + ".")
    table.columns[1].no_wrap = True  # a format's name
    names = list(dict.fromkeys(m["format"] for m in summary["format_means"]))
    for tensor in ("key", "value"):
        rows = [n for n in names if (tensor, n, "reconstruction") in means]
        for i, name in enumerate(rows):
            f = info.get(name, {})
            cells = [_fmt(means.get((tensor, name, m)),
                          means.get((tensor, name, m)) == best.get((tensor, m)) and len(rows) > 1)
                     for m in METRIC_LABELS]
            table.add_row("K" if tensor == "key" else "V", name,
                          f"{f['bits_per_element']:.2f}" if f else "-",
                          "yes" if f.get("rotated") else "no", *cells,
                          end_section=i == len(rows) - 1)
    console.print(table)
