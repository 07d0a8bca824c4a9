"""Figures for ``kvlens compare-axes`` (the numbers come from ``kvlens.analysis.compare``).

Per configuration (tensor, bits, group size, key stage, variant): ``heatmap_<config>.png``
(layer x head per metric, per-token | per-channel | log2 of their ratio) and
``layers_<config>.png`` (mean over heads against layer, one line per axis); per tensor with
engine formats, ``formats_<tensor>.png`` (one line per format). Drawn on
``matplotlib.figure.Figure`` objects (the Agg canvas): no pyplot, no global backend switch.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

from kvlens.analysis.compare import AXES, KEY_METRICS, VALUE_METRICS, CompareResult

AXIS_COLORS = {"per-token": "#1f77b4", "per-channel": "#d62728"}
_DPI = 100


def write_plots(result: CompareResult, out_dir: str | os.PathLike) -> list[Path]:
    """Write the heatmap and line figures of every configuration in ``result`` into
    ``out_dir`` (created if missing); returns the paths written."""
    import numpy as np
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = result.summary.get("capture", {}).get("model", "")
    # grid[config][(axis, metric)][layer][head] = rel_error
    grids: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
    formats: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in result.records:
        if r.format is not None:
            # formats[tensor][(format, metric)][layer] = errors of that layer's heads
            formats[r.tensor][(r.format, r.metric)][r.layer].append(r.rel_error)
            continue
        cfg = (r.tensor, r.bits, r.group_size, r.stage, r.variant)
        grids[cfg][(r.axis, r.metric)][(r.layer, r.head)] = r.rel_error
    written = []
    for cfg, cells in grids.items():
        metrics = [m for m in (KEY_METRICS if cfg[0] == "key" else VALUE_METRICS)
                   if all((a, m) in cells for a in AXES)]
        if not metrics:
            continue
        layers = sorted({layer for d in cells.values() for layer, _ in d})
        mats = {}
        for (axis, metric), values in cells.items():
            heads = sorted({h for _, h in values})
            mat = np.full((len(layers), len(heads)), np.nan)
            for (layer, head), val in values.items():
                mat[layers.index(layer), heads.index(head)] = val
            mats[(axis, metric)] = mat
        tensor, bits, g, stage, variant = cfg
        staged = f", {stage}-RoPE" if stage else ""
        title = f"{model}: {tensor}s, {bits}-bit, G={g}{staged}, {variant}"
        slug = f"{tensor}_{bits}b_G{g}{'_' + stage if stage else ''}_{variant}"
        written.append(_heatmaps(Figure, np, mats, metrics, layers, title,
                                 out / f"heatmap_{slug}.png"))
        written.append(_lines(Figure, np, mats, metrics, layers, title, out / f"layers_{slug}.png"))
    for tensor, cells in formats.items():
        path = out / f"formats_{tensor}.png"
        written.append(_format_lines(Figure, np, cells, tensor, model, path))
    return written


def _format_lines(Figure, np, cells, tensor: str, model: str, path: Path) -> Path:
    metrics = [m for m in (KEY_METRICS if tensor == "key" else VALUE_METRICS)
               if any(mm == m for _, mm in cells)]
    names = list(dict.fromkeys(f for f, _ in cells))

    def series(metric):
        for name in names:
            per_layer = cells.get((name, metric), {})
            layers = sorted(per_layer)
            yield layers, np.array([np.mean(per_layer[lay]) for lay in layers]), {"label": name}

    return _line_panels(Figure, np, metrics, series, f"{model}: engine KV-cache formats, "
                        f"{tensor}s", path, 3.8, {"fontsize": 7})


def _line_panels(Figure, np, metrics, series, title: str, path: Path, height: float,
                 legend: dict) -> Path:
    """One panel per metric, relative error against layer (log scale when every value is
    positive): ``series(metric)`` yields ``(layers, errors, plot options)`` per line."""
    fig = Figure(figsize=(4.2 * len(metrics), height))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=True):
        positive = True
        for layers, y, style in series(metric):
            positive = positive and bool(np.all(y > 0))
            ax.plot(layers, y, marker="o", ms=3, **style)
        if positive:
            ax.set_yscale("log")
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rel. error (mean over heads)")
    axes[0].legend(**legend)
    fig.suptitle(title)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.82, wspace=0.3)
    fig.savefig(path, dpi=_DPI)
    return path


def _heatmaps(Figure, np, mats, metrics, layers, title, path: Path) -> Path:
    n = len(metrics)
    fig = Figure(figsize=(12, 2.2 + 2.6 * n))
    axes = fig.subplots(n, 3, squeeze=False)
    step = max(1, math.ceil(len(layers) / 10))  # layer ticks
    for row, metric in enumerate(metrics):
        tok, ch = mats[("per-token", metric)], mats[("per-channel", metric)]
        vmax = float(np.nanmax([np.nanmax(tok), np.nanmax(ch)])) or 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.log2(ch / tok)
        finite = ratio[np.isfinite(ratio)]
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        # (title, matrix, colour map, range, colour bar): both axes on one scale, then the ratio
        panels = (("per-token", tok, "viridis", (0, vmax), None),
                  ("per-channel", ch, "viridis", (0, vmax), "rel. error"),
                  ("log2(per-channel / per-token)", ratio, "RdBu_r", (-lim or -1, lim or 1),
                   "< 0: per-channel better"))
        for ax, (what, mat, cmap, (lo, hi), bar) in zip(axes[row], panels, strict=True):
            im = ax.imshow(mat, aspect="auto", origin="lower", cmap=cmap, vmin=lo, vmax=hi,
                           interpolation="nearest")
            ax.set_title(f"{metric}: {what}", fontsize=9)
            ax.set_xlabel("KV head" if metric == "reconstruction" else "query head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(mat.shape[1]))
            ax.set_yticks(range(0, len(layers), step))
            ax.set_yticklabels([str(layers[i]) for i in range(0, len(layers), step)])
            if bar:
                fig.colorbar(im, ax=ax, label=bar)
    fig.suptitle(title)
    # fixed margins: tight_layout measures every tick label, a large share of the drawing time
    fig.subplots_adjust(left=0.06, right=0.97, bottom=0.9 / fig.get_figheight(),
                        top=1 - 0.7 / fig.get_figheight(), wspace=0.35, hspace=0.6)
    fig.savefig(path, dpi=_DPI)
    return path


def _lines(Figure, np, mats, metrics, layers, title, path: Path) -> Path:
    def series(metric):
        for axis in AXES:
            yield (layers, np.nanmean(mats[(axis, metric)], axis=1),
                   {"color": AXIS_COLORS[axis], "label": axis})

    return _line_panels(Figure, np, metrics, series, title, path, 3.6, {})
