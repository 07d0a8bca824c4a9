"""Figures the commands wrote, embedded in the page (PNG as base64, SVG inline), with captions.

A figure's caption says what it shows from its file name alone (the names are fixed by
``kvlens.plots.outliers`` and ``kvlens.plots.compare``), so a reader needs no terminal output.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDABLE = (".png", ".svg")
_XML_PROLOG = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?(<!DOCTYPE[^>]*>\s*)?", re.S)


@dataclass(frozen=True)
class Figure:
    name: str  # as the artifact names it (relative to its folder)
    caption: str
    src: str = ""  # data: URI of a PNG
    svg: str = ""  # inline SVG markup
    problem: str = ""  # why it is not shown (missing file, unsupported format)


def load_figure(folder: Path, name: str, caption: str) -> Figure:
    """The figure ``name`` under ``folder``, embedded; ``problem`` set when it cannot be."""
    path = Path(name) if Path(name).is_absolute() else folder / name
    if path.suffix.lower() not in EMBEDDABLE:
        return Figure(name, caption, problem=f"{path.suffix} figures cannot be embedded in HTML; "
                                             "re-run with --format png or svg")
    try:
        data = path.read_bytes()
    except OSError:
        return Figure(name, caption, problem=f"file {path} is missing: re-run the command that "
                                             "drew it")
    if path.suffix.lower() == ".png":
        if not data.startswith(b"\x89PNG\r\n\x1a\n"):
            return Figure(name, caption, problem=f"{path} is not a PNG file")
        return Figure(name, caption, src="data:image/png;base64,"
                      + base64.b64encode(data).decode("ascii"))
    text = data.decode("utf-8", errors="replace")
    svg = _XML_PROLOG.sub("", text, count=1)
    if not svg.lstrip().startswith("<svg"):
        return Figure(name, caption, problem=f"{path} is not an SVG file")
    return Figure(name, caption, svg=svg)


def outlier_caption(name: str, threshold: float) -> str:
    stem = Path(name).stem
    if stem == "overview":
        return ("Outlier severity per layer, worst head of each layer: top, largest channel "
                "abs-max over the median channel abs-max (dotted: the outlier rule's threshold "
                f"{threshold:g}); middle, kurtosis (3 for a Gaussian); bottom, number of outlier "
                "channels summed over heads. Solid lines: before RoPE (and V); dashed: after.")
    m = re.fullmatch(r"layer(\d+)_([qkv])", stem)
    if m:
        what = {"q": "queries", "k": "keys", "v": "values"}[m.group(2)]
        stages = "before RoPE (left) and after (right)" if m.group(2) != "v" else "(no RoPE)"
        return (f"Layer {int(m.group(1))} {what}, per channel, one row per head, {stages}: "
                "abs-max over tokens (line), 50th-99th percentile band, the outlier rule's "
                "level (dashed); flagged channels are marked and numbered.")
    m = re.fullmatch(r"heatmap_layer(\d+)_kv(\d+)", stem)
    if m:
        return (f"|x| of layer {int(m.group(1))}, KV head {int(m.group(2))}, sample 0: token "
                "(rows) by channel (columns), K before RoPE above K after RoPE, then the "
                "group's query head and V; outlier channels marked in red. A vertical stripe is "
                "a channel that is large on every token (the KIVI picture).")
    return "Figure written by `kvlens plot-outliers`."


def compare_caption(name: str) -> str:
    stem = Path(name).stem
    kind, _, config = stem.partition("_")
    config = config.replace("_", " ")
    if kind == "layers":
        return (f"{config}: relative error per layer (mean over heads, log scale), per-token "
                "(blue) vs per-channel (red) grouping, one panel per metric: the stored tensor "
                "(reconstruction), the attention scores, weights and output. Where the lines "
                "cross in one panel and not another, the metrics disagree.")
    if kind == "heatmap":
        return (f"{config}: relative error per layer (rows) and head (columns), per-token and "
                "per-channel side by side on one colour scale per metric, and log2 of their "
                "ratio (red: per-channel worse).")
    if kind == "formats":
        return (f"Engine KV-cache formats ({config}): relative error per layer, one line per "
                "format, one panel per metric.")
    return "Figure written by `kvlens compare-axes`."
