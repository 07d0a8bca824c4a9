"""transformers' ``QuantizedCache`` with the HQQ backend as an engine setting:
``transformers:hqq-B[:axis_key=A][:axis_value=A][:group=G][:residual=R]`` (``HqqSetting``).

The real cache (transformers 5.24 ``cache_utils.HQQQuantizedLayer`` over hqq 0.2.8) groups the
row-major ``[B, H, T, D]`` tensor by ``G`` elements, refines each group's zero with HQQ's
solver, keeps ``R`` tokens exact and re-quantizes the whole history whenever the window fills.
The simulation (``kvconfig``): ``axis=1`` (``G`` consecutive channels of one token) ->
per-token groups with ``fit="hqq"`` (the solver: ``kvlens.quant.reference``), each window block
quantized once (the real re-quantization regroups nothing when ``G`` divides head_dim);
``axis=0`` (groups strided over the whole history) -> the ``hqq-strided`` layout
(``kvlens.layouts.hqq_strided``), which does what the real layer does. What still differs:
docs/lab-notes/transformers-caches.md.
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
