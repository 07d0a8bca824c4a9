"""The ``predict`` variant of ``compare-axes``: AQUA-KV-style cross-layer prediction with only
the residual quantized (``kvlens.quant.predict``), chained over layers as a decoder would run it.

For every swept layout (uniform axis x bits x group size x key stage, and codebooks named with
``+predict``) one chain runs over the captured layers in order, holding the previous layer's
*reconstruction* under that layout:

- keys of layer ``l``: predicted from the reconstructed keys of layer ``l-1`` in the same stage
  (post-RoPE from post-RoPE, pre-RoPE from pre-RoPE), ``k_hat = p + Q(k - p)``;
- values of layer ``l``: predicted from the layer's reconstructed keys and the reconstructed
  values of layer ``l-1``. The keys are the ones a cache at the same code bits would hold:
  per-channel keys with the same bits and group size (codebook values: the largest swept group
  size), pre-RoPE where the capture has RoPE (values carry no position, so the position-free
  keys are the better features), themselves predicted along their own chain;
- the first layer of a chain (layer 0, or a layer whose predecessor was not captured) has no
  previous layer: its keys are predicted by the intercept alone (the mean key, as centering)
  and its values from its keys alone.

Predictors are fitted per layer on the reconstructed inputs of the other samples and applied to
each sample's reconstructed inputs (``cross_fit_predict``: no sample is predicted by a map
fitted on it), or, with a calibration capture (``CompareConfig.predict_calibration``), on every
sample of that capture along its own chain of reconstructions (``fit_predict``) and applied to
every sample of the measured one: fitted on one text, measured on another. Fitted codebooks are fitted on the residual they code (in-sample, as the other
codebook variants).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvlens.analysis.compare.config import AXES, CompareConfig
from kvlens.quant import (
    CodebookSpec,
    QuantSpec,
    RotationSpec,
    fake_quantize,
    fake_quantize_codebook,
)
from kvlens.quant.predict import (
    DEFAULT_RIDGE,
    cross_fit_predict,
    explained_variance,
    fit_predict,
    predictor_bytes,
    quantize_residual,
)

PREDICT = "predict"


def uses_prediction(config: CompareConfig) -> bool:
    """Whether the sweep has a ``predict`` variant or a ``+predict`` codebook."""
    return PREDICT in config.variants or any(
        PREDICT in o for *_, o in config.codebook_settings())


def value_key_stage(rope_ok: bool) -> str:
    """The stage of the keys the value predictor reads: pre-RoPE where the capture has RoPE."""
    return "pre" if rope_ok else "post"


@dataclass
class PredictChain:
    """The previous layer's reconstruction of every predicted layout, carried from layer to
    layer (``advance``), and what each prediction explained."""

    config: CompareConfig
    rope_ok: bool
    ridge: float = DEFAULT_RIDGE
    prev_layer: int | None = None
    prev: dict[tuple, object] = field(default_factory=dict)
    cal_prev: dict[tuple, object] = field(default_factory=dict)
    explained: list[dict] = field(default_factory=list)

    def advance(self, layer: int, k, k_pre, v, calibration=None) -> dict[tuple, object]:
        """Reconstruct layer ``layer`` under every predicted layout from the previous layer's
        reconstructions; returns ``{chain key: reconstruction}`` (keys in their stage's frame:
        pre-RoPE keys before RoPE) and keeps them for the next layer.

        ``calibration``: the same layer's ``(k, k_pre, v)`` of another capture of the model;
        the predictors are then fitted on all of its samples (on its own chain of
        reconstructions) and applied to every sample here, instead of leave-one-sample-out.

        Chain keys: ``("key", axis, bits, group_size, stage)``, ``("value", axis, bits,
        group_size)`` for the uniform layouts, ``("key", name, bits, stage)`` and
        ``("value", name, bits)`` for ``+predict`` codebooks."""
        linked = self.prev_layer is not None and layer == self.prev_layer + 1
        prev = self.prev if linked else {}
        cal_prev = self.cal_prev if linked else {}
        frames = {"post": k, "pre": k_pre}
        cal_frames = ({"post": calibration[0], "pre": calibration[1]}
                      if calibration is not None else None)
        hats: dict[tuple, object] = {}
        cal_hats: dict[tuple, object] = {}
        for ckey, code in self._key_layouts():
            stage = ckey[-1]
            inputs = [prev[ckey]] if ckey in prev else []
            cal = None if cal_frames is None else (
                [cal_prev[ckey]] if ckey in cal_prev else [], cal_frames[stage])
            hats[ckey], cal_hats[ckey] = self._step(layer, ckey, frames[stage], inputs, code,
                                                    cal)
        for ckey, code, key_input in self._value_layouts():
            inputs = [hats[key_input]] + ([prev[ckey]] if ckey in prev else [])
            cal = None if cal_frames is None else (
                [cal_hats[key_input]] + ([cal_prev[ckey]] if ckey in cal_prev else []),
                calibration[2])
            hats[ckey], cal_hats[ckey] = self._step(layer, ckey, v, inputs, code, cal)
        self.prev, self.cal_prev, self.prev_layer = hats, cal_hats, layer
        return hats

    def _step(self, layer, ckey, x, inputs, code, cal=None):
        """``(reconstruction, calibration reconstruction or None)`` of one layout's tensor."""
        cal_hat = None
        if cal is None:
            prediction = cross_fit_predict(inputs, x, self.ridge)
        else:
            cal_inputs, cal_x = cal
            prediction, cal_prediction = fit_predict(cal_inputs, cal_x, inputs, x, self.ridge)
            cal_hat = quantize_residual(cal_x, cal_prediction, code)
        ev = explained_variance(x, prediction)
        self.explained.append({
            "layer": layer, "tensor": ckey[0], "layout": _layout_name(ckey),
            "inputs": len(inputs), "explained_variance": float(ev.mean()),
        })
        return quantize_residual(x, prediction, code), cal_hat

    def _key_layouts(self) -> list[tuple[tuple, Callable]]:
        config = self.config
        out: dict[tuple, Callable] = {}
        if "key" in config.tensors and PREDICT in config.variants:
            for axis in AXES:
                for bits in config.bits:
                    for g in config.group_sizes:
                        for stage in config.stages:
                            out[("key", axis, bits, g, stage)] = _uniform(bits, axis, g)
        if "value" in config.tensors:  # the keys the value predictors read
            stage = value_key_stage(self.rope_ok)
            for bits, g in self._value_key_specs():
                out.setdefault(("key", "per-channel", bits, g, stage),
                               _uniform(bits, "per-channel", g))
        if "key" in config.tensors:
            for name, base, opts in config.codebook_settings():
                if PREDICT in opts:
                    for bits in config.bits:
                        stage = "pre" if "pre" in opts else "post"
                        out[("key", name, bits, stage)] = self._codebook(bits, base, opts)
        return list(out.items())

    def _value_key_specs(self) -> list[tuple[int, int]]:
        config = self.config
        specs = []
        if PREDICT in config.variants:
            specs += [(b, g) for b in config.bits for g in config.group_sizes]
        if any(PREDICT in o for *_, o in config.codebook_settings()):
            specs += [(b, max(config.group_sizes)) for b in config.bits]
        return list(dict.fromkeys(specs))

    def _value_layouts(self) -> list[tuple[tuple, Callable, tuple]]:
        config = self.config
        if "value" not in config.tensors:
            return []
        stage = value_key_stage(self.rope_ok)
        out = []
        if PREDICT in config.variants:
            for axis in AXES:
                for bits in config.bits:
                    for g in config.group_sizes:
                        out.append((("value", axis, bits, g), _uniform(bits, axis, g),
                                    ("key", "per-channel", bits, g, stage)))
        for name, base, opts in config.codebook_settings():
            if PREDICT in opts and not opts & {"center", "pre"} and base != "weighted":
                for bits in config.bits:
                    out.append((("value", name, bits), self._codebook(bits, base, opts),
                                ("key", "per-channel", bits, max(config.group_sizes), stage)))
        return out

    def _codebook(self, bits, base, opts):
        spec = CodebookSpec(bits, base, RotationSpec(self.config.rotation_seed),
                            renormalize="renorm" in opts)
        return lambda r: fake_quantize_codebook(r, spec)


def _uniform(bits: int, axis: str, g: int):
    spec = QuantSpec(bits, axis, g)
    return lambda r: fake_quantize(r, spec)


def _layout_name(ckey: tuple) -> str:
    if isinstance(ckey[1], str) and ckey[1] in AXES:
        stage = f" {ckey[4]}" if ckey[0] == "key" else ""
        return f"{ckey[2]}b {ckey[1]} G{ckey[3]}{stage}"
    stage = f" {ckey[3]}" if ckey[0] == "key" else ""
    return f"codebook{ckey[2]}:{ckey[1]}{stage}"


def predictor_info(kv_heads: int, tokens: int, head_dim: int) -> dict[str, dict]:
    """What the predictors store per layer (model-side, beside the cache's bytes): float16
    weights and intercept, and those bytes per cached element of one sequence of ``tokens``
    tokens (``8 * bytes / (kv_heads * tokens * head_dim)``) for a layer with a predecessor."""
    elements = kv_heads * tokens * head_dim
    out = {}
    for tensor, inputs, reads in (
        ("key", 1, "the previous layer's reconstructed keys (same stage)"),
        ("value", 2, "the layer's reconstructed keys and the previous layer's reconstructed "
                     "values"),
    ):
        nbytes = predictor_bytes(kv_heads, head_dim, inputs)
        out[tensor] = {
            "reads": reads,
            "bytes_per_layer": nbytes,
            "bits_per_element_at_capture_length": 8 * nbytes / elements,
        }
    return out
