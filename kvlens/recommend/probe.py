"""The model ``recommend`` loads beside the capture, and the retrieval probe it runs with it.

``load_model_for`` loads the captured model (or ``--model``; ``kvlens.capture.source``) for the
layer weights and the probe, or notes why not when the ``auto`` settings allow going without.
``add_retrieval_errors`` captures the model on a retrieval prompt (``kvlens.text.prompts``) and
adds each candidate's error at the answer position to its text errors.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from kvlens.capture.run import capture_model
from kvlens.capture.source import CaptureModel, model_spec_from_capture
from kvlens.capture.store import open_capture
from kvlens.errors import InputError, KvlensError, PlacementError
from kvlens.model.architecture import describe
from kvlens.model.placement import input_device
from kvlens.recommend.layer_errors import measure_layer
from kvlens.recommend.options import RecommendOptions
from kvlens.recommend.parallel import map_layers
from kvlens.text.prompts import retrieval_text


def load_model_for(cap, opts: RecommendOptions, notes: list[str]):
    """The capture's model (or ``opts.model``) for sensitivity and the retrieval probe:
    ``(model, tokenizer)``, or ``(None, None)`` with a note when "auto" settings allow."""

    meta = cap.meta
    spec = opts.model or model_spec_from_capture(meta)
    place = {"dtype": opts.dtype, "device_map": opts.device_map,
             "max_memory": opts.max_memory, "offload_folder": opts.offload_folder}
    try:
        model, tokenizer = CaptureModel(cap.path, spec, place).get()
        info = describe(model)
        if (info.num_layers, info.head_dim, info.num_key_value_heads) != (
                meta.shape.num_layers, meta.shape.head_dim, meta.shape.num_key_value_heads):
            raise InputError(f"Model {spec} does not match the capture (layers/head_dim/KV "
                             "heads differ).")
    except KvlensError as exc:
        required = (opts.sensitivity in ("model", "layout") and not opts.layer_weights) or \
            opts.retrieval == "on"
        # a model or a placement the user asked for must work: no silent fallback
        if required or opts.model is not None or isinstance(exc, PlacementError):
            raise
        notes.append(f"uniform layer weights and no retrieval probe: the model is unavailable "
                     f"({exc})")
        return None, None
    return model, tokenizer


def add_retrieval_errors(model, tokenizer, cands, opts, tables, balancers, notes, progress,
                         workers: int = 1):
    """Add ``retrieval_weight`` x each candidate's error at the retrieval probe's answer
    position (``kvlens.text.prompts``) to the text errors in ``tables`` (layers measured on
    ``workers`` processes, ``kvlens.recommend.parallel``)."""

    text, _ = retrieval_text(tokenizer, opts.retrieval_tokens)
    ids = tokenizer(text, return_tensors="pt").input_ids.to(input_device(model))
    probe_opts = replace(opts, samples=None, tokens=None)
    with tempfile.TemporaryDirectory(prefix="kvlens-probe-") as tmp:
        path = Path(tmp) / "probe.h5"
        capture_model(model, ids, path)
        with open_capture(path) as cap:
            layers = cap.meta.layers
        extras = map_layers(_probe_layer, path, layers,
                            (cands, probe_opts, balancers), workers,
                            progress, label="retrieval probe layer")
    for table, extra in zip(tables, extras):
        for key, (out, _, _) in extra.items():
            if key in table:
                o, sc, rc = table[key]
                table[key] = (o + opts.retrieval_weight * out, sc, rc)
    notes.append(f"errors include a retrieval probe ({ids.shape[1]} tokens, answer position, "
                 f"weight {opts.retrieval_weight:g}): see kvlens.text.prompts")


def _probe_layer(layer, meta, cands, opts, balancers):
    """One layer's errors at the probe's answer position (``map_layers``' work), with the
    balancer fitted on the capture (what the config stores)."""
    return measure_layer(layer, meta, cands, opts, queries=4,
                         balancer=balancers.get(layer.index))[0]
