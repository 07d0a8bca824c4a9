"""Matplotlib figures for ``kvlens plot-outliers`` (statistics come from ``kvlens.analysis.outliers``).

Every function draws one figure on a ``matplotlib.figure.Figure`` (no pyplot, no global backend
switch) and saves it to ``path`` (format from the suffix: png, svg or pdf). Titles name the
model, layer, head and stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

FORMATS = ("png", "svg", "pdf")
#: the tensors, in the figures' order, and their labels
STAGE = {"q_pre": "Q pre-RoPE", "q": "Q post-RoPE", "k_pre": "K pre-RoPE",
         "k": "K post-RoPE", "v": "V"}
COLORS = {"q_pre": "#1f77b4", "q": "#9ecae1", "k_pre": "#d62728", "k": "#ff9896",
          "v": "#2ca02c"}
_DPI = 100


def _save(fig, path: str | os.PathLike) -> Path:
    fig.savefig(path, dpi=_DPI)
    return Path(path)


def plot_channel_profiles(heads: Sequence, model: str, threshold: float,
                          path: str | os.PathLike) -> Path:
    """Per-channel |x| of one layer and one tensor family: rows = heads, columns = stages
    (pre-RoPE, post-RoPE for q/k; one column for v). ``heads`` are ``HeadStats`` of one layer.

    Each panel: abs-max over tokens (line), p50-p99 band over tokens, the outlier rule's level
    (threshold x median abs-max, dashed), flagged channels marked and numbered."""
    import numpy as np
    from matplotlib.figure import Figure

    stages = [t for t in STAGE if any(h.tensor == t for h in heads)]
    rows = sorted({h.head for h in heads})
    by_key = {(h.tensor, h.head): h for h in heads}
    layer = heads[0].layer
    ncol = len(stages)
    fig = Figure(figsize=(5.2 * ncol, 1.9 * len(rows) + 0.9))
    axes = fig.subplots(len(rows), ncol, sharex=True, sharey="row", squeeze=False)
    for r, head in enumerate(rows):
        for c, tensor in enumerate(stages):
            ax = axes[r][c]
            h = by_key.get((tensor, head))
            if h is None:
                ax.set_visible(False)
                continue
            ch = np.arange(len(h.channel_absmax))
            absmax = np.asarray(h.channel_absmax)
            ax.fill_between(ch, h.channel_p50, h.channel_p99, color=COLORS[tensor],
                            alpha=0.45, lw=0, label="p50–p99 over tokens")
            ax.plot(ch, absmax, color="black", lw=0.9, label="abs-max")
            ax.axhline(threshold * h.median_absmax, color="grey", ls="--", lw=0.8,
                       label=f"rule: {threshold:g} × median")
            ax.axvline(len(ch) / 2 - 0.5, color="grey", ls=":", lw=0.6)
            out = h.outlier_channels
            if out:
                ax.plot(out, absmax[list(out)], "o", color="crimson", ms=3.5, label="outlier")
                strongest = sorted(h.outliers, key=lambda o: o.ratio, reverse=True)[:4]
                for o in strongest:
                    ax.annotate(str(o.channel), (o.channel, o.absmax), xytext=(0, 2),
                                textcoords="offset points", ha="center", va="bottom",
                                fontsize=7, color="crimson")
            who = f"q head {head} (kv {h.kv_head})" if tensor.startswith("q") else \
                f"kv head {head}"
            ax.set_title(f"{STAGE[tensor]} · {who} · max/median {h.max_ratio:.1f}",
                         fontsize=8.5)
            ax.margins(x=0.01)
            ax.tick_params(labelsize=7)
            if c == 0:
                ax.set_ylabel("|x|", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("channel (dotted: RoPE half, c ↔ c + D/2)", fontsize=8)
    axes[0][0].legend(fontsize=6.5, loc="upper left", ncol=2, frameon=False)
    family = stages[0][0].upper()
    fig.suptitle(f"{model} · layer {layer} · {family}: per-channel |x| over all tokens",
                 fontsize=10.5)
    fig.subplots_adjust(left=0.06 if ncol > 1 else 0.1, right=0.99, top=1 - 0.5 / fig.get_figheight(),
                        bottom=0.55 / fig.get_figheight(), hspace=0.45, wspace=0.06)
    return _save(fig, path)


def plot_heatmap(arrays: Mapping[str, object], model: str, layer: int, heads: Mapping[str, int],
                 path: str | os.PathLike, sample: int = 0,
                 outliers: Mapping[str, Sequence[int]] | None = None) -> Path:
    """Token x channel |x| surfaces (the KIVI picture), one panel per stage, pre above post.

    ``arrays[tensor]`` is ``[T, D]`` (torch or numpy) for tensors among q_pre, q, k_pre, k, v;
    ``heads[tensor]`` the head index shown. Pre/post of one family share a colour scale.
    ``outliers[tensor]`` (optional) are ticked on the channel axis."""
    import numpy as np
    from matplotlib.figure import Figure

    names = [t for t in ("k_pre", "k", "q_pre", "q", "v") if t in arrays]
    mats = {t: np.abs(np.asarray(arrays[t], dtype=np.float32)).T for t in names}  # [D, T]
    fig = Figure(figsize=(9.5, 2.0 * len(names) + 0.7))
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)
    for ax, t in zip(axes[:, 0], names, strict=True):
        family = [u for u in names if u[0] == t[0]]
        vmax = max(float(mats[u].max()) for u in family) or 1.0
        im = ax.imshow(mats[t], aspect="auto", origin="lower", cmap="magma", vmin=0,
                       vmax=vmax, interpolation="nearest")
        who = f"q head {heads[t]}" if t.startswith("q") else f"kv head {heads[t]}"
        ax.set_title(f"{STAGE[t]} · {who}", fontsize=9)
        ax.set_ylabel("channel", fontsize=8)
        ax.tick_params(labelsize=7)
        d = mats[t].shape[0]
        ax.set_yticks(range(0, d, max(1, d // 8)))
        chans = sorted((outliers or {}).get(t, ()))
        if chans:  # outlier channels: red marks just left of the image
            ax.plot([-0.012] * len(chans), chans, ">", color="crimson", ms=4, clip_on=False,
                    transform=ax.get_yaxis_transform())
        cb = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.04)
        cb.set_label("|x|", fontsize=8)
        cb.ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel(f"token (sample {sample})", fontsize=8)
    fig.suptitle(f"{model} · layer {layer} · |x| per token and channel, pre vs post RoPE",
                 fontsize=10.5)
    fig.subplots_adjust(left=0.08, right=0.97, top=1 - 0.55 / fig.get_figheight(),
                        bottom=0.5 / fig.get_figheight(), hspace=0.35)
    return _save(fig, path)


def plot_overview(report, path: str | os.PathLike) -> Path:
    """Outlier severity per layer for every analysed tensor: max/median channel abs-max ratio
    (max over heads), kurtosis (max over heads), number of outlier channels (sum over heads)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    tensors = [t for t in STAGE if report.select(t)]
    fig = Figure(figsize=(9, 8))
    axes = fig.subplots(3, 1, sharex=True)
    for t in tensors:
        hs = report.select(t)
        layers = sorted({h.layer for h in hs})
        ratio = [max(h.max_ratio for h in hs if h.layer == L) for L in layers]
        kurt = [max(h.kurtosis for h in hs if h.layer == L) for L in layers]
        count = [sum(len(h.outliers) for h in hs if h.layer == L) for L in layers]
        style = dict(color=COLORS[t], marker="o", ms=3, lw=1.4,
                     ls="-" if t.endswith("_pre") or t == "v" else "--", label=STAGE[t])
        axes[0].plot(layers, ratio, **style)
        axes[1].plot(layers, kurt, **style)
        axes[2].plot(layers, count, **style)
    axes[0].axhline(report.threshold, color="grey", ls=":", lw=1,
                    label=f"rule threshold {report.threshold:g}")
    axes[0].set_ylabel("max / median\nchannel abs-max")
    axes[1].set_ylabel("kurtosis\n(Gaussian = 3)")
    axes[1].set_yscale("log")
    axes[1].set_yticks([2, 3, 5, 10, 20, 50, 100])
    axes[1].yaxis.set_major_formatter(ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(NullFormatter())
    axes[2].set_ylabel("outlier channels\n(sum over heads)")
    axes[2].set_xlabel("layer")
    axes[0].legend(fontsize=8, ncol=3, frameon=False)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title("worst head per layer", fontsize=9)
    fig.suptitle(f"{report.model} · outlier severity per layer "
                 f"({report.num_samples} × {report.num_tokens} tokens)", fontsize=11)
    fig.subplots_adjust(left=0.12, right=0.98, top=0.93, bottom=0.07, hspace=0.15)
    return _save(fig, path)
