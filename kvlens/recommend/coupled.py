"""Coupled (CQ) cache configs from a capture (research, issue #50; not a ``recommend`` default).

``fit_codebooks(capture, key, value)`` fits, per captured layer, the coupled codebooks of the
keys and values (``kvlens.quant.coupled.fit_coupled``: post-RoPE keys ``k``, as the cache stores
them, values ``v``, and the layer's queries ``q`` for a ``weighted`` key spec) on the capture's
samples, so codebooks are fitted on the capture's text only. ``coupled_config`` builds the KV
config that stores every compressed layer with those specs (the codebooks in
``coupled_codebooks``, ``kvlens.config.coupled``), beside the residual window, flush block and
sinks ``recommend`` uses by default; ``capture_shape`` is the shape its held bits are counted
at (``kvlens.cache.layout.config_bits``), so a study can pair it with a recommendation at equal
held bits (``benchmarks/studies/coupled_kld.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlens.cache.layout import ModelShape, shape_of_capture
from kvlens.capture.store import open_capture
from kvlens.config import KVConfig, LayerKV, MikvSettings
from kvlens.errors import InputError
from kvlens.quant.coupled import CoupledCodebooks, CoupledSpec, coupled_arrays, fit_coupled

#: the window, flush block and sinks of a coupled config: recommend's defaults
#: (``RecommendOptions``: the largest default window, ``flush``, ``sinks``)
RESIDUAL_TOKENS, FLUSH_TOKENS, SINK_TOKENS = 128, 32, 4


def fit_codebooks(capture: str, key: CoupledSpec | None, value: CoupledSpec | None,
                  samples: Sequence[int] | None = None, progress=lambda msg: None
                  ) -> dict[int, dict[str, CoupledCodebooks]]:
    """Per captured layer, ``{"key": books, "value": books}`` (a tensor whose spec is None is
    left out) fitted on the capture's ``samples`` (None: all)."""
    if key is None and value is None:
        raise InputError("Give a coupled key spec, a value spec or both.")
    out: dict[int, dict[str, CoupledCodebooks]] = {}
    with open_capture(capture) as cap:
        picked = None if samples is None else list(samples)
        for layer in cap.layers:
            data = cap.layer(layer)
            books = {}
            if key is not None:
                q = data.read("q", picked).float() if key.weighted else None
                books["key"] = fit_coupled(data.read("k", picked).float(), key, q)
            if value is not None:
                books["value"] = fit_coupled(data.read("v", picked).float(), value)
            out[layer] = books
            progress(f"layer {layer}: coupled codebooks fitted")
    return out


def coupled_config(name: str, key: CoupledSpec | None, value: CoupledSpec | None,
                   books: dict[int, dict[str, CoupledCodebooks]] | None, num_layers: int,
                   residual_tokens: int = RESIDUAL_TOKENS, flush_tokens: int = FLUSH_TOKENS,
                   sink_tokens: int = SINK_TOKENS, fp_dtype: str = "float16",
                   exact_layers: Sequence[int] = ()) -> KVConfig:
    """Every layer of a ``num_layers`` model stores keys with ``key`` and values with ``value``
    (None: kept at ``fp_dtype``) and ``books`` (``fit_codebooks``; None: no codebooks, a config
    to price, ``kvlens.cache.layout``, not to run), a residual window of ``residual_tokens``
    flushed ``flush_tokens`` at a time and the first ``sink_tokens`` kept exact;
    ``exact_layers`` are not compressed."""
    missing = [] if books is None else [
        i for i in range(num_layers) if i not in exact_layers and i not in books]
    if missing:
        raise InputError(f"No coupled codebooks for layers {missing} (fit_codebooks on a "
                         "capture of every layer).")
    compressed = LayerKV(key, value, residual_tokens,
                         flush_tokens=flush_tokens if flush_tokens < residual_tokens else 0)
    layers = {i: LayerKV() for i in exact_layers}
    entries = {} if books is None else {
        i: {t: coupled_arrays(b) for t, b in books[i].items()}
        for i in range(num_layers) if i not in exact_layers}
    return KVConfig(name, compressed, layers,
                    mikv=MikvSettings(0.0, sink_tokens, "off") if sink_tokens else None,
                    fp_dtype=fp_dtype, coupled_codebooks=entries,
                    description=f"coupled keys {key.name if key else 'exact'}, values "
                                f"{value.name if value else 'exact'} (research, issue #50)")


def capture_shape(capture: str) -> ModelShape:
    """The ``ModelShape`` of a captured model (layers, KV heads, head_dim, sliding windows)."""
    with open_capture(capture) as cap:
        windows = [cap.layer(i).attrs.sliding_window or None for i in cap.layers]
        return shape_of_capture(cap.meta, windows)
