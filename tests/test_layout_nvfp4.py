"""The NVFP4 layout (``kvlens.layouts.blockfloat.NvFp4``, semantics ``kvlens.quant.fp4``): its
bytes bit for bit against torchao's NVFP4 reference quantizer and against a float64 reference
written from the bit fields, its store against its reference, and a config naming it read, run
and counted by the rest of kvlens with exactly the predicted bytes."""

from __future__ import annotations

import pytest
import torch
from layout_checks import (
    check_generating_cache,
    check_streaming_store,
    e2m1_reference_code,
    e4m3_reference,
    outlier_tensor,
)
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

from kvlens.config import KVConfig, LayerKV, config_from_dict, load_config, save_config
from kvlens.errors import ConfigError
from kvlens.layouts import Layout, kinds, layout_of
from kvlens.quant.fp4 import dequantize_nvfp4, quantize_nvfp4

SHAPES = [(1, 1, 1, 64), (2, 3, 5, 64), (1, 2, 7, 96), (1, 4, 3, 128), (2, 1, 9, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("calibrated", [True, False], ids=["amax-scale", "scale-1"])
def test_bytes_equal_torchao(shape, calibrated):
    """torchao's ``nvfp4_quantize`` (two-level scaling) over the rows of ``[B*H*T, D]``: the same
    E4M3 block-scale bytes wherever its scale is a normal E4M3 number (it floors scales at the
    smallest normal, the engines' cast does not) and the same packed codes everywhere."""
    x = outlier_tensor(shape)
    g = per_tensor_amax_to_scale(x.abs().amax()) if calibrated else torch.tensor(1.0)
    want_scales, want_codes = nvfp4_quantize(x.reshape(-1, shape[-1]).contiguous(), 16, g)
    codes, scales = quantize_nvfp4(x, float(g))
    want_scales = want_scales.view(torch.uint8).reshape(scales.shape)
    assert torch.equal(codes, want_codes.reshape(codes.shape))
    normal = want_scales >= 8  # E4M3 bytes 0x08.. are normal numbers
    assert normal.any()
    assert torch.equal(scales[normal], want_scales[normal])
    assert (scales[~normal] <= want_scales[~normal]).all()


def reference_nvfp4(x: torch.Tensor, g: float) -> tuple[list[int], list[int]]:
    """NVFP4 element by element: the block scale the nearest E4M3 value of ``amax / 6 / g``
    (float32 division, as the engines compute it), each element ``x * ((1 / g) / s)`` (float32)
    to the nearest E2M1 code, ties to even, saturating; a zero scale stores zeros."""
    f32 = torch.tensor
    codes, scales = [], []
    for block in x.reshape(-1, 16):
        amax = block.abs().max()
        s_byte, s = e4m3_reference(float(amax / 6.0 / f32(g)))
        scales.append(s_byte)
        recip = (1.0 / f32(g)) / f32(s) if s > 0 else f32(0.0)
        codes += [e2m1_reference_code(float(v * recip)) for v in block]
    packed = [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]
    return packed, scales


@pytest.mark.parametrize("g", [1.0, 0.003, 2.5])
def test_bytes_equal_a_bit_field_reference_with_zeros_and_subnormal_scales(g):
    """Zero blocks, blocks whose scale is subnormal in E4M3 or saturates at 448, exact ties of
    E2M1: the stored bytes are the bit-field reference's."""
    x = outlier_tensor((1, 2, 3, 64))
    x[0, 0, 0, :16] = 0  # a zero block: scale byte 0, codes 0
    row = x[0, 0, 1, :16]
    x[0, 0, 1, :16] = row / row.abs().max() * 0.02 * g  # a subnormal E4M3 block scale
    x[0, 1, 0, 16:32] *= 1e5  # a block scale that saturates at 448 (then codes saturate at 6)
    x[0, 1, 2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.5 * g
    codes, scales = quantize_nvfp4(x, g)
    want_codes, want_scales = reference_nvfp4(x, g)
    assert scales.flatten().tolist() == want_scales
    assert codes.flatten().tolist() == want_codes
    assert 0 in want_scales and any(0 < s < 8 for s in want_scales)


def test_read_back_is_code_times_scales():
    x = outlier_tensor((2, 2, 4, 32))
    g = float(x.abs().max()) / (448 * 6)  # a calibrated global scale: no block scale saturates
    codes, scales = quantize_nvfp4(x, g)
    got = dequantize_nvfp4(codes, scales, g)
    # 4-bit floats: within half a step of the block's grid (a step of 2 at the top: 4 -> 6)
    blocks = x.unflatten(-1, (-1, 16))
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (got.unflatten(-1, (-1, 16)) - blocks).abs()
    assert (err <= amax / 6 * 1.0625 + 1e-6).all()
    assert 0 < (got - x).norm() < 0.2 * x.norm()


def test_store_reads_back_the_reference_and_streams():
    from kvlens.layouts.blockfloat import NvFp4

    layout = layout_of(NvFp4(0.02))
    assert isinstance(layout, Layout) and "nvfp4" in kinds()
    x = outlier_tensor((2, 3, 12, 64))
    check_streaming_store(layout, x, 32 + 4)


def _config(g: float = 1.0) -> KVConfig:
    from kvlens.layouts.blockfloat import NvFp4

    return KVConfig("nvfp4", LayerKV(NvFp4(g), NvFp4(g / 2), residual_tokens=8))


def test_config_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.json"
    save_config(_config(0.125), path)
    assert load_config(path) == _config(0.125)
    data = _config().to_dict()
    data["default"]["key"]["bits"] = 4
    with pytest.raises(ConfigError, match="Unknown nvfp4 spec keys"):
        config_from_dict(data)
    data = _config().to_dict()
    data["default"]["key"]["global_scale"] = 0
    with pytest.raises(ConfigError, match="Invalid nvfp4 global_scale 0"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="must be a multiple of 16; got 40"):
        _config().default.key.check(8, 40, "layer 0")


def test_a_cache_of_it_generates_and_holds_the_predicted_bytes():
    """Prefill 20 tokens, decode 12: the logits move (history is read back in 4-bit floats) but
    stay near the exact model's, and the bytes held are the layout's prediction."""
    check_generating_cache(_config(), 0.2, 16, 2)
