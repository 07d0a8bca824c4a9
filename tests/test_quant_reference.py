"""Known-answer tests for kvlens.quant.spec and kvlens.quant.reference."""

import json

import pytest
import torch
from helpers import rand, rel

from kvlens.errors import ConfigError, InputError
from kvlens.quant import QuantSpec, dequantize, expand_params, fake_quantize, quantize
from kvlens.quant.reference import FLOAT32_TINY

SPECS = [
    QuantSpec(2, "per-token", 16),
    QuantSpec(2, "per-token"),
    QuantSpec(2, "per-channel", 8),
    QuantSpec(3, "per-channel"),
    QuantSpec(4, "per-tensor"),
    QuantSpec(4, "per-token", 32, symmetric=True),
    QuantSpec(2, "per-channel", 8, symmetric=True),
    QuantSpec(2, "per-token", 16, fit="mse"),
    QuantSpec(3, "per-channel", 8, fit="mse"),
]


# -- spec validation ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 9, -1, True, 2.0, "2"])
def test_bad_bits_list_allowed_values(bits):
    with pytest.raises(ConfigError, match="allowed: integers 1-8"):
        QuantSpec(bits, "per-token")


def test_bad_granularity_lists_names():
    with pytest.raises(ConfigError, match="per-token, per-channel, per-tensor"):
        QuantSpec(2, "per-row")


@pytest.mark.parametrize("g", [0, -32, True, 1.5])
def test_bad_group_size(g):
    with pytest.raises(ConfigError, match="positive integer"):
        QuantSpec(2, "per-channel", g)


def test_per_tensor_rejects_group_size_and_symmetric_needs_two_bits():
    with pytest.raises(ConfigError, match="per-tensor"):
        QuantSpec(2, "per-tensor", 32)
    with pytest.raises(ConfigError, match="bits >= 2"):
        QuantSpec(1, "per-token", symmetric=True)


def test_check_fits_lists_divisors():
    spec = QuantSpec(2, "per-token", 48)
    with pytest.raises(
        ConfigError,
        match="group size 48 does not divide head_dim 64; allowed "
        "group sizes: 1, 2, 4, 8, 16, 32, 64",
    ):
        spec.check_fits((2, 4, 10, 64))
    with pytest.raises(ConfigError):
        quantize(torch.zeros(1, 1, 4, 64), spec)
    # Per-channel groups run along tokens: T need not be a multiple of G.
    QuantSpec(2, "per-channel", 48).check_fits((1, 1, 100, 64))


def test_json_round_trip_and_rejections():
    for spec in SPECS:
        assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ConfigError, match="Unknown quantization spec keys"):
        QuantSpec.from_dict({"bits": 2, "granularity": "per-token", "axis": 2})
    with pytest.raises(ConfigError, match="version"):
        QuantSpec.from_dict({"version": 99, "bits": 2, "granularity": "per-token"})
    with pytest.raises(ConfigError, match="missing"):
        QuantSpec.from_dict({"bits": 2})


def test_fit_is_validated_and_versioned():
    with pytest.raises(ConfigError, match="Unknown fit 'l1'; allowed: minmax, mse"):
        QuantSpec(2, "per-token", fit="l1")
    with pytest.raises(ConfigError, match="asymmetric"):
        QuantSpec(2, "per-token", symmetric=True, fit="mse")
    # min/max specs stay version 1 (older readers); a fit needs version 2
    assert QuantSpec(2, "per-token").to_dict()["version"] == 1
    d = QuantSpec(2, "per-token", fit="mse").to_dict()
    assert d["version"] == 2 and d["fit"] == "mse"
    with pytest.raises(ConfigError, match="'fit' needs spec version 2"):
        QuantSpec.from_dict({**d, "version": 1})


def test_non_4d_input_is_rejected():
    with pytest.raises(InputError, match=r"\[B, H, T, D\]"):
        quantize(torch.zeros(3, 8), QuantSpec(2, "per-token"))


# -- known answers --------------------------------------------------------------------------


def test_two_bit_codes_hand_computed():
    # Three tokens, one group of 4 channels each. Rows 1-2: min 0, max 3 -> scale 1, zero 0;
    # row 2 has exact ties, which round half to even (0.5 -> 0, 1.5 -> 2); row 3: min -2,
    # max 4 -> scale 2, zero -2.
    x = torch.tensor(
        [
            [0.0, 0.4, 0.6, 3.0],
            [0.0, 0.5, 1.5, 3.0],
            [-2.0, -1.0, 2.0, 4.0],
        ]
    )
    q = quantize(x.view(1, 1, 3, 4), QuantSpec(2, "per-token"))
    assert q.codes.view(3, 4).tolist() == [[0, 0, 1, 3], [0, 0, 2, 3], [0, 0, 2, 3]]
    assert q.scale.view(3).tolist() == [1.0, 1.0, 2.0]
    assert q.zero.view(3).tolist() == [0.0, 0.0, -2.0]
    assert dequantize(q).view(3, 4)[2].tolist() == [-2.0, -2.0, 2.0, 4.0]


def test_symmetric_hand_computed():
    # 3-bit symmetric: qmax 3, absmax 3 -> scale 1; codes stored offset by 3.
    x = torch.tensor([-3.0, -1.2, 0.0, 2.6]).view(1, 1, 1, 4)
    q = quantize(x, QuantSpec(3, "per-token", symmetric=True))
    assert q.codes.flatten().tolist() == [0, 2, 3, 6]
    assert q.zero.item() == -3.0
    assert dequantize(q).flatten().tolist() == [-3.0, -1.0, 0.0, 3.0]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_constant_tensor_has_zero_error(spec):
    for value in (0.0, 3.25, -1e-3):
        x = torch.full((2, 3, 10, 64), value)
        if spec.symmetric and value != 0.0:
            continue  # a constant is exact only on the asymmetric grid
        assert torch.equal(fake_quantize(x, spec), x)
    q = quantize(torch.zeros(1, 1, 4, 64), spec)
    assert bool((q.scale >= FLOAT32_TINY).all())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_error_within_half_step_and_codes_in_range(spec):
    x = rand(2, 3, 21, 64, seed=1) * 3
    q = quantize(x, spec)
    top = 2**spec.bits - 2 if spec.symmetric else 2**spec.bits - 1
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= top
    step = expand_params(q.scale, spec, q.shape)
    inside = torch.ones_like(x, dtype=torch.bool)
    if spec.fit == "mse":  # values the fit clipped off lie beyond the grid's ends
        lo = expand_params(q.zero, spec, q.shape)
        inside = (x >= lo) & (x <= lo + step * spec.levels)
        assert 0.5 < float(inside.float().mean()) < 1.0
    err = (dequantize(q) - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6)[inside].all())


def test_scale_shapes_per_granularity():
    x = rand(2, 3, 37, 64)
    assert quantize(x, QuantSpec(2, "per-token", 16)).scale.shape == (2, 3, 37, 4)
    assert quantize(x, QuantSpec(2, "per-token")).scale.shape == (2, 3, 37, 1)
    assert quantize(x, QuantSpec(2, "per-channel", 16)).zero.shape == (2, 3, 3, 64)
    assert quantize(x, QuantSpec(2, "per-channel")).zero.shape == (2, 3, 1, 64)
    assert quantize(x, QuantSpec(2, "per-tensor")).scale.shape == (2, 3, 1, 1)


def test_partial_last_token_group_uses_only_its_tokens():
    x = rand(1, 2, 10, 8, seed=2)
    q = quantize(x, QuantSpec(2, "per-channel", 4))
    last = x[:, :, 8:10]
    assert torch.allclose(q.zero[:, :, 2], last.amin(dim=2))
    assert torch.allclose(q.scale[:, :, 2], (last.amax(dim=2) - last.amin(dim=2)) / 3)
    first = x[:, :, 0:4]
    assert torch.allclose(q.scale[:, :, 0], (first.amax(dim=2) - first.amin(dim=2)) / 3)


def test_mse_fit_hand_computed_one_bit():
    # 1 bit, values 0, .1, .9, 1, 10. Min/max: scale 10, zero 0, only 10 gets code 1; squared
    # error .01 + .81 + 1 = 1.82. The least-squares refit of those codes is zero = mean(0, .1,
    # .9, 1) = .5, scale = 10 - .5 = 9.5; re-assigning (threshold 5.25) keeps the codes, so it
    # has converged: squared error .25 + .16 + .16 + .25 = .82.
    x = torch.tensor([0.0, 0.1, 0.9, 1.0, 10.0]).view(1, 1, 1, 5)
    q = quantize(x, QuantSpec(1, "per-token", fit="mse"))
    assert q.codes.flatten().tolist() == [0, 0, 0, 0, 1]
    assert q.zero.item() == pytest.approx(0.5) and q.scale.item() == pytest.approx(9.5)
    assert float(((dequantize(q) - x) ** 2).sum()) == pytest.approx(0.82, abs=1e-5)
    minmax = fake_quantize(x, QuantSpec(1, "per-token"))
    assert float(((minmax - x) ** 2).sum()) == pytest.approx(1.82, abs=1e-5)


@pytest.mark.parametrize("gran,g", [("per-token", 32), ("per-channel", 8), ("per-channel", 5)])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_mse_fit_never_worse_than_minmax_per_group(gran, g, bits):
    # heavy-tailed data (where clipping pays) and a grid-exact group (already error-free)
    x = rand(2, 2, 23, 64, seed=bits) ** 3
    parity = (torch.arange(23)[:, None] + torch.arange(64)[None, :]) % 2
    x[0, 0] = parity.float() * 2 - 1  # every group holds -1 and 1: exact on any grid
    q_mm, q_fit = quantize(x, QuantSpec(bits, gran, g)), quantize(x, QuantSpec(bits, gran, g,
                                                                                  fit="mse"))
    spec = q_fit.spec
    bt, bd = spec.block_shape(23, 64)
    err_mm = (dequantize(q_mm) - x) ** 2
    err_fit = (dequantize(q_fit) - x) ** 2
    if gran == "per-token":
        per_group = lambda e: e.reshape(2, 2, 23, 64 // bd, bd).sum(-1)  # noqa: E731
    else:
        per_group = lambda e: torch.stack([e[:, :, i:i + g].sum(2)  # noqa: E731
                                           for i in range(0, 23, g)], 2)
    assert bool((per_group(err_fit) <= per_group(err_mm) * (1 + 1e-5) + 1e-9).all())
    assert float(err_fit.mean()) < 0.9 * float(err_mm.mean())  # heavy tails: clearly better
    assert float(err_fit[0, 0].max()) < 1e-10  # the grid-exact group stays exact


def test_mse_fit_of_a_partial_token_group_ignores_the_padding():
    # the last per-channel group (2 tokens of 10 at G=4) fits as if quantized on its own
    x = rand(1, 2, 10, 8, seed=5) ** 3
    q = quantize(x, QuantSpec(2, "per-channel", 4, fit="mse"))
    alone = quantize(x[:, :, 8:10].contiguous(), QuantSpec(2, "per-channel", None, fit="mse"))
    torch.testing.assert_close(q.scale[:, :, 2:3], alone.scale)
    torch.testing.assert_close(q.zero[:, :, 2:3], alone.zero)


def test_per_tensor_is_one_scale_per_batch_and_head():
    x = rand(2, 3, 5, 8)
    q = quantize(x, QuantSpec(4, "per-tensor"))
    assert torch.allclose(q.zero.flatten(), x.flatten(2).amin(-1).flatten())


def test_planted_outlier_channel_favours_per_channel():
    x = rand(2, 2, 128, 64, seed=3)
    x[..., 5] = 40.0 + x[..., 5]  # a fixed huge channel on every token, as in keys
    per_token = rel(x, fake_quantize(x, QuantSpec(2, "per-token", 32)))
    per_channel = rel(x, fake_quantize(x, QuantSpec(2, "per-channel", 32)))
    assert per_channel < per_token / 3


def test_error_shrinks_with_bits_and_dtype_preserved():
    x = rand(1, 2, 16, 32, seed=4)
    errors = [rel(x, fake_quantize(x, QuantSpec(b, "per-token", 16))) for b in range(1, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 0.01
    xb = x.to(torch.bfloat16)
    assert fake_quantize(xb, QuantSpec(4, "per-token")).dtype == torch.bfloat16
    assert dequantize(quantize(xb, QuantSpec(4, "per-token"))).dtype == torch.float32
