"""transformers' ``QuantizedCache`` with the HQQ backend as an engine setting:
``transformers:hqq-B[:axis_key=A][:axis_value=A][:group=G][:residual=R]`` (``HqqSetting``).

What the real cache does (transformers 5.24 ``cache_utils.HQQQuantizedLayer`` over hqq 0.2.8
``hqq.core.quantize.Quantizer.quantize``, called with ``optimize=True``, ``round_zero=False``):

- the ``[B, H, T, D]`` tensor is flattened row-major and cut into groups of ``G`` elements:
  ``axis=1`` groups ``G`` consecutive elements (``G`` channels of one token, as quanto's
  ``axis=0``); ``axis=0`` groups the ``G`` elements ``numel / G`` apart (one channel, tokens
  spread over the whole history and across heads);
- each group starts from a min/max grid of ``2^B - 1`` steps, then its zero point (not its
  scale) is refined by HQQ's half-quadratic solver (``optimize_weights_proximal_legacy``: an
  l_0.7 shrinkage of the error, up to 20 steps, stopped when the tensor's mean absolute error
  stops falling); scale and zero are kept in the model's dtype;
- like quanto, ``R`` tokens stay exact and the whole (dequantized) history is re-quantized
  whenever the window fills.

The simulation (``kvconfig``): ``axis=1`` -> per-token groups of ``G`` channels with
``fit="hqq"`` (the same zero refinement, per flush block: ``kvlens.quant.reference``), each
window block quantized once (the real cache's re-quantization regroups nothing there when ``G``
divides head_dim); ``axis=0`` -> the ``hqq-strided`` layout (``kvlens.layouts.hqq_strided``),
which does what the real layer does: hqq's strided groups over the whole history, re-quantized
whole at every flush. A window of ``R`` exact tokens flushed whole. What still differs (when the
prompt is quantized, the early stop of ``axis=1`` measured over a flush block, held bytes) is
in docs/lab-notes/transformers-caches.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlens.config.quantized_layer import QuantizedLayerSetting
from kvlens.layouts.hqq_strided import HqqStrided
from kvlens.quant import QuantSpec

HQQ_BITS = (1, 2, 3, 4, 8)  # transformers' HQQQuantizedLayer accepts these nbits
HQQ_AXES = (0, 1)  # hqq's axis: 1 = consecutive elements, 0 = strided (module docstring)


@dataclass(frozen=True)
class HqqSetting(QuantizedLayerSetting):
    """transformers ``QuantizedCache(backend="hqq", ...)`` (``QuantizedLayerSetting``)."""

    backend: ClassVar[str] = "hqq"
    bit_widths: ClassVar[tuple[int, ...]] = HQQ_BITS
    axes: ClassVar[tuple[int, ...]] = HQQ_AXES
    # the kvlens granularity of hqq's axis=1 (axis=0 is the hqq-strided layout: ``spec``)
    granularity: ClassVar[dict[int, str]] = {1: "per-token"}
    fit: ClassVar[str] = "hqq"

    def spec(self, axis: int) -> QuantSpec | HqqStrided:
        if axis == 0:
            return HqqStrided(self.bits, self.group)
        return super().spec(axis)
