"""Engine KV-cache formats (kvlens.quant.ggml, .fp8, .formats): ggml blocks byte for byte
against the gguf package's numpy quantizers, fp8 static scales, per-token-head formats,
rotation and names."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf import quants as gq
from helpers import rand

from kvlens.errors import ConfigError, InputError
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.quant.formats import (
    FormatSetting,
    engine_rotation,
    fake_quantize_format,
    parse_format,
    parse_format_list,
)
from kvlens.quant.fp8 import FP8Format, TokenHeadFormat, calibrate_scale, fp8_round_trip
from kvlens.quant.ggml import (
    GGML_FORMATS,
    IQ4_NL_VALUES,
    GGMLBlocks,
    dequantize_ggml,
    quantize_ggml,
)

NUMPY_QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def _hard(shape, seed):
    """Random data with the cases that break a near-miss port: outliers, all-zero blocks,
    exact rounding ties, constant blocks, a large offset, negative and positive extremes of
    equal magnitude (argmax tie), and fp16-overflowing scales avoided."""
    x = rand(*shape, seed=seed) * 2
    b, h, t, d = shape
    x[0, 0, 0, 3] = 300.0  # outlier
    x[-1, -1, t // 2, :32] = 0.0  # all-zero block
    x[0, -1, 1, :32] = 1.5  # constant block
    x[-1, 0, 2, :32] = torch.arange(32) - 15.5  # half-integers: ties for trunc(v + 0.5)
    x[0, 0, 3, :32] = (torch.arange(32) % 16) + 0.5  # q4_1: d = 1 exactly
    x[0, 0, 4, :32] = torch.linspace(-127, 127, 32).round() + 0.5  # q8_0 ties near +-127
    x[0, 0, 5, 0], x[0, 0, 5, 7] = -9.0, 9.0  # equal |max| of both signs: first one wins
    x[-1, 0, t - 1] += 500.0  # large offset
    return x


def _gguf_bytes(x, name):
    return gq.quantize(x.reshape(-1, x.shape[-1]).numpy(), getattr(GQ, name.upper()))


SHAPES = [(1, 1, 7, 32), (2, 3, 33, 64), (1, 2, 9, 128)]


@pytest.mark.parametrize("name", NUMPY_QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES)
def test_ggml_bytes_match_gguf_quantize(name, shape):
    for seed in range(3):
        x = _hard(shape, seed)
        mine = quantize_ggml(x, GGML_FORMATS[name]).to_bytes().numpy()
        mine = mine.reshape(-1, shape[-1] // 32 * GGML_FORMATS[name].block_bytes)
        ref = _gguf_bytes(x, name)
        assert mine.dtype == ref.dtype == np.uint8
        assert mine.shape == ref.shape
        bad = np.argwhere(mine != ref)
        assert bad.size == 0, f"{name} seed {seed}: first differing byte at {bad[:3].tolist()}"


@pytest.mark.parametrize("name", [*NUMPY_QUANTIZED, "iq4_nl"])
def test_dequantize_matches_gguf_and_bytes_round_trip(name):
    fmt = GGML_FORMATS[name]
    x = _hard((2, 2, 9, 64), 5)
    blocks = quantize_ggml(x, fmt)
    raw = blocks.to_bytes()
    ref = gq.dequantize(raw.reshape(-1, raw.shape[-1]).numpy(), getattr(GQ, name.upper()))
    mine = dequantize_ggml(blocks).reshape(-1, 64).numpy()
    assert np.array_equal(ref, mine)  # bit-exact, float32
    back = GGMLBlocks.from_bytes(raw, fmt, 64)
    assert torch.equal(back.codes, blocks.codes)
    assert torch.equal(back.d.view(torch.int16), blocks.d.view(torch.int16))


def test_q8_0_tie_rounds_away_from_zero_not_to_even():
    # absmax 127 -> d = 1, id = 1: x = 2.5 must give 3 (roundf), torch.round would give 2
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0], x[..., 1], x[..., 2] = 127.0, 2.5, -2.5
    q = quantize_ggml(x, GGML_FORMATS["q8_0"]).codes.view(torch.int8)[0, 0, 0, 0]
    assert q[:3].tolist() == [127, 3, -3]


def test_gguf_has_no_numpy_iq4_nl_quantizer():
    # if gguf gains one, the test below should compare bytes instead
    with pytest.raises(NotImplementedError):
        gq.quantize(np.zeros((1, 32), np.float32), GQ.IQ4_NL)


def _weighted_sse(x, q_values, d):
    w = x * x
    return float((w * (x - d[..., None] * q_values) ** 2).sum())


def test_iq4_nl_at_least_as_good_as_nearest_entry_reference():
    """Documented reference: nearest table entry at d0 = signed_absmax / -127, no refit (the
    first half of llama.cpp's quantize_f32_iq4_nl_block). The refit minimises the x^2-weighted
    error for the chosen codes, so after fp16 rounding of d it must not be worse overall."""
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    for seed in range(3):
        x = _hard((2, 2, 17, 64), seed).reshape(2, 2, 17, 2, 32)
        blocks = quantize_ggml(x.reshape(2, 2, 17, 64), GGML_FORMATS["iq4_nl"])
        mine = _weighted_sse(x, values[blocks.codes.long()], blocks.d.float())
        amax_idx = x.abs().argmax(-1, keepdim=True)
        d0 = (torch.gather(x, -1, amax_idx) / -127)[..., 0]
        inv = torch.where(d0 == 0, torch.zeros_like(d0), 1 / torch.where(d0 == 0, 1, d0))
        al = x * inv[..., None]
        idx = (al[..., None] - values).abs().argmin(-1)
        ref = _weighted_sse(x, values[idx], d0.half().float())
        assert mine <= ref * (1 + 1e-4), (seed, mine, ref)
    # and it is a real 4-bit quantizer: relative error on Gaussian data well under q4_0's 2x
    g = rand(1, 4, 64, 64, seed=9)
    err_nl = (dequantize_ggml(quantize_ggml(g, GGML_FORMATS["iq4_nl"])) - g).norm() / g.norm()
    err_q4 = (dequantize_ggml(quantize_ggml(g, GGML_FORMATS["q4_0"])) - g).norm() / g.norm()
    assert err_nl < err_q4


def test_ggml_storage_bits():
    bits = {n: f.bits_per_element() for n, f in GGML_FORMATS.items()}
    assert bits == {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}
    for name, fmt in GGML_FORMATS.items():
        x = rand(1, 1, 3, 64)
        raw = quantize_ggml(x, fmt).to_bytes()
        assert raw.numel() * 8 / x.numel() == bits[name]


def test_ggml_refuses_head_dim_not_multiple_of_32():
    with pytest.raises(ConfigError, match="multiples of 32"):
        quantize_ggml(rand(1, 1, 4, 48), GGML_FORMATS["q4_0"])
    with pytest.raises(InputError, match=r"\[B, H, T, D\]"):
        quantize_ggml(rand(4, 64), GGML_FORMATS["q4_0"])


def test_q4_1_min_wins_over_q4_0_on_offset_data():
    # values in [100, 101]: q4_0's zero-centred grid spends its 16 levels on [-101, 101]
    x = 100 + torch.rand(1, 2, 16, 64, generator=torch.Generator().manual_seed(1))
    e0 = (dequantize_ggml(quantize_ggml(x, GGML_FORMATS["q4_0"])) - x).norm()
    e1 = (dequantize_ggml(quantize_ggml(x, GGML_FORMATS["q4_1"])) - x).norm()
    assert e1 < e0 / 5


# -- fp8 and per-token-head -------------------------------------------------------------------


def test_fp8_round_trip_saturates_and_rounds():
    s = torch.tensor(1.0)
    x = torch.tensor([0.0, 1.0, 448.0, 1000.0, -1000.0, 17.0])
    y = fp8_round_trip(x, s, "e4m3")
    assert y.tolist() == [0.0, 1.0, 448.0, 448.0, -448.0, 16.0]  # 17 -> 16 (3 mantissa bits)
    assert fp8_round_trip(x, s, "e5m2")[3].item() == 1024.0
    assert torch.equal(fp8_round_trip(x, torch.tensor(0.0), "e4m3"), torch.zeros(6))


def test_calibrate_scale_absmax_percentile_and_scope():
    x = rand(2, 3, 50, 16)
    x[:, 1] *= 10  # one loud head
    x[0, 2, 0, 0] = 1e4  # one extreme element
    per_tensor = calibrate_scale(x, FP8Format("e4m3", "tensor"))
    per_head = calibrate_scale(x, FP8Format("e4m3", "head"))
    assert per_tensor.shape == (1, 1, 1, 1) and per_head.shape == (1, 3, 1, 1)
    assert per_tensor.item() == pytest.approx(1e4 / 448)
    assert per_head[0, :, 0, 0].tolist() == pytest.approx(
        [float(x[:, h].abs().max()) / 448 for h in range(3)]
    )
    pct = calibrate_scale(x, FP8Format("e4m3", "head", 99.0))
    assert (pct < per_head).all()  # the extreme element no longer sets head 2's scale
    # absmax calibration never clips; the percentile scale clips the top 1%
    xh = x[:, 2:3]
    clipped = fake_quantize_format(xh, parse_format("fp8_e4m3@head:p99"), "key")
    assert clipped.abs().max() < 1e4 / 2


def test_fixed_scale_is_used_as_given():
    x = torch.tensor([0.001, 0.5, 3.0, 1000.0]).reshape(1, 1, 1, 4)
    y = fake_quantize_format(x, parse_format("fp8_e4m3:s1"), "key")
    # scale 1.0: 0.001 lands on e4m3's subnormal grid (step 2^-9), 1000 saturates at 448
    assert y.flatten().tolist() == [2**-9, 0.5, 3.0, 448.0]
    scale = calibrate_scale(rand(1, 3, 4, 8), FP8Format("e4m3", "head", None, 2.0))
    assert scale.flatten().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ConfigError, match="not both"):
        FP8Format("e4m3", "tensor", 99.0, 1.0)


def test_per_head_scale_beats_per_tensor_with_a_quiet_head():
    x = rand(1, 2, 64, 64)
    x[:, 0] *= 1e-3  # head 0 near e4m3's subnormal range under a shared scale
    x[:, 1] *= 1e3
    tensor = fake_quantize_format(x, parse_format("fp8_e4m3"), "key")
    head = fake_quantize_format(x, parse_format("fp8_e4m3@head"), "key")
    err = lambda y: float((y[:, 0] - x[:, 0]).norm() / x[:, 0].norm())  # noqa: E731
    assert err(head) < err(tensor) / 10


def test_e4m3_finer_than_e5m2_on_well_scaled_data():
    x = rand(1, 2, 64, 64)
    e4 = (fake_quantize_format(x, parse_format("fp8_e4m3"), "key") - x).norm()
    e5 = (fake_quantize_format(x, parse_format("fp8_e5m2"), "key") - x).norm()
    assert e4 < e5


def test_token_head_int_is_reference_symmetric_per_token():
    x = rand(2, 2, 9, 64)
    for kind, bits in (("int8", 8), ("int4", 4)):
        got = fake_quantize_format(x, parse_format(f"{kind}@token-head"), "value")
        ref = fake_quantize(x, QuantSpec(bits, "per-token", None, symmetric=True))
        assert torch.equal(got, ref)
    fp8 = fake_quantize_format(x, parse_format("fp8@token-head"), "value")
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(fp8, (x / scale).to(torch.float8_e4m3fn).float() * scale)


def test_storage_bits_fp8_and_token_head():
    shape = (1, 3, 512, 64)
    assert parse_format("int8@token-head").bits_per_element(shape) == 8.5
    assert parse_format("int4@token-head").bits_per_element(shape) == 4.5
    assert parse_format("fp8@token-head").bits_per_element(shape) == 8.5
    assert parse_format("fp8_e4m3").bits_per_element(shape) == 8 + 32 / (3 * 512 * 64)
    assert parse_format("fp8_e5m2@head").bits_per_element(shape) == 8 + 32 / (512 * 64)


# -- rotation ---------------------------------------------------------------------------------


def test_rotation_rule_follows_llama_cpp():
    q4 = parse_format("q4_0")
    assert q4.rotates(64) and q4.rotates(128) and not q4.rotates(96) and not q4.rotates(80)
    assert not parse_format("q4_0+norot").rotates(64)
    assert parse_format("q4_0+rot").rotates(96)
    assert not parse_format("fp8_e4m3").rotates(128)
    assert parse_format("fp8_e4m3+rot").rotates(128)


def test_engine_rotation_blocks():
    for d in (64, 128, 256):
        r = engine_rotation("key", d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
        assert torch.allclose(r, r.T)
        assert (r != 0).all()  # keys: one Sylvester block over all of head_dim
        v = engine_rotation("value", d)
        assert torch.allclose(v @ v.T, torch.eye(d), atol=1e-6)
        assert int((v != 0).sum()) == d * 64  # values: 64x64 blocks
    assert int((engine_rotation("key", 192) != 0).sum()) == 192 * 64  # 3 blocks of 64


def test_rotation_helps_q4_0_on_an_outlier_channel():
    x = rand(1, 2, 128, 64)
    x[..., 5] *= 40  # one outlier channel, as post-RoPE keys have
    plain = fake_quantize_format(x, parse_format("q4_0+norot"), "key")
    rot = fake_quantize_format(x, parse_format("q4_0"), "key")
    assert (rot - x).norm() < 0.7 * (plain - x).norm()
    # orthonormal: a format that is exact stays exact under rotation (up to float32)
    z = torch.zeros(1, 1, 3, 64)
    assert torch.equal(fake_quantize_format(z, parse_format("q8_0"), "value"), z)


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, name, family",
    [
        ("q8_0", "q8_0", "ggml"),
        ("Q4_1+norot", "q4_1+norot", "ggml"),
        ("iq4_nl+rot", "iq4_nl+rot", "ggml"),
        ("fp8", "fp8_e4m3", "fp8"),
        ("fp8_e4m3@tensor", "fp8_e4m3", "fp8"),
        ("fp8_e5m2@head", "fp8_e5m2@head", "fp8"),
        ("fp8_e4m3@head:p99.9", "fp8_e4m3@head:p99.9", "fp8"),
        ("fp8_e4m3:s1", "fp8_e4m3:s1", "fp8"),
        ("fp8_e5m2@head:s0.5", "fp8_e5m2@head:s0.5", "fp8"),
        ("int8@token-head", "int8@token-head", "token-head"),
        ("int4", "int4@token-head", "token-head"),
        ("fp8@token-head", "fp8@token-head", "token-head"),
        ("int8_per_token_head", "int8@token-head", "token-head"),
        ("fp8_per_token_head+rot", "fp8@token-head+rot", "token-head"),
    ],
)
def test_parse_format_names(text, name, family):
    s = parse_format(text)
    assert isinstance(s, FormatSetting)
    assert s.name == name and s.format.family == family
    assert parse_format(s.name) == s  # names round-trip
    assert FormatSetting.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "text",
    [
        "q3_k",
        "fp16x",
        "q4_0@head",
        "int8@tensor",
        "fp8_e5m2@token-head",
        "fp8@row",
        "q8_0+spin",
        "q8_0:s1",
        "int8:p99",
        "fp8@token-head:s1",
        "",
    ],
)
def test_unknown_format_lists_allowed(text):
    with pytest.raises(ConfigError, match=r"allowed: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, fp8"):
        parse_format(text)


def test_parse_format_list_dedupes():
    got = parse_format_list("q8_0, q4_0,q8_0 ,fp8")
    assert [s.name for s in got] == ["q8_0", "q4_0", "fp8_e4m3"]
    assert parse_format_list("none") == () == parse_format_list("")


def test_format_objects_validate():
    with pytest.raises(ConfigError, match="allowed: 0 < p < 100"):
        parse_format("fp8:p200")
    with pytest.raises(ConfigError, match="allowed: e4m3, e5m2"):
        FP8Format("e3m4")
    with pytest.raises(ConfigError, match="allowed: int8, int4, fp8"):
        TokenHeadFormat("int2")
    with pytest.raises(ConfigError, match="allowed: version, name"):
        FormatSetting.from_dict({"name": "q8_0", "rotation": "on"})
    with pytest.raises(ConfigError, match="allowed: auto, on, off"):
        FormatSetting(GGML_FORMATS["q8_0"], "maybe")
