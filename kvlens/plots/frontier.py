"""The bits-vs-KLD chart of ``kvlens generate --frontier`` (and of the report's first section).

It draws the ``"frontier"`` document of ``kvlens.evaluation.frontier.frontier_doc`` (what the
chart shows: docs/generate.md): a llama.cpp setting scored without the engine's matrix
products (``partial``) is drawn hollow, and a mean KLD of 0, which has no place on the log
axis, sits on the axis's floor as a downward triangle. Drawn on a ``matplotlib.figure.Figure``
(the Agg canvas): no pyplot, no global backend switch.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

# kind -> (marker, colour, legend label); kinds are kvlens.evaluation.frontier.KINDS
KIND_STYLE = {
    "engine": ("s", "#d62728", "engine setting"),
    "preset": ("o", "#1f77b4", "kvlens preset"),
    "config": ("D", "#2ca02c", "kvlens config"),
    "baseline": ("^", "#9467bd", "transformers baseline"),
}
FRONT_COLOR = "#444444"
FORMATS = (".png", ".svg")
_DPI = 100


def frontier_figure(doc: Mapping, title: str = "", width_in: float = 8.0):
    """The chart of ``doc`` (``{"points": [...], "front": [...]}``) as a matplotlib Figure."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    points = list(doc.get("points") or [])
    fig = Figure(figsize=(width_in, width_in * 0.6))
    ax = fig.subplots()
    positive = [v for p in points for v in (p["mean_kld"], *p["ci95"]) if v > 0]
    floor = min(positive) / 3 if positive else 1e-6
    # alternate labels above and below the marks in order of bits: neighbours rarely overlap
    rank = {id(p): i for i, p in enumerate(sorted(points, key=lambda p: (p["bits"],
                                                                          p["mean_kld"])))}
    handles = {}
    for p in points:
        marker, colour, label = KIND_STYLE.get(p["kind"], ("X", "#7f7f7f", p["kind"]))
        y = p["mean_kld"] if p["mean_kld"] > 0 else floor
        lo, hi = (max(v, floor) for v in p["ci95"])
        ax.errorbar([p["bits"]], [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]],
                    fmt="v" if p["mean_kld"] <= 0 else marker, color=colour, ms=7, capsize=3,
                    mec="black" if p.get("on_front") else colour, mew=1.2 if p.get("on_front")
                    else 0.5, mfc="none" if p.get("partial") else colour, zorder=3)
        handles.setdefault(p["kind"], Line2D([], [], ls="", marker=marker, color=colour, ms=7,
                                             label=label))
        if p.get("partial"):
            handles.setdefault("partial", Line2D([], [], ls="", marker=marker, color=colour,
                                                 mfc="none", ms=7, label="llama.cpp, cache only "
                                                 "(matrix products not simulated)"))
        ax.annotate(p["name"] + (" (= 0)" if p["mean_kld"] <= 0 else "")
                    + (" (cache only)" if p.get("partial") else ""), (p["bits"], y),
                    xytext=(6, 6 if rank[id(p)] % 2 == 0 else -11), textcoords="offset points",
                    fontsize=7.5, color="#222222", zorder=4)
    front = [p for p in points if p.get("on_front")]
    front.sort(key=lambda p: (p["bits"], p["mean_kld"]))
    if front:
        xs = [p["bits"] for p in front]
        ys = [p["mean_kld"] if p["mean_kld"] > 0 else floor for p in front]
        ax.step(xs, ys, where="post", color=FRONT_COLOR, lw=1.2, ls="--", zorder=2)
        handles["front"] = Line2D([], [], color=FRONT_COLOR, lw=1.2, ls="--",
                                  label="Pareto front (black-edged marks)")
    ax.set_yscale("log")
    ax.set_xlabel("bits per element held (measured)")
    ax.set_ylabel("mean KL divergence vs exact\n(log; bars: 95% interval)")
    ax.grid(alpha=0.3, which="both", lw=0.5)
    if points:
        ax.legend(handles=[handles[k] for k in (*KIND_STYLE, "front") if k in handles]
                  + [h for k, h in handles.items() if k not in KIND_STYLE and k != "front"],
                  fontsize=8, loc="upper right")
        xs = [p["bits"] for p in points]
        pad = max(0.5, 0.08 * (max(xs) - min(xs)))
        ax.set_xlim(min(xs) - pad, max(xs) + 2.5 * pad)  # room for the labels on the right
    else:
        ax.text(0.5, 0.5, "no setting was scored", ha="center", transform=ax.transAxes)
    if title:
        ax.set_title(title, fontsize=10)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.12, top=0.9 if title else 0.96)
    return fig


def write_frontier(doc: Mapping, path: str | os.PathLike, title: str = "") -> Path:
    """Write the chart to ``path``, PNG or SVG by its suffix."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"frontier chart {path}: allowed formats {', '.join(FORMATS)}")
    frontier_figure(doc, title).savefig(path, dpi=_DPI, format=path.suffix.lower()[1:])
    return path


def frontier_png(doc: Mapping, title: str = "", width_px: int = 800) -> bytes:
    """The chart as PNG bytes ``width_px`` wide (the report embeds it at the width shown)."""
    buf = io.BytesIO()
    frontier_figure(doc, title, width_px / _DPI).savefig(buf, dpi=_DPI, format="png")
    return buf.getvalue()
