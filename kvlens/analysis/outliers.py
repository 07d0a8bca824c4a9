"""Outlier-channel statistics of captured Q, K, V (the library behind ``kvlens plot-outliers``).

Owns the outlier rule and the statistics (per layer, tensor and head, over all captured
samples and tokens of a ``[S, H, T, D]`` tensor; definitions in ``docs/outliers.md``): a
channel is an outlier when its abs-max is at least ``threshold`` times the head's median
channel abs-max. ``analyze_capture`` returns them as a frozen, JSON-serialisable
``OutlierReport``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvlens.capture.store import open_capture
from kvlens.errors import InputError
from kvlens.rope import partner_channel
from kvlens.text.selection import format_index_spec, parse_index_spec

REPORT_SCHEMA_VERSION = 1
FAMILIES = ("q", "k", "v")
# Tensor names per family, pre-RoPE first.
FAMILY_TENSORS = {"q": ("q_pre", "q"), "k": ("k_pre", "k"), "v": ("v",)}
POST_OF = {"q_pre": "q", "k_pre": "k"}
DEFAULT_THRESHOLD = 4.0
PERCENTILES = (50.0, 99.0)

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class OutlierChannel:
    """One channel that the rule flags in one (layer, tensor, head)."""

    channel: int
    absmax: float
    ratio: float  # absmax / median channel abs-max of the head
    token_stability: float  # fraction of tokens on which it is in the top-n set
    sample_stability: float  # fraction of samples in which the rule flags it


@dataclass(frozen=True)
class RopeShift:
    """What RoPE does to one pre-RoPE outlier channel and its RoPE partner."""

    channel: int
    partner: int | None  # None: channel outside the rotary part (not rotated)
    partner_share_pre: float  # E[partner] / (E[channel] + E[partner]) before RoPE
    partner_share_post: float  # the same after RoPE
    absmax_pre: float
    absmax_post: float
    partner_absmax_pre: float
    partner_absmax_post: float
    token_stability_post: float  # top-n membership after RoPE (same n as before)
    outlier_post: bool  # the rule still flags the channel after RoPE
    partner_outlier_post: bool  # the rule flags the partner after RoPE


@dataclass(frozen=True)
class HeadStats:
    """Per-channel profile and outliers of one tensor of one head in one layer."""

    layer: int
    tensor: str  # q_pre, q, k_pre, k or v
    head: int  # query head for q/q_pre, KV head otherwise
    kv_head: int
    median_absmax: float
    max_ratio: float
    kurtosis: float
    outliers: tuple[OutlierChannel, ...]
    rope: tuple[RopeShift, ...]  # only for q_pre/k_pre on RoPE models
    channel_absmax: tuple[float, ...]
    channel_p50: tuple[float, ...]
    channel_p99: tuple[float, ...]

    @property
    def outlier_channels(self) -> tuple[int, ...]:
        return tuple(o.channel for o in self.outliers)

    def to_dict(self, profiles: bool = True) -> dict[str, Any]:
        """The fields (JSON-ready), without the per-channel profiles unless ``profiles``."""
        skip = () if profiles else ("channel_absmax", "channel_p50", "channel_p99")
        return {k: v for k, v in asdict(self).items() if k not in skip}


@dataclass(frozen=True)
class OutlierReport:
    """All statistics of one ``analyze_capture`` call (JSON via ``to_dict``)."""

    path: str
    model: str
    threshold: float
    tensors: tuple[str, ...]  # families analysed: subset of q, k, v
    layers: tuple[int, ...]
    kv_heads: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_layout: str
    rotary_dim: int
    num_samples: int
    num_tokens: int
    heads: tuple[HeadStats, ...]
    seconds: float = 0.0

    def select(self, tensor: str | None = None, layer: int | None = None) -> list[HeadStats]:
        return [h for h in self.heads if (tensor is None or h.tensor == tensor)
                and (layer is None or h.layer == layer)]

    def layer_severity(self, tensor: str) -> dict[int, float]:
        """Layer -> largest ``max_ratio`` over the heads of ``tensor``."""
        out: dict[int, float] = {}
        for h in self.select(tensor):
            out[h.layer] = max(out.get(h.layer, 0.0), h.max_ratio)
        return out

    def top_outliers(self, n: int = 15, tensors: Sequence[str] | None = None):
        """The ``n`` strongest (head, outlier) pairs by ratio, strongest first."""
        rows = [(h, o) for h in self.heads if tensors is None or h.tensor in tensors
                for o in h.outliers]
        rows.sort(key=lambda r: r[1].ratio, reverse=True)
        return rows[:n]

    def to_dict(self, profiles: bool = True) -> dict[str, Any]:
        """The fields in their order after the ``kvlens report`` artifact header, the threshold
        as the outlier ``rule`` and the heads last."""
        d = {"kvlens_report": "outliers", "schema_version": REPORT_SCHEMA_VERSION}
        d.update(("rule" if f.name == "threshold" else f.name, getattr(self, f.name))
                 for f in fields(self) if f.name != "heads")
        d["rule"] = {"threshold": self.threshold, "definition": "channel abs-max >= threshold * "
                     "median channel abs-max of the (layer, tensor, head)"}
        d["heads"] = [h.to_dict(profiles) for h in self.heads]
        return d


# -- validation ---------------------------------------------------------------------------------

def parse_tensors(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"q,k,v"`` / ``["k"]`` -> ordered families; raises ``InputError`` listing allowed names."""
    if spec is None:
        return FAMILIES
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = {s.strip().lower() for s in items if s.strip()}
    bad = sorted(names - set(FAMILIES))
    if bad or not names:
        raise InputError(f"Invalid {{tensors}} {spec!r}: allowed: q, k, v (comma-separated; "
                         "q and k are analysed before and after RoPE).")
    return tuple(f for f in FAMILIES if f in names)


def _check_threshold(threshold: float) -> float:
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        t = float("nan")
    if not math.isfinite(t) or t <= 1.0:
        raise InputError(f"Invalid outlier threshold {threshold!r}: it must be a number > 1 "
                         f"(a multiple of the median channel abs-max; default "
                         f"{DEFAULT_THRESHOLD}).")
    return t


def _resolve(spec: str | Sequence[int] | None, limit: int, what: str,
             available: Sequence[int] | None = None) -> list[int]:
    if spec is None or isinstance(spec, str):
        if available is not None and (spec is None or spec.strip().lower() in ("", "all")):
            return list(available)
        idx = parse_index_spec(spec, limit, what)
    else:
        idx = sorted({int(i) for i in spec})
        bad = [i for i in idx if i < 0 or i >= limit]
        if bad:
            raise InputError(f"Invalid {what}s {bad}: outside 0-{limit - 1}.")
    if available is not None:
        missing = [i for i in idx if i not in available]
        if missing:
            raise InputError(f"Layers {missing} are not in the capture; captured layers: "
                             f"{format_index_spec(available)}.")
    return idx


# -- statistics ---------------------------------------------------------------------------------

def _flag(absmax, threshold: float):
    """Rule on a ``[..., D]`` abs-max profile -> bool mask and median ``[...]``."""
    med = absmax.median(dim=-1).values
    return absmax >= threshold * med.unsqueeze(-1), med


def _top_membership(a, channels: Sequence[int]) -> list[float]:
    """Fraction of rows of ``a`` ``[N, D]`` (abs values, torch) on which each channel is among
    the ``len(channels)`` largest (ties count as members)."""
    import numpy as np

    n = len(channels)
    if n == 0:
        return []
    arr = a.numpy()
    d = arr.shape[-1]
    # numpy's partition is several times faster than torch.topk/sort on CPU for this shape.
    kth = np.partition(arr, d - n, axis=-1)[:, d - n : d - n + 1]  # n-th largest per row
    member = arr[:, list(channels)] >= kth
    return [float(v) for v in member.mean(axis=0)]


@dataclass
class _Raw:
    """Intermediate per-head numbers (torch) kept while one layer is processed."""

    absmax: Any  # [D]
    energy: Any  # [D] float64
    abs_flat: Any  # [S*T, D]
    outliers: list[int]


def _tensor_raw(x, threshold: float) -> list[tuple[_Raw, dict[str, Any]]]:
    """Per-head statistics of ``x`` ``[S, H, T, D]`` float32, vectorised over heads."""
    import numpy as np
    import torch

    s, h, t, d = x.shape
    a = x.abs()
    flat = a.transpose(0, 1).reshape(h, s * t, d)  # [H, N, D]
    absmax = flat.amax(dim=1)  # [H, D]
    mask, med = _flag(absmax, threshold)
    # Percentiles over tokens (nearest rank) by one numpy partition: torch.quantile and
    # torch.sort are several times slower on CPU for this shape.
    n = s * t
    ranks = [min(n - 1, round(p / 100 * (n - 1))) for p in PERCENTILES]
    part = np.partition(flat.transpose(1, 2).numpy(), ranks, axis=-1)  # [H, D, N]
    pct = [torch.from_numpy(part[..., r]) for r in ranks]
    # Moments in float32: torch reduces with pairwise sums, accurate to ~1e-6 relative here,
    # and float64 copies would double the cost of the whole analysis.
    centred = x - x.mean(dim=(0, 2, 3)).view(1, h, 1, 1)
    c2 = centred * centred
    var = c2.mean(dim=(0, 2, 3))
    kurt = (c2 * c2).mean(dim=(0, 2, 3)) / var.clamp_min(1e-30) ** 2
    energy = (x * x).sum(dim=(0, 2)).double()  # [H, D]
    sample_mask, _ = _flag(a.amax(dim=2), threshold)  # [S, H, D]
    sample_frac = sample_mask.double().mean(dim=0)  # [H, D]
    ratio = torch.where(med.unsqueeze(-1) > 0, absmax / med.unsqueeze(-1).clamp_min(1e-30),
                        torch.zeros_like(absmax))
    out = []
    for i in range(h):
        outliers = [int(c) for c in mask[i].nonzero().flatten()]
        tok = _top_membership(flat[i], outliers)
        chans = tuple(OutlierChannel(c, _r(absmax[i, c]), _r(ratio[i, c]), _r(tok[j]),
                                     _r(sample_frac[i, c])) for j, c in enumerate(outliers))
        info = {
            "median_absmax": _r(med[i]), "max_ratio": _r(ratio[i].max()),
            "kurtosis": _r(kurt[i]) if var[i] > 0 else 0.0, "outliers": chans,
            "channel_absmax": tuple(_r(v) for v in absmax[i].tolist()),
            "channel_p50": tuple(_r(v) for v in pct[0][i].tolist()),
            "channel_p99": tuple(_r(v) for v in pct[1][i].tolist()),
        }
        out.append((_Raw(absmax[i], energy[i], flat[i], outliers), info))
    return out


def _rope_shifts(pre: _Raw, post: _Raw, rotary_dim: int, layout: str) -> tuple[RopeShift, ...]:
    post_tok = _top_membership(post.abs_flat, pre.outliers)
    post_flag = set(post.outliers)
    out = []
    for i, c in enumerate(pre.outliers):
        p = partner_channel(c, rotary_dim, layout) if rotary_dim else None

        def share(raw: _Raw, c=c, p=p) -> float:
            if p is None:
                return 0.0
            tot = float(raw.energy[c] + raw.energy[p])
            return float(raw.energy[p]) / tot if tot > 0 else 0.0

        out.append(RopeShift(
            channel=c, partner=p,
            partner_share_pre=_r(share(pre)), partner_share_post=_r(share(post)),
            absmax_pre=_r(pre.absmax[c]), absmax_post=_r(post.absmax[c]),
            partner_absmax_pre=_r(pre.absmax[p]) if p is not None else 0.0,
            partner_absmax_post=_r(post.absmax[p]) if p is not None else 0.0,
            token_stability_post=_r(post_tok[i]), outlier_post=c in post_flag,
            partner_outlier_post=p in post_flag))
    return tuple(out)


def _r(v) -> float:
    """Round for JSON/display (5 significant digits is far below the fp16 storage noise)."""
    f = float(v)
    return float(f"{f:.5g}") if math.isfinite(f) else f


def iter_layer_stats(cap, layers: Sequence[int], kv_heads: Sequence[int],
                     families: Sequence[str], threshold: float) -> Iterator[list[HeadStats]]:
    """Yield the ``HeadStats`` of one layer at a time from an open ``Capture``."""
    meta = cap.meta
    groups = meta.shape.num_key_value_groups
    q_heads = [kv * groups + g for kv in kv_heads for g in range(groups)]
    rope_on = meta.shape.has_rope and meta.rotary_dim > 0
    layout = meta.rope_layout if meta.rope_layout in ("half", "interleaved") else "half"
    for layer in layers:
        data = cap.layer(layer)
        stats: list[HeadStats] = []
        for fam in families:
            heads = q_heads if fam == "q" else list(kv_heads)
            raws, infos = {}, {}
            for name in FAMILY_TENSORS[fam]:  # [S, len(heads), T, D], one tensor at a time
                raws[name], infos[name] = zip(*_tensor_raw(data.read(name, heads=heads),
                                                           threshold))
            for name in FAMILY_TENSORS[fam]:
                for i, h in enumerate(heads):
                    rope: tuple[RopeShift, ...] = ()
                    if name in POST_OF and rope_on:
                        rope = _rope_shifts(raws[name][i], raws[POST_OF[name]][i],
                                            meta.rotary_dim, layout)
                    kv = h // groups if fam == "q" else h
                    stats.append(HeadStats(layer=layer, tensor=name, head=h, kv_head=kv,
                                           rope=rope, **infos[name][i]))
        yield stats


def analyze_capture(path: str | os.PathLike, layers: str | Sequence[int] | None = None,
                    heads: str | Sequence[int] | None = None,
                    tensors: str | Sequence[str] | None = FAMILIES,
                    threshold: float = DEFAULT_THRESHOLD,
                    progress: ProgressFn | None = None,
                    on_layer: Callable[[list[HeadStats]], None] | None = None) -> OutlierReport:
    """Outlier statistics of a capture file, one layer in memory at a time.

    ``layers``: spec such as ``"0,4,8-11"`` or indices (default: all captured layers).
    ``heads``: KV heads (spec or indices; default all); query tensors use the query heads of
    those KV heads' GQA groups. ``tensors``: families among ``q, k, v``. ``threshold``: the
    outlier rule's multiple of the median channel abs-max (> 1). ``on_layer`` is called with
    each layer's ``HeadStats`` as soon as it is computed (e.g. to draw figures while streaming).
    """
    t0 = time.perf_counter()
    families = parse_tensors(tensors)
    thr = _check_threshold(threshold)
    with open_capture(path) as cap:
        meta = cap.meta
        layer_idx = _resolve(layers, meta.shape.num_layers, "layer", available=meta.layers)
        kv_heads = _resolve(heads, meta.shape.num_key_value_heads, "KV head")
        collected: list[HeadStats] = []
        for i, stats in enumerate(iter_layer_stats(cap, layer_idx, kv_heads, families, thr)):
            collected.extend(stats)
            if on_layer is not None:
                on_layer(stats)
            if progress is not None:
                progress(i + 1, len(layer_idx), f"layer {layer_idx[i]}")
        return OutlierReport(
            path=str(path), model=meta.model, threshold=thr, tensors=families,
            layers=tuple(layer_idx), kv_heads=tuple(kv_heads),
            num_attention_heads=meta.shape.num_attention_heads,
            num_key_value_heads=meta.shape.num_key_value_heads, head_dim=meta.shape.head_dim,
            rope_layout=meta.rope_layout, rotary_dim=meta.rotary_dim,
            num_samples=meta.num_samples, num_tokens=meta.num_tokens,
            heads=tuple(collected), seconds=round(time.perf_counter() - t0, 3))


def read_head(path: str | os.PathLike, layer: int, tensor: str, head: int):
    """``[T, D]`` float32 tensor of one head in the first sample (for heatmaps)."""
    with open_capture(path) as cap:
        shape = cap.meta.shape
        limit = shape.num_attention_heads if tensor.startswith("q") else shape.num_key_value_heads
        if not 0 <= head < limit:
            raise InputError(f"Head {head} of {tensor} outside 0-{limit - 1}.")
        return cap.layer(layer).read(tensor, samples=[0], heads=[head])[0, 0]
