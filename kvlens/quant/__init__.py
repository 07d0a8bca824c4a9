"""Quantization reference library: the one definition of KV-cache quantization semantics, in
plain torch (tensors are ``[B, H, T, D]`` at every public function; each module says what it
owns, docs/internals/architecture.md lists them)."""

from kvlens.quant.codebook import (
    Codebook,
    CodebookSpec,
    CodebookTensor,
    computed_codebook,
    dequantize_codebook,
    fake_quantize_codebook,
    lloyd_max,
    quantize_codebook,
)
from kvlens.quant.formats import (
    FormatSetting,
    engine_rotation,
    fake_quantize_format,
    parse_format,
    parse_format_list,
    rotate_rows,
)
from kvlens.quant.fp8 import FP8Format, TokenHeadFormat, calibrate_scale, fp8_encode
from kvlens.quant.ggml import GGMLBlocks, dequantize_ggml, quantize_ggml
from kvlens.quant.meta8 import fake_quantize
from kvlens.quant.packing import (
    pack_codes,
    pack_unit,
    packed_length,
    unpack_codes,
)
from kvlens.quant.reference import QTensor, dequantize, expand_params, quantize
from kvlens.quant.rotation import (
    RotationSpec,
    hadamard_block_size,
    hadamard_rotation,
    quantize_rotated,
    rotate,
    unrotate,
)
from kvlens.quant.spec import GRANULARITIES, QuantSpec
from kvlens.quant.transforms import (
    apply_balancer,
    fit_balancer,
    outlier_count,
    quantize_pre_rope,
    quantize_with_outliers,
    rope_tables_for,
    split_outliers,
)

__all__ = [
    "Codebook",
    "CodebookSpec",
    "CodebookTensor",
    "computed_codebook",
    "dequantize_codebook",
    "fake_quantize_codebook",
    "lloyd_max",
    "quantize_codebook",
    "FP8Format",
    "FormatSetting",
    "GGMLBlocks",
    "TokenHeadFormat",
    "calibrate_scale",
    "dequantize_ggml",
    "engine_rotation",
    "fake_quantize_format",
    "fp8_encode",
    "parse_format",
    "parse_format_list",
    "quantize_ggml",
    "rotate_rows",
    "GRANULARITIES",
    "QTensor",
    "QuantSpec",
    "RotationSpec",
    "apply_balancer",
    "dequantize",
    "expand_params",
    "fake_quantize",
    "fit_balancer",
    "hadamard_block_size",
    "hadamard_rotation",
    "outlier_count",
    "pack_codes",
    "pack_unit",
    "packed_length",
    "quantize",
    "quantize_pre_rope",
    "quantize_rotated",
    "quantize_with_outliers",
    "rope_tables_for",
    "rotate",
    "split_outliers",
    "unpack_codes",
    "unrotate",
]
