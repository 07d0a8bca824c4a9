"""The MXFP8 layout (``kvlens.layouts.blockfloat.MxFp8``, SGLang's ``mxfp8`` KV cache), added
through the layout protocol alone: its bytes against torchao's MX reference (``to_mx``) and an
independent E4M3/E8M0 reference, its store against its reference, and a config naming it read,
validated, run, priced and counted by the rest of kvlens unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from layout_checks import (
    E4M3_POSITIVE,
    check_generating_cache,
    check_streaming_store,
    nearest_code,
    outlier_tensor,
)
from torchao.prototype.mx_formats.mx_tensor import to_mx

from kvlens.config import KVConfig, LayerKV, config_from_dict, load_config, save_config
from kvlens.errors import ConfigError
from kvlens.layouts import Layout, kinds, layout_of
from kvlens.layouts.blockfloat import MxFp8
from kvlens.quant.mxfp8 import quantize_mxfp8


def reference_mxfp8(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The OCP MX v1.0 conversion, element by element in float64: the shared exponent from
    ``frexp`` of the block's largest magnitude, the nearest E4M3 value (ties to the even code),
    saturating at 448."""
    out_codes, out_scales = [], []
    for block in x.double().reshape(-1, 32).tolist():
        amax = max(abs(v) for v in block)
        e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
        out_scales.append(e + 127)
        for v in block:
            t = min(448.0, abs(v) / 2.0 ** e)
            code = nearest_code(E4M3_POSITIVE, t)
            out_codes.append(code | (0x80 if math.copysign(1.0, v) < 0 else 0))
    return out_codes, out_scales


@pytest.mark.parametrize("shape", [(1, 1, 1, 32), (2, 3, 5, 64), (1, 2, 7, 96)])
def test_bytes_equal_an_independent_reference(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.exp(4 * torch.randn(*shape, generator=gen))
    x[..., :32] *= 0  # an all-zero block
    x.view(-1)[-1] = 3e4  # a block whose largest element saturates
    x.view(-1)[-2] = 1e-6  # deep in the subnormal range of its block
    codes, scales = quantize_mxfp8(x)
    want_codes, want_scales = reference_mxfp8(x)
    assert codes.flatten().tolist() == want_codes
    assert scales.flatten().tolist() == want_scales
    assert 0x7E in want_codes  # the saturated element (448) is among them


def test_store_reads_back_the_reference_and_streams():
    layout = layout_of(MxFp8())
    assert isinstance(layout, Layout) and "mxfp8" in kinds()
    x = torch.randn(2, 3, 12, 64, generator=torch.Generator().manual_seed(1))
    want = check_streaming_store(layout, x, 64 + 2)
    # saturation at 448 can clip a block's largest element by up to 1/8 (the floor rule)
    assert 0 < (want - x).abs().max() < 0.13 * x.abs().max()
    assert (want - x).norm() < 0.05 * x.norm()


def _config() -> KVConfig:
    return KVConfig("mxfp8", LayerKV(MxFp8(), MxFp8(), residual_tokens=8))


def test_config_json_round_trip_and_errors(tmp_path):
    path = tmp_path / "c.json"
    save_config(_config(), path)
    assert load_config(path) == _config()
    data = _config().to_dict()
    data["default"]["key"]["bits"] = 8
    with pytest.raises(ConfigError, match="Unknown mxfp8 spec keys"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="must be a multiple of 32; got 16"):
        layout_of(MxFp8()).check(8, 16, "layer 0")


def test_a_cache_of_it_generates_and_holds_the_predicted_bytes():
    """Prefill 20 tokens, decode 12: the logits stay near the exact model's (8-bit floats) but
    differ (history is read back quantized), and the bytes held are the layout's prediction."""
    check_generating_cache(_config(), 0.05, 32, 1)


def test_a_config_naming_it_is_read_without_the_lab():
    """MXFP8 is an engine format (SGLang's ``mxfp8``) and a stable layout now: a fresh process
    that has not imported kvlens.research reads a config naming it."""
    import subprocess
    import sys

    code = ("from kvlens.config import config_from_dict\n"
            f"doc = {_config().to_dict()!r}\n"
            "print(config_from_dict(doc).default.key.kind)\n"
            "import sys\n"
            "print('kvlens.research' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["mxfp8", "False"]


@pytest.mark.parametrize("shape", [(1, 1, 1, 32), (2, 3, 5, 64), (1, 2, 7, 96), (1, 4, 3, 128),
                                   (2, 1, 9, 256)])
def test_bytes_equal_torchao(shape):
    """torchao's ``to_mx`` (E4M3 elements, block 32, the specification's floor scale): the same
    element and scale bytes, zero, saturating and subnormal blocks included."""
    x = outlier_tensor(shape)
    x[..., :32] = 0
    x.view(-1)[-1] = 3e4
    x.view(-1)[-2] = 1e-6
    want_scales, want_codes = to_mx(x.contiguous(), torch.float8_e4m3fn, 32)
    codes, scales = quantize_mxfp8(x)
    assert torch.equal(codes, want_codes.view(torch.uint8).reshape(codes.shape))
    assert torch.equal(scales, want_scales.view(torch.uint8).reshape(scales.shape))
