"""Storage accounting on hand-computed configs, and agreement with what quantize stores."""

import pytest
import torch

from kvlens.errors import ConfigError
from kvlens.quant import QuantSpec, bits_per_element, packed_length, quantize


def test_kivi_two_bit_per_channel_g32_is_three_bits():
    b = bits_per_element(QuantSpec(2, "per-channel", 32), (4, 8, 128, 64))
    assert (b.codes, b.scales, b.zeros, b.outliers, b.lowrank, b.residual) == (
        2.0,
        0.5,
        0.5,
        0.0,
        0.0,
        0.0,
    )
    assert b.total == 3.0
    assert b.compression_vs(16) == pytest.approx(16 / 3)
    assert b.to_dict()["total"] == 3.0


def test_per_token_per_tensor_and_symmetric():
    assert bits_per_element(QuantSpec(4, "per-token", 64), (128, 64)).total == 4.5
    assert bits_per_element(QuantSpec(4, "per-token"), (128, 128)).total == 4.25
    assert bits_per_element(QuantSpec(2, "per-tensor"), (128, 64)).total == 2 + 32 / 8192
    sym = bits_per_element(QuantSpec(4, "per-token", 32, symmetric=True), (16, 64))
    assert sym.zeros == 0.0 and sym.total == 4.5


def test_partial_token_group_counted_whole():
    # T=100, G=32 -> 4 groups per channel (the last holds 4 tokens): 4 * 32 bits / 100 tokens.
    b = bits_per_element(QuantSpec(2, "per-channel", 32), (100, 64))
    assert b.scales + b.zeros == pytest.approx(1.28)
    assert b.total == pytest.approx(3.28)


def test_three_bit_codes_cost_three_bits_as_stored():
    spec = QuantSpec(3, "per-token", 64)
    assert bits_per_element(spec, (8, 64)).codes == 3
    assert packed_length(64, 3) * 8 / 64 == 3  # 8 codes in 3 bytes, no container padding


def test_outliers_lowrank_and_residual_window():
    spec = QuantSpec(2, "per-token", 32)
    # ceil(1% of 128) = 2 outliers per token, 16-bit value + 16-bit index each.
    assert bits_per_element(spec, (64, 128), outlier_fraction=0.01).outliers == 0.5
    # rank 4 factors [128, 4] and [4, 64] at 16 bits over 128 * 64 elements.
    assert bits_per_element(spec, (128, 64), lowrank_rank=4).lowrank == 1.5
    # KIVI window: 32 of 160 tokens at 16 bits, the other 128 at 3 bits.
    kivi = bits_per_element(QuantSpec(2, "per-channel", 32), (160, 64), residual_tokens=32)
    assert kivi.residual == pytest.approx(3.2)
    assert kivi.total == pytest.approx(128 / 160 * 3 + 3.2)
    all_window = bits_per_element(spec, (16, 64), residual_tokens=16)
    assert all_window.total == 16.0


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(2, "per-channel", 32),
        QuantSpec(3, "per-token", 16),
        QuantSpec(4, "per-tensor"),
        QuantSpec(2, "per-channel"),
    ],
)
def test_group_count_matches_stored_scales(spec):
    x = torch.randn(2, 3, 45, 32, generator=torch.Generator().manual_seed(0))
    q = quantize(x, spec)
    b = bits_per_element(spec, x.shape, scale_bits=32, zero_bits=32)
    stored = (q.scale.numel() + q.zero.numel()) * 32 / x.numel()
    assert b.scales + b.zeros == pytest.approx(stored)


def test_bad_accounting_input():
    spec = QuantSpec(2, "per-token", 48)
    with pytest.raises(ConfigError, match="allowed group sizes"):
        bits_per_element(spec, (16, 64))
    with pytest.raises(ConfigError, match="non-negative integer"):
        bits_per_element(QuantSpec(2, "per-token"), (16, 64), scale_bits=-1)
    with pytest.raises(ConfigError, match="allowed: 0-16"):
        bits_per_element(QuantSpec(2, "per-token"), (16, 64), residual_tokens=17)
    with pytest.raises(ConfigError, match="per-token, per-channel"):
        bits_per_element(
            QuantSpec(2, "per-token"), (16, 64), outlier_fraction=0.1, outlier_scope="per-row"
        )
