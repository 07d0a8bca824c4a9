"""Engine settings: the vocabulary (``kvlens.config.engine``), the settings as configs
(``kvlens.deploy.presets``) and ``generate --compare`` with them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_capture
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.config import config_from_dict, is_engine_setting
from kvlens.config.engine import (
    CACHE_DTYPES,
    LLAMACPP_FLOAT_TYPES,
    LLAMACPP_TYPES,
    PER_TOKEN_HEAD,
    QUANTO_AXES,
    QUANTO_BITS,
    SEARCH_TYPES,
    STATIC_FP8_DTYPES,
    TURBOQUANT_TYPES,
    CacheDtypeSetting,
    LlamaCppSetting,
    QuantoSetting,
    TurboQuantSetting,
    allowed_settings,
    measured_cache_type,
    parse_engine_setting,
    setting_for_cache_type,
    split_setting_list,
)
from kvlens.config.hqq import HQQ_AXES, HQQ_BITS, HqqSetting
from kvlens.deploy import engine_config
from kvlens.errors import ConfigError
from kvlens.quant import CodebookSpec, QuantSpec, RotationSpec

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
    # SGLang's scale file holds one scale per layer for K and V: the larger of the two
    s = engine_config("sglang:fp8_e4m3", calibration=str(path))
    assert s.config.kv_scales[0]["key"] == pytest.approx((7 / 448,))
    assert s.config.kv_scales[0]["value"] == pytest.approx((7 / 448,))
    assert any("calibrated" in n and "one for K and V" in n for n in s.notes)
    # a fixed scale ignores the capture
    s = engine_config("vllm:fp8_e4m3@head:s0.5", calibration=str(path))
    assert s.config.default.key_format == "fp8_e4m3@head:s0.5" and not s.config.kv_scales


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
    ("tgi:fp8", "unknown engine 'tgi'; engines: llamacpp, vllm, sglang, trtllm, transformers"),
    ("llamacpp:q3_0", "f32, f16, bf16, q8_0, q4_0"),
    ("llamacpp:q4_0/q4_0/q4_0", "as K/V"),
    ("llamacpp:q4_0:fast", ":norot, :nofa and :noarith"),
    ("llamacpp:q4_0:rot:norot", "contradict"),
    ("vllm:fp8_e4m3:p99:s1", "not both"),
    ("vllm:fp8_e4m3:s0", "positive"),
    ("vllm:int8-pth:s1", "dynamic"),
    ("sglang:fp8_e4m3:skip=1", "unknown or repeated option"),
    ("transformers:quanto-4:group=0", "positive integer"),
    ("vllm:int2", "fp8, fp8_e4m3, fp8_e5m2, int8-pth"),
    ("vllm:fp8@token", "@head"),
    ("sglang:int4", "fp8_e4m3, fp8_e5m2"),
    ("transformers:quanto-3", "quanto bits are 2, 4, got 3"),
    ("transformers:quanto-4:axis_key=1", "axis_key for quanto must be 0 or -1"),
    ("transformers:quanto-4:nbits=4", "allowed: axis_key"),
    ("vllm:fp8_e4m3@head", "--calibration run.h5"),
    ("vllm:turboquant_2bit", "turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, "
                             "turboquant_3bit_nc"),
    ("vllm:turboquant_4bit_nc:skip=1", "TurboQuant dtypes take no options"),
    ("sglang:turboquant_4bit_nc", "fp8_e4m3, fp8_e5m2"),
])
def test_bad_settings_name_the_allowed_values(name, message):
    assert is_engine_setting(name)
    with pytest.raises(ConfigError) as exc:
        engine_config(name)
    assert message in str(exc.value)


SETTINGS = st.one_of(
    st.builds(LlamaCppSetting, st.sampled_from(LLAMACPP_TYPES), st.sampled_from(LLAMACPP_TYPES),
              st.sampled_from(["auto", "off", "on"]), st.booleans()),
    st.builds(CacheDtypeSetting, st.just("vllm"), st.sampled_from(STATIC_FP8_DTYPES),
              st.sampled_from(["tensor", "head"]),
              st.none() | st.floats(0.001, 99.999),
              skip=st.lists(st.integers(0, 40), max_size=3).map(tuple)),
    st.builds(CacheDtypeSetting, st.sampled_from(["vllm", "sglang"]),
              st.sampled_from(CACHE_DTYPES["sglang"]), fixed_scale=st.floats(1e-6, 1e6)),
    st.builds(CacheDtypeSetting, st.just("vllm"), st.sampled_from(sorted(PER_TOKEN_HEAD))),
    st.builds(TurboQuantSetting, st.sampled_from(TURBOQUANT_TYPES)),
    st.builds(QuantoSetting, st.sampled_from(QUANTO_BITS), st.sampled_from(QUANTO_AXES),
              st.sampled_from(QUANTO_AXES), st.integers(1, 256), st.integers(0, 512)),
    st.builds(HqqSetting, st.sampled_from(HQQ_BITS), st.sampled_from(HQQ_AXES),
              st.sampled_from(HQQ_AXES), st.integers(1, 256), st.integers(0, 512)),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(SETTINGS)
def test_every_setting_name_reads_back_as_the_same_setting(setting):
    """``name`` is the canonical spelling: it parses back to the same setting, also upper-cased
    and inside a comma list with others."""
    assert parse_engine_setting(setting.name) == setting
    assert parse_engine_setting(setting.name.upper()) == setting
    assert split_setting_list(f"kivi-2,{setting.name}, llamacpp:q8_0") == [
        "kivi-2", setting.name, "llamacpp:q8_0"]
    assert is_engine_setting(setting.name)


def test_one_list_of_llamacpp_types():
    """llama.cpp's types are the float types plus every ggml block format; recommend searches a
    named subset of them; the float types are the unquantized cache types."""
    from kvlens.quant.cachetypes import DENSE_BYTES
    from kvlens.quant.ggml import GGML_FORMATS

    assert LLAMACPP_TYPES == (*LLAMACPP_FLOAT_TYPES, *GGML_FORMATS)
    assert set(LLAMACPP_FLOAT_TYPES) == set(DENSE_BYTES)
    assert set(SEARCH_TYPES["llama.cpp"]) <= set(LLAMACPP_TYPES)
    assert set(SEARCH_TYPES["llama.cpp"]) - set(LLAMACPP_FLOAT_TYPES) == set(GGML_FORMATS)
    for t in LLAMACPP_TYPES:  # every type is a setting generate runs
        assert _types(f"llamacpp:{t}")[0].split("+")[0] == t


def test_vllm_fixed_scales_and_the_cache_types_they_store():
    k, v, s = _types("vllm:fp8_e4m3:s1:skip=2,0")
    assert k == v == "fp8_e4m3:s1" and sorted(s.config.layers) == [0, 2]
    assert not any("1.0" in n for n in s.notes)  # fixed on purpose: no default-scale note
    assert _types("sglang:fp8_e5m2:s0.25")[:2] == ("fp8_e5m2:s0.25", "fp8_e5m2:s0.25")
    assert _types("llamacpp:q8_0:rot")[:2] == ("q8_0+rot", "q8_0+rot")
    assert setting_for_cache_type("fp8_e4m3:s1", "vllm", (3,)).name == "vllm:fp8_e4m3:s1:skip=3"
    assert setting_for_cache_type("q4_0+norot").name == "llamacpp:q4_0/q4_0:norot"
    assert split_setting_list("vllm:fp8:skip=0,2,q8_0.json,3") == [
        "vllm:fp8:skip=0,2", "q8_0.json", "3"]


@pytest.mark.parametrize("name,kbits,vbits", [("vllm:turboquant_4bit_nc", 4, 4),
                                               ("vllm:turboquant_k3v4_nc", 3, 4),
                                               ("vllm:TurboQuant_3bit_nc", 3, 3)])
def test_vllm_turboquant_settings_code_keys_with_a_codebook(name, kbits, vbits):
    """vLLM's TQ_PRESETS: Lloyd-Max keys after a plain Hadamard rotation with renormalised
    centroids (norm correction) and an fp16 norm, per-token min-max values (one scale and zero
    per vector), no window, and the first and last two layers (at most half of them) exact."""
    s = engine_config(name, num_layers=30)
    cfg = s.config
    assert s.per_model and s.engine == "vllm" and cfg.name == name
    assert cfg.default.key == CodebookSpec(kbits, "lloyd-max-normal", RotationSpec(),
                                          renormalize=True)
    assert cfg.default.value == QuantSpec(vbits, "per-token") and cfg.default.rotate_keys
    assert not cfg.default.rotate_values and cfg.default.residual_tokens == 0
    assert cfg.scale_dtype == "float16" and cfg.fp_dtype == "float16" and cfg.protect is None
    assert cfg.write_before_attention  # a forward after the first reads its tokens compressed
    assert sorted(cfg.layers) == [0, 1, 28, 29]
    assert all(not lk.compressed for lk in cfg.layers.values())
    assert sorted(engine_config(name, num_layers=3).config.layers) == [0, 2]
    assert engine_config(name, num_layers=1).config.layers == {}
    assert engine_config(name).config.layers == {}  # resolved once the model is known
    assert "first and last 2 layers exact (layers 0, 1, 28, 29)" in s.notes[0]
    assert "Triton decode kernel" in s.notes[0]
    assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="not one cache type"):
        measured_cache_type(parse_engine_setting(name))
    assert "vllm:T (T: turboquant_k8v4, turboquant_4bit_nc" in allowed_settings()


def test_vllm_turboquant_k8v4_casts_keys_to_fp8():
    """turboquant_k8v4 (vLLM's TQ_PRESETS: 8-bit keys, 4-bit values, no norm correction): keys
    cast to fp8 e4m3 with no scale and no rotation, i.e. a layer with unquantized keys at
    fp_dtype float8_e4m3fn (a saturating cast: 500 reads back as 448), values 4-bit min-max per
    token, and the boundary layers f16 engine layers (the config's fp_dtype is fp8, so a kvlens
    float layer would not be float16)."""
    from kvlens.layouts import DenseTensor

    s = engine_config("vllm:turboquant_k8v4", num_layers=30)
    cfg = s.config
    assert cfg.default.key is None and cfg.default.value == QuantSpec(4, "per-token")
    assert not cfg.default.rotate_keys and cfg.default.residual_tokens == 0
    assert cfg.fp_dtype == "float8_e4m3fn" and cfg.write_before_attention
    assert sorted(cfg.layers) == [0, 1, 28, 29]
    assert all(lk.key_format == lk.value_format == "f16" for lk in cfg.layers.values())
    assert "keys cast to fp8 e4m3 (no scale, not rotated)" in s.notes[0]
    store = DenseTensor(torch.float8_e4m3fn)
    store.append(torch.tensor([500.0, -3.3, 0.1]).reshape(1, 1, 3, 1))
    assert store.buf.float().flatten().tolist() == pytest.approx([448.0, -3.25, 0.1015625])


def _vllm_turboquant_reference(k, v, key_bits, value_bits):
    """vLLM's turboquant_*_nc store and decode written out from its source's formulas
    (docs/deploy/vllm.md), independently of kvlens: ``y = k / (|k| + 1e-8) H`` with the
    normalised Sylvester Hadamard ``H``, codes against the midpoints of the Lloyd-Max centroids
    of N(0, 1/D), fp16 norm, decoded centroids renormalised; values min-max per token,
    ``floor((v - min) / scale + 0.5)``, fp16 scale and min."""
    from kvlens.quant.codebook import lloyd_max

    d = k.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / d ** 0.5
    cents = lloyd_max(key_bits, None).centroids / d ** 0.5  # N(0, 1/D)
    norm = k.norm(dim=-1, keepdim=True)
    y = (k / (norm + 1e-8)) @ h
    c = cents[torch.bucketize(y, (cents[1:] + cents[:-1]) / 2)]
    k_hat = (norm.half().float() * c / c.norm(dim=-1, keepdim=True)) @ h
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2 ** value_bits - 1)).clamp_min(1e-8)
    code = torch.floor((v - lo) / scale + 0.5).clamp(0, 2 ** value_bits - 1)
    return k_hat, code * scale.half().float() + lo.half().float()


@pytest.mark.parametrize("name,kbits,vbits,d", [("vllm:turboquant_4bit_nc", 4, 4, 64),
                                                 ("vllm:turboquant_3bit_nc", 3, 3, 256)])
def test_vllm_turboquant_codes_what_vllms_formulas_give(name, kbits, vbits, d):
    """The config's key and value specs, through kvlens's reference quantizers (values with
    their scale and zero rounded to fp16, as the cache stores them), give back what vLLM's
    store-and-decode formulas give."""
    from kvlens.quant import QTensor, dequantize, fake_quantize_codebook, quantize

    torch.manual_seed(d)
    k = torch.randn(2, 3, 40, d) * torch.rand(1, 1, 40, 1) * 4
    v = torch.randn(2, 3, 40, d) + torch.rand(1, 1, 40, 1)
    layer = engine_config(name, num_layers=30).config.default
    q = quantize(v, layer.value)
    v_hat = dequantize(QTensor(q.codes, q.scale.half().float(), q.zero.half().float(),
                               layer.value, q.shape))
    k_ref, v_ref = _vllm_turboquant_reference(k, v, kbits, vbits)
    torch.testing.assert_close(fake_quantize_codebook(k, layer.key), k_ref, rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(v_hat, v_ref, rtol=1e-5, atol=1e-5)


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
