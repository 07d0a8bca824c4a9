"""The block-float engine settings (``kvlens.config.blockfloat``, parsed by
``kvlens.config.engine``): vLLM / SGLang / TensorRT-LLM ``nvfp4``, SGLang's ``fp4_e2m1`` and
``mxfp8``, TensorRT-LLM ``fp8``: names round-trip, bad ones are refused saying why, and each
builds the config that simulates it (NVFP4's global scales calibrated from a capture)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_capture

from kvlens.config import BlockFloatSetting, CacheDtypeSetting, parse_engine_setting
from kvlens.config.engine import allowed_settings, measured_cache_type
from kvlens.deploy.presets import engine_config
from kvlens.errors import ConfigError
from kvlens.layouts.blockfloat import Fp4E2M1, MxFp8, NvFp4

NAMES = ["vllm:nvfp4", "vllm:nvfp4:s0.5:skip=0,3", "sglang:nvfp4", "sglang:nvfp4:s2",
         "sglang:fp4_mx_block16", "sglang:mxfp8", "trtllm:nvfp4", "trtllm:nvfp4:s0.001",
         "trtllm:fp8", "trtllm:fp8:s1", "trtllm:fp8:p99.9"]


@pytest.mark.parametrize("name", NAMES)
def test_names_round_trip(name):
    s = parse_engine_setting(name)
    assert s.name == name and parse_engine_setting(s.name) == s


def test_sglang_older_fp4_spelling_reads_as_the_current_one():
    s = parse_engine_setting("SGLang:FP4_E2M1")
    assert s == BlockFloatSetting("sglang", "fp4_mx_block16") and s.name == "sglang:fp4_mx_block16"


@pytest.mark.parametrize(("name", "why"), [
    ("sglang:mxfp8:s2", "nvfp4 only"),
    ("trtllm:nvfp4:skip=1", "unknown or repeated option 'skip=1'"),
    ("vllm:nvfp4@head", "no @scope or :pP"),
    ("vllm:nvfp4:p99", "no @scope or :pP"),
    ("vllm:mxfp8", "vllm KV-cache dtypes here are"),
    ("trtllm:fp8@head", "drop @head"),
    ("trtllm:fp4_e2m1", "trtllm KV-cache dtypes here are fp8"),
    ("vllm:nvfp4:s0", "a finite number > 0"),
])
def test_bad_names_say_why(name, why):
    with pytest.raises(ConfigError, match="Unknown engine setting") as err:
        parse_engine_setting(name)
    assert why in str(err.value)
    assert "trtllm:nvfp4[:sS]" in str(err.value)  # the allowed forms


def test_the_grammar_lists_the_new_forms():
    text = allowed_settings()
    for form in ("vllm:nvfp4[:sS][:skip=L,L]", "fp4_mx_block16", "mxfp8", "trtllm:fp8[:pP|:sS]",
                 "trtllm:nvfp4[:sS]"):
        assert form in text


def test_each_builds_the_layout_it_simulates():
    cfg = parse_engine_setting("vllm:nvfp4:s0.5:skip=1").kvconfig("x")
    assert (cfg.default.key, cfg.default.value) == (NvFp4(0.5), NvFp4(0.5))
    assert cfg.default.residual_tokens == 0 and cfg.layer(1).key_format == "f16"
    assert cfg.description == "vllm --kv-cache-dtype nvfp4"
    assert parse_engine_setting("sglang:fp4_e2m1").kvconfig("x").default.key == Fp4E2M1()
    assert parse_engine_setting("sglang:mxfp8").kvconfig("x").default.value == MxFp8()
    trt = parse_engine_setting("trtllm:nvfp4").kvconfig("x")
    assert trt.default.key == NvFp4(1.0) and "KvCacheConfig(dtype=\"nvfp4\")" in trt.description
    fp8 = parse_engine_setting("trtllm:fp8")
    assert isinstance(fp8, CacheDtypeSetting) and fp8.cache_type(False) == "fp8_e4m3:s1"
    with pytest.raises(ConfigError, match="generate --compare sglang:mxfp8"):
        measured_cache_type(parse_engine_setting("sglang:mxfp8"))


def test_nvfp4_global_scales_calibrate_per_layer_from_a_capture(tmp_path):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    path = tmp_path / "run.h5"
    make_capture(path, q, k, v, layers=2, per_layer={1: {"k": 10 * k, "v": 0 * v}})
    s = engine_config("vllm:nvfp4:skip=0", calibration=str(path))
    assert "calibrated" in s.notes[0]
    cfg = s.config
    assert cfg.layer(0).key_format == "f16"  # skipped: kept at f16 whatever the capture
    layer = cfg.layer(1)
    assert layer.key == NvFp4(float(10 * k.abs().max()) / 448)  # ModelOpt's k_scale
    assert layer.value == NvFp4(1.0)  # an all-zero capture leaves the engines' 1.0
    fixed = engine_config("vllm:nvfp4:s0.25", calibration=str(path)).config
    assert fixed.layers == {} and fixed.default.key == NvFp4(0.25)
    default = engine_config("trtllm:nvfp4")
    assert default.config.default.key == NvFp4(1.0) and "1.0" in default.notes[0]
