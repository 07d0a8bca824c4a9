"""``compare-axes``: quantization error of keys and values per axis, measured where it matters.

For every captured layer (streamed one at a time) and every swept variant (tensor x axis x bits
x group size x key stage x transform, and each engine format), one tensor is fake-quantized with
the reference library (``kvlens.quant``) while the other two stay exact, and the relative
Frobenius error is measured on the tensor itself and on what attention makes of it
(``kvlens.analysis.metrics.attention_errors_many``). Metrics and the summary:
``docs/compare-axes.md``. Tensors are ``[B, H, T, D]`` (B = samples) throughout.
"""

from kvlens.analysis.compare.config import (
    AXES,
    KEY_METRICS,
    VALUE_METRICS,
    CompareConfig,
    parse_int_list,
    parse_layers,
    parse_name_list,
)
from kvlens.analysis.compare.measure import compare_axes, torch_threads
from kvlens.analysis.compare.records import CompareResult
from kvlens.analysis.compare.rope_tables import layer_rope_tables
from kvlens.analysis.compare.summary import means_by_key

__all__ = [
    "AXES",
    "KEY_METRICS",
    "VALUE_METRICS",
    "CompareConfig",
    "CompareResult",
    "compare_axes",
    "layer_rope_tables",
    "means_by_key",
    "parse_int_list",
    "parse_layers",
    "parse_name_list",
    "torch_threads",
]
