"""RoPE tables that reproduce a capture's stored keys from its stored pre-RoPE keys.

Quantizing keys before RoPE (``compare-axes --stages pre``, ``recommend``'s pre-RoPE candidates)
means re-rotating them with the model's own tables. Captures store each layer's tables
(``kvlens.capture.store.StoredRope``): exact for every RoPE variant (YaRN, LongRoPE, Llama 3,
dynamic scaling, per-layer thetas) and used as they are. Older captures record only
``rope_theta`` and the layout, so for them the tables are re-created (a theta search) and checked
against the stored pair, per layer.
"""

from __future__ import annotations

import math

from kvlens.analysis.attention import rel_error
from kvlens.errors import InputError
from kvlens.quant import rope_tables_for
from kvlens.rope import apply_rope

# A stored k_pre re-rotated with the default RoPE tables must reproduce the stored post-RoPE k
# to storage precision (fp16 rounding of both tensors gives ~1e-3); a different RoPE (YaRN,
# linear scaling, another theta) misses by far more.
ROPE_CHECK_TOLERANCE = 1e-2


def rope_tables(meta, n_samples: int, n_tokens: int, theta: float):
    """Default-RoPE ``(cos, sin)`` at ``theta`` for positions ``0..n_tokens-1`` of ``n_samples``
    windows of a capture; check them with ``rope_rebuild_error`` before trusting them (scaled
    RoPE variants differ; ``layer_rope_tables`` does both)."""
    import torch

    positions = torch.arange(n_tokens).expand(n_samples, -1)
    return rope_tables_for(positions, meta.shape.head_dim, float(theta),
                           meta.rotary_dim or meta.shape.head_dim, meta.rope_layout)


COMMON_ROPE_THETAS = (10000.0, 500000.0, 1000000.0, 100000.0, 1000.0, 5000000.0, 10000000.0,
                      50000.0, 250000.0, 2000000.0)


def layer_rope_tables(meta, k, k_pre, n_tokens: int | None = None, stored=None):
    """``(tables, theta)`` reproducing one layer's stored keys from its stored pre-RoPE keys
    (``k``, ``k_pre``: ``[S, H, T, D]``, the first T positions of the capture's windows), or
    ``(None, None)``. ``stored`` (``LayerData.rope()``): the layer's captured tables, used as
    they are (``theta`` is then ``None``), checked like any others; a layer that applies no
    RoPE has none. Without them (older captures) tries the capture's recorded ``rope_theta``,
    then common thetas, then a search over theta (log scale) on the rebuild error; a theta
    counts only when its rebuild error is within ``ROPE_CHECK_TOLERANCE``. Why per layer: models
    such as Gemma3 use one theta on their sliding-window layers and another on their global
    ones, and a capture may not record them (Gemma3's config keeps them per layer type); the
    check keeps scaled variants (YaRN...) out."""
    if meta.rope_layout not in ("half", "interleaved"):
        return None, None
    n_tok = k.shape[2] if n_tokens is None else n_tokens

    def rebuilds(full) -> bool:
        """Whether tables ``full`` rebuild the stored keys from the pre-RoPE ones."""
        return rope_rebuild_error(k[:, :, :n_tok], k_pre[:, :, :n_tok], full,
                                  meta.rope_layout) <= ROPE_CHECK_TOLERANCE

    if stored is not None:
        if not stored.applies:
            return None, None
        full = stored_tables(stored, k.shape[0], n_tok)
        return (full, None) if rebuilds(full) else (None, None)
    probe = slice(0, min(k.shape[2], 256))
    kp, pp = k[:1, :, probe], k_pre[:1, :, probe]

    def err(theta):
        return rope_rebuild_error(kp, pp, rope_tables(meta, 1, kp.shape[2], theta),
                                  meta.rope_layout)

    tried = ([float(meta.shape.rope["rope_theta"])] if "rope_theta" in meta.shape.rope else []) + \
        list(COMMON_ROPE_THETAS)
    found = next((t for t in tried if err(t) <= ROPE_CHECK_TOLERANCE), None)
    if found is None:  # log-grid, then Brent's method between the best point's neighbours
        from scipy.optimize import minimize_scalar

        grid = [10 ** (2 + i * 6 / 240) for i in range(241)]
        errs = [err(t) for t in grid]
        i = min(range(len(grid)), key=errs.__getitem__)
        lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
        t = math.exp(minimize_scalar(lambda x: err(math.exp(x)), bounds=(lo, hi),
                                     method="bounded", options={"xatol": 1e-9}).x)
        found = t if err(t) <= ROPE_CHECK_TOLERANCE else None
    if found is None:
        return None, None
    full = rope_tables(meta, k.shape[0], n_tok, found)
    return (full, found) if rebuilds(full) else (None, None)


def stored_tables(stored, n_samples: int, n_tokens: int):
    """A layer's captured tables (``StoredRope``) for the first ``n_tokens`` positions of
    ``n_samples`` windows: ``(cos, sin)`` ``[S, T, R]``."""
    return tuple(t[:n_tokens].expand(n_samples, -1, -1) for t in (stored.cos, stored.sin))


def rope_rebuild_error(k, k_pre, tables, layout: str) -> float:
    """Relative error of re-applying RoPE (``tables``) to stored pre-RoPE keys vs stored keys."""
    return rel_error(k, apply_rope(k_pre, *tables, layout))


def checked_layer_tables(k, k_pre, meta, layer: int, stored=None):
    """The layer's RoPE tables (``layer_rope_tables``, with its captured tables ``stored`` when
    the capture has them) or an ``InputError`` saying why not."""
    tables, _ = layer_rope_tables(meta, k, k_pre, stored=stored)
    if tables is None and stored is not None:
        if not stored.applies:
            raise InputError(f"Layer {layer} applies no RoPE (a NoPE layer): its keys have no "
                             "pre-RoPE form to quantize. Use --stages post.")
        err = rope_rebuild_error(k, k_pre, stored_tables(stored, k.shape[0], k.shape[2]),
                                 meta.rope_layout)
        raise InputError(
            f"Layer {layer}: the capture's own RoPE tables re-applied to its stored pre-RoPE "
            f"keys miss the stored keys (relative error {err:.3g} > {ROPE_CHECK_TOLERANCE}); "
            "the capture is inconsistent. Re-run `kvlens capture`, or use --stages post.")
    if tables is None:
        theta = meta.shape.rope.get("rope_theta")
        err = rope_rebuild_error(k, k_pre, rope_tables(meta, k.shape[0], k.shape[2],
                                                       theta or 10000.0), meta.rope_layout)
        raise InputError(
            f"Layer {layer}: re-applying default RoPE ({meta.rope_layout} layout, rotary_dim "
            f"{meta.rotary_dim}, positions 0..T-1) to the stored pre-RoPE keys at no theta "
            f"reproduces the stored keys (at the recorded theta {theta}: relative error "
            f"{err:.3g} > {ROPE_CHECK_TOLERANCE}); the model uses a RoPE variant kvlens cannot "
            f"re-create (rope type {meta.shape.rope.get('rope_type', 'unknown')!r}, e.g. YaRN or "
            "linear scaling). Use --stages post."
        )
    return tables
