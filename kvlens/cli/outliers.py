"""``kvlens plot-outliers``: outlier channels of Q/K/V (pre vs post RoPE) as figures and data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    ANALYSIS,
    INPUT,
    OUTPUT,
    console,
    err_console,
    escape,
    new_table,
    open_range,
    output_errors,
    print_json,
    progress_bar,
    run_library_call,
    shared_option,
    write_text_output,
)
from kvlens.errors import InputError

FAMILY_ORDER = {"q": ("q_pre", "q"), "k": ("k_pre", "k"), "v": ("v",)}


@app.command("plot-outliers")
def plot_outliers(
    run: Path = typer.Argument(..., metavar="RUN", show_default=False,
                               help="Capture file written by `kvlens capture`."),
    layers: str = typer.Option(None, "--layers", rich_help_panel=INPUT,
                               help="Layers to analyse, e.g. 0,4,8-11 (default: all captured)."),
    heads: str = typer.Option(None, "--heads", rich_help_panel=INPUT,
                              help="KV heads, e.g. 0,2 (default: all); query tensors use those "
                                   "heads' GQA groups."),
    tensors: str = typer.Option("q,k,v", "--tensors", rich_help_panel=INPUT,
                                help="Tensor families: q, k, v (q and k before and after RoPE)."),
    threshold: float = typer.Option(4.0, "--threshold", callback=open_range(1.0, math.inf),
                                    rich_help_panel=ANALYSIS,
                                    help="Outlier rule: channel abs-max >= THRESHOLD x median "
                                         "channel abs-max of the head (THRESHOLD > 1)."),
    profile_layers: str = typer.Option(
        "auto", "--profile-layers", rich_help_panel=ANALYSIS,
        help="Layers that get per-channel profile figures: 'auto' (the 3 most severe "
             "analysed layers), 'all', or a spec such as 3,18."),
    heatmap: list[str] = typer.Option(
        None, "--heatmap", rich_help_panel=ANALYSIS,
        help="LAYER:KVHEAD for a token x channel heatmap (repeatable; default: the most severe "
             "pre-RoPE key head)."),
    top: int = typer.Option(15, "--top", min=1, rich_help_panel=ANALYSIS,
                            help="Rows in the table of strongest outliers."),
    out: Path = typer.Option(..., "--out", "-o", rich_help_panel=OUTPUT,
                             help="Directory for figures and outliers.json (created if "
                                  "missing)."),
    fmt: str = typer.Option("png", "--format", rich_help_panel=OUTPUT,
                            help="Figure format: png, svg or pdf."),
    overwrite: bool = shared_option("overwrite"),
    as_json: bool = shared_option("as_json", "the statistics (without per-channel profiles)"),
) -> None:
    """Which channels are outliers, how stable they are, and how RoPE moves them.

    Examples:

      kvlens plot-outliers out/run.h5 --out out/outliers
      kvlens plot-outliers out/run.h5 --out out/k --tensors k --heatmap 2:0 --format svg
    """
    from kvlens.analysis.outliers import analyze_capture, parse_tensors
    from kvlens.report.artifacts import check_output_folder

    explicit = profile_layers.strip().lower() not in ("auto", "")

    def prepare():
        from kvlens.capture.store import open_capture
        from kvlens.plots.outliers import FORMATS
        from kvlens.text.selection import parse_index_spec

        if fmt not in FORMATS:
            raise InputError(f"Unknown --format {fmt!r}; allowed: {', '.join(FORMATS)}.")
        families = parse_tensors(tensors)
        check_output_folder(out, "--out", "outliers.json", overwrite)
        spots = [_parse_heatmap(s) for s in heatmap or []]
        with open_capture(run) as cap:
            limit = cap.meta.shape.num_layers
            wanted = set(parse_index_spec(profile_layers, limit)) if explicit else set()
            for layer, kv in spots:
                cap.layer(layer)  # clear error for a layer that is not captured
                if not 0 <= kv < cap.meta.shape.num_key_value_heads:
                    raise InputError(f"--heatmap {layer}:{kv}: KV head outside 0-"
                                     f"{cap.meta.shape.num_key_value_heads - 1}.")
            return families, spots, cap.meta.model, wanted

    families, spots, model_name, wanted = run_library_call(prepare)
    drawn: list[Path] = []
    figures = f"figures in --out {out}"

    def on_layer(stats) -> None:
        # Streaming: draw a layer's profiles as soon as its statistics exist.
        if stats[0].layer in wanted:
            with output_errors(figures):
                drawn.extend(_draw_profiles(stats, model_name, threshold, out, fmt))

    def analyse():
        with output_errors(f"--out {out}"):
            out.mkdir(parents=True, exist_ok=True)
        with progress_bar("plot-outliers") as update:
            return analyze_capture(run, layers=layers, heads=heads, tensors=families,
                                   threshold=threshold, progress=update, on_layer=on_layer)

    report = run_library_call(analyse)

    def draw_the_rest():
        from kvlens.plots.outliers import plot_overview

        if not explicit:
            with output_errors(figures):
                sev = report.layer_severity(_severity_tensor(report))
                for layer in sorted(sorted(sev, key=sev.get, reverse=True)[:3]):  # the worst 3
                    drawn.extend(_draw_profiles(report.select(layer=layer), report.model,
                                                threshold, out, fmt))
        drawn.extend(_draw_heatmaps(report, spots, run, out, fmt))
        with output_errors(figures):
            drawn.append(plot_overview(report, out / f"overview.{fmt}"))

    run_library_call(draw_the_rest)
    stats_path = out / "outliers.json"
    from kvlens.report.artifacts import relative_names

    doc = {**report.to_dict(profiles=True), "figures": relative_names(drawn, out)}
    run_library_call(lambda: write_text_output(stats_path, json.dumps(doc, indent=1) + "\n"))
    err_console.print(f"Wrote {len(drawn)} figures and {escape(str(stats_path))} to "
                      f"{escape(str(out))} (analysis {report.seconds:.1f} s).")
    if as_json:
        d = report.to_dict(profiles=False)
        d["figures"] = [str(p) for p in drawn]
        print_json(d)
        return
    _render(report, top, drawn)


def _parse_heatmap(spec: str) -> tuple[int, int]:
    try:
        layer_s, head_s = spec.split(":")
        return int(layer_s), int(head_s)
    except ValueError:
        raise InputError(f"Invalid --heatmap {spec!r}: expected LAYER:KVHEAD, e.g. 18:2.") \
            from None


def _severity_tensor(report) -> str:
    for t in ("k_pre", "q_pre", "v"):
        if report.select(t):
            return t
    return report.heads[0].tensor


def _draw_profiles(stats, model: str, threshold: float, out: Path, fmt: str) -> list[Path]:
    from kvlens.plots.outliers import plot_channel_profiles

    paths = []
    layer = stats[0].layer
    for fam, names in FAMILY_ORDER.items():
        hs = [h for h in stats if h.tensor in names]
        if hs:
            paths.append(plot_channel_profiles(hs, model, threshold,
                                               out / f"layer{layer:02d}_{fam}.{fmt}"))
    return paths


def _draw_heatmaps(report, spots, run: Path, out: Path, fmt: str) -> list[Path]:
    from kvlens.analysis.outliers import read_head
    from kvlens.plots.outliers import plot_heatmap

    if not spots:
        t = _severity_tensor(report)
        worst = max(report.select(t), key=lambda h: h.max_ratio)
        spots = [(worst.layer, worst.kv_head)]
    groups = report.num_attention_heads // report.num_key_value_heads
    paths = []
    for layer, kv in spots:
        arrays, heads, marks = {}, {}, {}
        for fam in report.tensors:
            for name in FAMILY_ORDER[fam]:
                if fam == "q":  # the query head of this KV group with the strongest outlier
                    cands = [h for h in report.select(name, layer) if h.kv_head == kv]
                    head = max(cands, key=lambda h: h.max_ratio).head if cands else kv * groups
                else:
                    head = kv
                arrays[name] = read_head(run, layer, name, head)
                heads[name] = head
                marks[name] = [c for h in report.select(name, layer) if h.head == head
                               for c in h.outlier_channels]
        with output_errors(f"figures in --out {out}"):
            paths.append(plot_heatmap(arrays, report.model, layer, heads,
                                      out / f"heatmap_layer{layer:02d}_kv{kv}.{fmt}",
                                      outliers=marks))
    return paths


def _render(report, top: int, drawn: list[Path]) -> None:
    names = [n for fam in report.tensors for n in FAMILY_ORDER[fam]]
    sev = new_table(f"{escape(report.model)}: outlier severity per layer (max/med = largest "
                    f"channel abs-max / median over channels, worst head; outlier rule: "
                    f">= {report.threshold:g}; outl. = outlier channels summed over heads)",
                    ("layer", *(f"{n}\nmax/med" for n in names), "k_pre\noutl."), left=())
    by = {n: report.layer_severity(n) for n in names}
    for layer in report.layers:
        values = (by[n].get(layer, 0.0) for n in names)
        cells = [f"[bold red]{v:.1f}[/]" if v >= report.threshold else f"{v:.1f}" for v in values]
        count = sum(len(h.outliers) for h in report.select("k_pre", layer))
        sev.add_row(str(layer), *cells, str(count) if "k" in report.tensors else "-")
    console.print(sev)

    # Each outlier once: pre-RoPE tensors (their RoPE shift gives the post-RoPE view) and v.
    cached = [t for t in ("k_pre", "v") if report.select(t)]
    if cached:
        console.print(_top_table(report, cached, top, "keys/values (cached)"))
    if report.select("q_pre"):
        console.print(_top_table(report, ["q_pre"], top, "queries"))
    console.print(f"{len(drawn)} figures in {drawn[0].parent if drawn else '-'}; "
                  f"statistics in {drawn[0].parent / 'outliers.json' if drawn else '-'}",
                  markup=False)


def _top_table(report, tensors, top: int, what: str):
    from rich import box

    tab = new_table(f"Strongest outlier channels, {what}",
                    ("where", "ch", "absmax", "ratio", "tok", "smp", "pair", "share", "tok'"),
                    left=(), no_wrap=True, box=box.SIMPLE_HEAD,
                    caption="ratio: abs-max / median channel abs-max. tok: share of tokens with "
                            "the channel in the top set; smp: share of samples flagging it. "
                            "pair: RoPE partner; share: its energy share pre->post RoPE; tok': "
                            "tok after RoPE.")
    for h, o in report.top_outliers(top, tensors):
        r = next((r for r in h.rope if r.channel == o.channel), None)
        rope = ("-", "-", "-") if r is None else (
            "-" if r.partner is None else str(r.partner),
            f"{r.partner_share_pre:.0%}->{r.partner_share_post:.0%}",
            f"{r.token_stability_post:.0%}")
        tab.add_row(f"L{h.layer} {h.tensor} h{h.head}", str(o.channel), f"{o.absmax:.1f}",
                    f"{o.ratio:.1f}", f"{o.token_stability:.0%}",
                    f"{o.sample_stability:.0%}", *rope)
    return tab
