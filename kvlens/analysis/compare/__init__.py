"""``compare-axes``: quantization error of keys and values per axis, measured where it matters.

For every captured layer (streamed one at a time) and every combination of tensor (key, value)
x axis (per-token, per-channel) x bits x group size x key stage (post-RoPE, pre-RoPE) x transform
(plain, balancer, outliers, rotate), and for every engine cache format asked for
(``formats``: ggml q8_0/q4_0/..., fp8, per-token-head int8/int4/fp8, ``kvlens.quant.formats``),
one tensor is fake-quantized with the reference library (``kvlens.quant``) while the other two
stay exact, and the relative Frobenius error
``||X - X_hat||_F / ||X||_F`` is measured on the tensor itself and on what attention makes of it
(``kvlens.analysis.metrics.attention_errors_many``: the model's causal mask, GQA mapping, scaling and
softcap, reference attention computed once per layer for all variants).

Metrics (definitions in ``docs/compare-axes.md``):

- key variants: ``reconstruction`` (per KV head), ``score`` (pre-softmax logits, causal entries
  only), ``attention_weights`` (post-softmax) and ``attention_output`` (per query head);
- value variants: ``reconstruction`` (per KV head) and ``attention_output`` (per query head).

Every error pools all samples and tokens of one (layer, head) before taking the ratio. The
summary averages those per-head errors over layers and heads (each head counts once), names
the winning axis per metric and flags where reconstruction and attention output disagree.
Tensors are ``[B, H, T, D]`` (B = samples) throughout.

Modules, in dependency order: ``config`` (``CompareConfig``, the names records are keyed by, the
command-line parsers), ``records`` (``Record``, ``CompareResult``), ``rope_tables`` (RoPE tables
re-created and checked per layer, for pre-RoPE keys), ``summary`` (means, winners, the KIVI
check, engine-format info) and ``measure`` (``compare_axes``: the sweep itself). This package
names the public API; import from ``kvlens.analysis.compare``.
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
