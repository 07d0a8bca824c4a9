"""SGLang's ``fp4_e2m1`` layout (``kvlens.layouts.blockfloat.Fp4E2M1``): its bytes against a
float64 reference written from SGLang's definition (block exponent ``ceil(log2(amax / 6))``,
codes by midpoints reached, ties up), its store against its reference, and a cache of a small
model that generates with it and holds exactly its predicted bytes."""

from __future__ import annotations

import math

import pytest
import torch
from layout_checks import check_generating_cache, check_streaming_store, outlier_tensor

from kvlens.config import KVConfig, LayerKV, config_from_dict
from kvlens.errors import ConfigError
from kvlens.layouts import Layout, layout_of
from kvlens.layouts.blockfloat import Fp4E2M1
from kvlens.quant.fp4 import quantize_fp4_e2m1

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def reference(x: torch.Tensor) -> tuple[list[int], list[int]]:
    codes, scales = [], []
    for block in x.double().reshape(-1, 16).tolist():
        y = max(max(abs(v) for v in block) / 6.0, 1e-10)
        e = math.ceil(math.log2(y))
        scales.append(e + 127)
        for v in block:
            t = abs(v) / 2.0 ** e
            codes.append(sum(t >= m for m in MIDPOINTS) | (8 if v < 0 else 0))
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)], scales


@pytest.mark.parametrize("shape", [(1, 1, 2, 16), (2, 3, 5, 64), (1, 2, 7, 96), (1, 4, 3, 128),
                                   (2, 1, 9, 256)])
def test_bytes_equal_the_definition(shape):
    x = outlier_tensor(shape)
    x[..., :16] = 0  # an all-zero block: exponent -33 (SGLang's 1e-10 floor)
    x.view(-1)[-16:] = torch.tensor(MIDPOINTS + (6.0,) + MIDPOINTS + (-6.0,)) * 0.25  # ties
    codes, scales = quantize_fp4_e2m1(x)
    want_codes, want_scales = reference(x)
    assert scales.flatten().tolist() == want_scales
    assert codes.flatten().tolist() == want_codes
    assert 94 in want_scales  # -33 + 127


def test_store_config_and_a_generating_cache_hold_the_predicted_bytes():
    layout = layout_of(Fp4E2M1())
    assert isinstance(layout, Layout)
    x = outlier_tensor((2, 3, 12, 64))
    want = check_streaming_store(layout, x, 32 + 4)
    assert 0 < (want - x).norm() < 0.25 * x.norm()
    config = KVConfig("fp4", LayerKV(Fp4E2M1(), Fp4E2M1()))
    assert config_from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="Unknown fp4_e2m1 spec keys"):
        config_from_dict({**config.to_dict(), "default": {"key": {"layout": "fp4_e2m1", "g": 1}}})
    check_generating_cache(config, 0.3, 16, 2)
