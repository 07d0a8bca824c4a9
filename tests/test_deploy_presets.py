"""Engine settings as configs (``kvlens.deploy.presets``) and ``generate --compare`` with them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_capture
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.deploy import engine_config, is_engine_setting
from kvlens.errors import ConfigError
from kvlens.quant import QuantSpec

runner = CliRunner()


def _types(name, **kw):
    s = engine_config(name, **kw)
    return s.config.default.key_format, s.config.default.value_format, s


def test_llamacpp_settings_map_to_one_k_and_one_v_type():
    k, v, s = _types("llamacpp:q8_0/q4_0")
    assert (k, v, s.engine) == ("q8_0", "q4_0", "llamacpp")
    assert not s.config.layers
    assert any("flash attention" in n for n in s.notes)
    assert any("rotates" in n for n in s.notes)
    assert _types("llamacpp:q4_0")[:2] == ("q4_0", "q4_0")
    assert _types("llama.cpp:q5_1/f16:norot")[:2] == ("q5_1+norot", "f16")
    k, v, s = _types("llamacpp:f16/q4_0:nofa")
    assert (k, v) == ("f16", "q4_0")
    assert any("refuses" in n and "simulated anyway" in n for n in s.notes)
    _, _, s = _types("llamacpp:q8_0/f16")
    assert not any("flash attention" in n for n in s.notes)


def test_vllm_and_sglang_static_fp8_default_to_scale_one():
    k, v, s = _types("vllm:fp8")
    assert k == v == "fp8_e4m3:s1"
    assert any("1.0" in n for n in s.notes)
    assert _types("sglang:fp8_e5m2")[:2] == ("fp8_e5m2:s1", "fp8_e5m2:s1")
    s = engine_config("vllm:fp8_e4m3:skip=0,2")
    assert sorted(s.config.layers) == [0, 2]
    assert s.config.layer(2).key_format == "f16" and s.config.layer(1).key_format == \
        "fp8_e4m3:s1"
    assert _types("vllm:int8-pth")[:2] == ("int8@token-head", "int8@token-head")
    assert "non-uniform" in " ".join(engine_config("vllm:int4-pth").notes)


def test_sglang_per_head_scales_are_simulated_with_a_note(tmp_path):
    q, k, v = (torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64))
    path = make_capture(tmp_path / "run.h5", q, k, v, layers=1)
    s = engine_config("sglang:fp8_e4m3@head", calibration=str(path))
    assert s.config.default.key_format == "fp8_e4m3@head"
    assert len(s.config.kv_scales[0]["key"]) == 2
    assert any("SGLang cannot run them" in n for n in s.notes)


def test_static_scales_calibrated_from_a_capture(tmp_path):
    """Planted absmax per head (3 and 5 for keys, 7 and 0.5 for values): per-tensor and per-head
    scales are absmax / 448 exactly."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 64, generator=g)
    k = torch.rand(2, 2, 16, 64, generator=g)
    v = torch.rand(2, 2, 16, 64, generator=g) * 0.1
    k[0, 0, 3, 5], k[1, 1, 7, 9] = -3.0, 5.0
    v[1, 0, 2, 2], v[0, 1, 0, 0] = 7.0, 0.5
    path = make_capture(tmp_path / "run.h5", q, k, v, layers=2)
    s = engine_config("vllm:fp8_e4m3@head", calibration=str(path))
    assert s.config.default.key_format == "fp8_e4m3@head"
    for layer in (0, 1):
        got = s.config.kv_scales[layer]
        assert got["key"] == pytest.approx((3 / 448, 5 / 448))
        assert got["value"] == pytest.approx((7 / 448, 0.5 / 448))
    s = engine_config("sglang:fp8_e4m3", calibration=str(path))
    assert s.config.kv_scales[0]["key"] == pytest.approx((5 / 448,))
    assert s.config.kv_scales[0]["value"] == pytest.approx((7 / 448,))
    assert any("calibrated" in n for n in s.notes)


def test_transformers_quanto_maps_to_kvlens_layouts():
    s = engine_config("transformers:quanto-4")
    d = s.config.default
    assert d.key == d.value == QuantSpec(4, "per-token", 64)
    assert d.residual_tokens == 128 and d.flush_tokens == 0
    s = engine_config("transformers:quanto-2:axis_key=-1:group=32:residual=64")
    d = s.config.default
    assert d.key == QuantSpec(2, "per-channel", 32) and d.value == QuantSpec(2, "per-token", 32)
    assert d.residual_tokens == 64
    assert "re-quantizes" in s.notes[0]


@pytest.mark.parametrize("name,message", [
    ("tgi:fp8", "unknown engine 'tgi'; engines: llamacpp, vllm, sglang, transformers"),
    ("llamacpp:q3_0", "f32, f16, bf16, q8_0, q4_0"),
    ("llamacpp:q4_0/q4_0/q4_0", "as K/V"),
    ("llamacpp:q4_0:fast", ":norot and :nofa"),
    ("vllm:int2", "fp8, fp8_e4m3, fp8_e5m2, int8-pth"),
    ("vllm:fp8@token", "@head"),
    ("sglang:fp4_e2m1", "fp8_e4m3, fp8_e5m2"),
    ("transformers:quanto-3", "quanto-2 and quanto-4"),
    ("transformers:quanto-4:axis_key=1", "0 or -1"),
    ("transformers:quanto-4:nbits=4", "allowed: axis_key"),
    ("vllm:fp8_e4m3@head", "--calibration run.h5"),
])
def test_bad_settings_name_the_allowed_values(name, message):
    assert is_engine_setting(name)
    with pytest.raises(ConfigError) as exc:
        engine_config(name)
    assert message in str(exc.value)


def test_generate_compare_runs_engine_settings(patched_model):
    """SmolLM2, 128 tokens: q4_0 holds exactly 4.5 bits, fp8 8 bits plus its scales; every
    prediction of an engine setting reads quantized K/V (write-before-attention)."""
    result = runner.invoke(app, ["generate", "--compare", "llamacpp:q4_0,vllm:fp8_e4m3",
                                 "--eval", "kld", "--eval-tokens", "128", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    q4, fp8 = doc["results"]
    assert q4["name"] == "llamacpp:q4_0" and q4["bits_per_element"] == pytest.approx(4.5)
    assert fp8["bits_per_element"] == pytest.approx(8 + 32 / (128 * 3 * 64))  # + 2 scales
    for r in (q4, fp8):
        assert r["kld"]["quantized_share"] == 1.0
        assert r["kld"]["mean_kld"]["value"] > 0
    assert q4["kld"]["mean_kld"]["value"] > fp8["kld"]["mean_kld"]["value"]


def test_generate_refuses_unknown_engine_type():
    result = runner.invoke(app, ["generate", "--compare", "llamacpp:q2_k", "--prompt", "x"])
    assert result.exit_code == 1
    assert "q8_0" in result.output and "Unknown engine setting" in result.output
