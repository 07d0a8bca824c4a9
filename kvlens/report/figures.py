"""Figures the commands wrote, embedded in the page (PNG as base64, SVG inline), with captions.

A figure's caption says what it shows from its file name alone (the names are fixed by
``kvlens.plots.outliers`` and ``kvlens.plots.compare``), so a reader needs no terminal output.
PNGs are embedded at the width the page shows them (``compact_png``; docs/report.md, "Size");
the files themselves are not changed.
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDABLE = (".png", ".svg")
# The widest a figure is shown: the page's 1100 px column less its padding and the figure
# panel's (report.html.j2: 1100 - 2 x 24 - 2 x 5 - 2 x 1). Wider PNGs are scaled down to it;
# narrower ones keep their size (a resampled image compresses far worse than the original).
SHOWN_WIDTH = 1040
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
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
        if not data.startswith(PNG_SIGNATURE):
            return Figure(name, caption, problem=f"{path} is not a PNG file")
        try:
            data = compact_png(data)
        except OSError as exc:  # PIL cannot decode it: a truncated or damaged file
            return Figure(name, caption, problem=f"{path} cannot be decoded ({exc})")
        return png_figure(name, caption, data)
    text = data.decode("utf-8", errors="replace")
    svg = _XML_PROLOG.sub("", text, count=1)
    if not svg.lstrip().startswith("<svg"):
        return Figure(name, caption, problem=f"{path} is not an SVG file")
    return Figure(name, caption, svg=svg)


def png_figure(name: str, caption: str, data: bytes) -> Figure:
    """A figure of PNG bytes, embedded as a data: URI."""
    return Figure(name, caption, src="data:image/png;base64,"
                  + base64.b64encode(data).decode("ascii"))


def compact_png(data: bytes, max_width: int = SHOWN_WIDTH) -> bytes:
    """``data`` re-encoded for the page: scaled down to ``max_width`` pixels (when wider), made
    opaque on white (the panel figures sit on), quantized to a 256-colour palette without
    dithering and saved optimised; ``data`` itself when that is not smaller. Matplotlib's
    antialiased lines and colour maps survive 256 colours without a visible change.

    Raises ``OSError`` when ``data`` is not a PNG that PIL can decode."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if im.mode in ("RGBA", "LA", "P", "PA"):
            rgba = im.convert("RGBA")
            img = Image.new("RGB", rgba.size, "white")
            img.paste(rgba, mask=rgba.getchannel("A"))
        else:
            img = im.convert("RGB")
    if img.width > max_width:
        img = img.resize((max_width, max(1, round(img.height * max_width / img.width))),
                         Image.Resampling.LANCZOS)
    palette = img.quantize(colors=256, method=Image.Quantize.FASTOCTREE,
                           dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


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
