"""transformers' real quantized caches (the ``hf-caches`` extra: optimum-quanto, hqq) beside
kvlens: HQQ's zero refinement against hqq's own quantizer, the real caches against their
simulations on tiny models, and the per-layer export loaded by stock transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvlens.config import KVConfig, LayerKV
from kvlens.config.engine import parse_engine_setting
from kvlens.deploy import hf_cache
from kvlens.deploy.presets import engine_config
from kvlens.errors import ConfigError
from kvlens.evaluation.baselines import baseline
from kvlens.evaluation.kld import score_text
from kvlens.layouts.hqq_strided import HqqStrided
from kvlens.quant import QuantSpec
from kvlens.quant.reference import dequantize, quantize

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import tiny_model  # noqa: E402


def _real_backends():
    pytest.importorskip("optimum.quanto", reason="the hf-caches extra (make install has it)")
    pytest.importorskip("hqq", reason="the hf-caches extra (make install has it)")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape,group", [((1, 3, 40, 64), 32), ((2, 1, 12, 16), 16)])
def test_hqq_fit_is_hqqs_own_quantizer(bits, shape, group):
    """fit="hqq" on per-token groups reconstructs what hqq's Quantizer (axis=1, optimize=True,
    as transformers' HQQ cache calls it) reconstructs, to float rounding; min/max does not."""
    pytest.importorskip("hqq")
    from hqq.core.quantize import Quantizer

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(shape, generator=g) * torch.linspace(0.2, 3, shape[-1])
    codes, meta = Quantizer.quantize(x, nbits=bits, axis=1, group_size=group, device="cpu",
                                     compute_dtype=torch.float32, optimize=True)
    meta["compute_dtype"] = torch.float32
    real = Quantizer.dequantize(codes, meta)
    ours = dequantize(quantize(x, QuantSpec(bits, "per-token", group, fit="hqq")))
    minmax = dequantize(quantize(x, QuantSpec(bits, "per-token", group)))
    step = (x.amax() - x.amin()) / ((1 << bits) - 1)
    assert (ours - real).abs().max() < 1e-4 * step
    assert (minmax - real).abs().max() > 1e-2 * step  # the refinement moved the zero points
    assert (ours - x).abs().mean() < (minmax - x).abs().mean()


def test_hqq_settings_parse_and_refuse_clearly():
    s = parse_engine_setting("transformers:HQQ-2:axis_key=1:group=32")
    assert (s.bits, s.axis_key, s.axis_value, s.group, s.residual) == (2, 1, 0, 32, 128)
    assert parse_engine_setting(s.name) == s
    spec = engine_config(s.name).config.default
    assert spec.key == QuantSpec(2, "per-token", 32, fit="hqq")
    assert spec.value == HqqStrided(2, 32)
    for bad, why in (("transformers:hqq-5", "hqq bits are 1, 2, 3, 4, 8"),
                     ("transformers:hqq-4:axis_key=-1", "axis_key for hqq must be 0 or 1"),
                     ("transformers:hqq-4:window=3", "allowed: axis_key, axis_value")):
        with pytest.raises(ConfigError, match=why):
            parse_engine_setting(bad)
    with pytest.raises(ConfigError, match="allowed: hf-quanto-2"):
        baseline("hf-nope")
    with pytest.raises(ConfigError, match="'hf-hqq-4:axis_key=-1' is hf- followed by"):
        baseline("hf-hqq-4:axis_key=-1")


# quanto's axes 0 and -1, hqq's axis 1 (groups within one token) and axis 0 (strided over the
# whole history, kvlens.layouts.hqq_strided)
SETTINGS = ("quanto-4:group=16:residual=16", "quanto-2:axis_key=-1:group=16:residual=16",
            "hqq-4:axis_key=1:axis_value=1:group=16:residual=16",
            "hqq-2:axis_key=1:axis_value=1:group=16:residual=16",
            "hqq-4:group=16:residual=16", "hqq-2:axis_value=1:group=16:residual=16")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_real_caches_lose_what_their_simulations_lose(arch):
    """Each real cache (transformers' own layers) and kvlens's simulation of the same setting,
    scored in lockstep on one text: mean KLD within 1.5x of each other, both above zero;
    gemma3 has sliding-window layers, which QuantizedCache itself refuses."""
    _real_backends()
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(1))
    configs = [x for s in SETTINGS
               for x in (baseline("hf-" + s), engine_config("transformers:" + s).config)]
    scores = score_text(model, ids, configs, chunk=16)
    mean = [sum(c.kld) / len(c.kld) for c in scores.configs]
    for i, setting in enumerate(SETTINGS):
        real, sim = mean[2 * i], mean[2 * i + 1]
        assert real > 0 and sim > 0, setting
        assert 1 / 1.5 < sim / real < 1.5, (setting, real, sim)


def _mixed_config() -> KVConfig:
    quanto = LayerKV(QuantSpec(4, "per-channel", 16), QuantSpec(4, "per-token", 16), 16)
    hqq = LayerKV(QuantSpec(2, "per-token", 16, fit="hqq"),
                  QuantSpec(2, "per-token", 16, fit="hqq"), 16)
    return KVConfig("mixed", quanto, {0: LayerKV(), 2: hqq})


def test_export_loads_in_stock_transformers_and_runs_what_kvlens_simulates(tmp_path):
    """A per-layer config -> the export file -> transformers' own snippet builds the cache
    (DynamicLayer, QuantoQuantizedLayer, HQQQuantizedLayer, each with its arguments) and
    generates; the same file as ``hf-layers:FILE`` loses what the config's simulation loses."""
    _real_backends()
    config = _mixed_config()
    got = hf_cache.export(config, 3)
    assert got.problems == ()
    path = tmp_path / "cache.json"
    path.write_text(got.text())
    model = tiny_model("llama")
    inputs = {"input_ids": torch.randint(0, 128, (1, 40),
                                         generator=torch.Generator().manual_seed(2))}
    scope = {"model": model, "inputs": inputs}
    exec(hf_cache.snippet(str(path)), scope)  # the printed snippet, as a user runs it
    cache, out = scope["cache"], scope["out"]
    assert out.shape[1] > 40
    classes = [type(layer).__name__ for layer in cache.layers]
    assert classes == ["DynamicLayer", "QuantoQuantizedLayer", "HQQQuantizedLayer"]
    quanto, hqq = cache.layers[1], cache.layers[2]
    assert (quanto.nbits, quanto.axis_key, quanto.axis_value, quanto.q_group_size,
            quanto.residual_length) == (4, -1, 0, 16, 16)
    assert (hqq.nbits, hqq.axis_key, hqq.axis_value) == (2, 1, 1)
    assert quanto._quantized_keys is not None and hqq._quantized_keys is not None

    ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(3))
    real = baseline(hf_cache.compare_name(str(path)))
    scores = score_text(model, ids, [real, config], chunk=16)
    r, s = (sum(c.kld) / len(c.kld) for c in scores.configs)
    assert r > 0 and 1 / 1.5 < s / r < 1.5, (r, s)


def test_export_says_why_a_layer_does_not_map():
    two = LayerKV(QuantSpec(4, "per-channel", 16), QuantSpec(2, "per-token", 16), 16)
    rotated = LayerKV(QuantSpec(4, "per-token", 16), QuantSpec(4, "per-token", 16), 16,
                      rotate_keys=True)
    three = LayerKV(QuantSpec(3, "per-token", 16), QuantSpec(3, "per-token", 16), 16)
    got = hf_cache.export(KVConfig("x", LayerKV(), {1: two, 2: rotated, 3: three}), 4)
    assert got.document is None
    assert [p.split(":")[0] for p in got.problems] == ["layer 1", "layer 2", "layer 3"]
    assert "one nbits" in got.problems[0] and "rotate_keys" in got.problems[1]
    assert "quanto takes 2 or 4 bits" in got.problems[2]


def test_an_hqq_strided_layer_exports_as_hqqs_axis_0():
    """hqq-strided (``axis=0``) beside a per-token HQQ grid (``axis=1``) is one HQQ layer; at
    two widths, or beside a min/max grid, it says why not; a per-channel HQQ grid of consecutive
    tokens is not hqq's axis 0 and is not exported as one."""
    strided = HqqStrided(4, 16)
    token = QuantSpec(4, "per-token", 16, fit="hqq")
    got = hf_cache.layer_for(LayerKV(strided, token, 32))
    assert got == ("HQQQuantizedLayer", {"nbits": 4, "axis_key": 0, "axis_value": 1,
                                         "q_group_size": 16, "residual_length": 32})
    assert hf_cache.layer_for(LayerKV(token, strided, 32))[1]["axis_value"] == 0
    for bad in (LayerKV(strided, HqqStrided(2, 16), 32),
                LayerKV(strided, QuantSpec(4, "per-token", 16), 32)):
        assert "one nbits (1, 2, 3, 4, 8) and one q_group_size" in hf_cache.layer_for(bad)
    channel = QuantSpec(4, "per-channel", 16, fit="hqq")
    assert "its axis=0 is the hqq-strided layout" in hf_cache.layer_for(
        LayerKV(channel, channel, 32))


def test_a_file_that_is_not_an_export_is_refused(tmp_path):
    bad = tmp_path / "kv.json"
    bad.write_text(json.dumps({"format": "kvlens-config"}))
    with pytest.raises(Exception, match="not a transformers cache export"):
        baseline(hf_cache.compare_name(str(bad)))
