"""MiKV's importance set simulated on q, k, v (``kvlens.research.heavy_hitters``) against the real cache
layer, step by step: the same set at every query, the same attention output."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_one_by_one, set_of, set_twin, small_options

from kvlens.analysis.attention import attention_output, per_head_rel_error, streaming_exact_mask
from kvlens.analysis.metrics import Variant, attention_errors_many
from kvlens.cache.layer import CompressedLayer
from kvlens.config import LayerKV, ProtectSettings
from kvlens.model.shape import ModelShape
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.research.heavy_hitters import set_membership, set_reconstruction
from kvlens.research.mikv import MikvSets
from kvlens.research.sets import mikv_settings


class _Session:
    active = True
    rope: dict = {}




CASES = {
    # keys, values, set_bits, heavy fraction, window, flush, sinks, head_dim, balancer
    "int4 per-token": (QuantSpec(2, "per-token", 8), QuantSpec(2, "per-token", 8), 4, 0.25, 8,
                       4, 2, 16, False),
    "int8 per-channel whole window": (QuantSpec(2, "per-channel", 4),
                                      QuantSpec(2, "per-token", 8), 8, 0.2, 8, 0, 1, 32, False),
    # dense 3-bit codes packed along tokens come in units of 8 tokens: flush 8, window 16
    "fp set, no sinks": (QuantSpec(3, "per-channel", 4), QuantSpec(2, "per-channel", 4), None,
                         0.3, 16, 8, 0, 16, False),
    "int4 balanced keys": (QuantSpec(2, "per-token", 8), QuantSpec(4, "per-token", 8), 4, 0.2,
                           12, 4, 3, 16, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_set_and_output_follow_the_cache_layer(case):
    spec_k, spec_v, bits, heavy, residual, flush, sinks, d, balanced = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    b, hq, hkv, t = 2, 4, 2, 44
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h in (hq, hkv, hkv))
    k[:, :, 5::7] *= 3.0  # a few tokens that draw attention: the set is not arbitrary
    scaling = d ** -0.5
    mikv = mikv_settings(heavy, sinks, "fixed" if balanced else "off", set_bits=bits)
    bal = (1.0 + torch.rand(hkv, d, generator=g)) if balanced else None
    layer = CompressedLayer(LayerKV(spec_k, spec_v, residual, flush_tokens=flush), 0, d,
                            fp_dtype="float32", protect=mikv, balancer=bal, session=_Session())
    cache_sets, cache_out = decode_one_by_one(layer, q, k, v, scaling)

    k_read = fake_quantize(k * bal[None, :, None], spec_k) / bal[None, :, None] if balanced \
        else fake_quantize(k, spec_k)
    v_read = fake_quantize(v, spec_v)
    k_set, v_set = set_reconstruction(k, bits), set_reconstruction(v, bits)
    in_set = set_membership(q, k, k_read, k_set, mikv, scaling=scaling,
                            residual_tokens=residual, flush_tokens=flush)
    assert in_set.any() and torch.equal(in_set, cache_sets)
    # the metrics path reads the same mixture: window exact, set at its codes, rest quantized
    exact = streaming_exact_mask(t, residual, flush, 0)
    got = attention_errors_many(q, k, v, [Variant(k_read, v_read, in_set, k_set, v_set)],
                                scaling=scaling, exact=exact, chunk_size=7)[0]
    ref = attention_output(q, k, v, scaling)
    want = per_head_rel_error(ref, cache_out)
    torch.testing.assert_close(got.output, want, rtol=1e-3, atol=5e-5)  # float rounding
    assert float(want.min()) > 0


def test_keys_alone_and_values_alone_read_the_set_where_it_is():
    """A set at full precision read exact equals an exact cache there: a key-only variant whose
    set covers every quantized key has no error; a value set over nothing changes nothing."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 20, 8, generator=g) for h in (2, 1, 1))
    k_hat = k + 0.3 * torch.randn(k.shape, generator=g)
    v_hat = v + 0.3 * torch.randn(v.shape, generator=g)
    everything = torch.ones(1, 1, 20, 20, dtype=torch.bool)
    nothing = torch.zeros_like(everything)
    errs = attention_errors_many(q, k, v, [Variant(k_hat=k_hat, in_set=everything, k_set=k),
                                           Variant(v_hat=v_hat, in_set=nothing, v_set=v),
                                           Variant(v_hat=v_hat)], scaling=0.4)
    assert float(errs[0].output.max()) < 1e-6 and float(errs[0].scores.max()) == 0.0
    torch.testing.assert_close(errs[1].output, errs[2].output)
    from kvlens.errors import InputError

    with pytest.raises(InputError, match="in_set has shape"):
        attention_errors_many(q, k, v, [Variant(k_hat, in_set=everything[:, :, :5], k_set=k)],
                              scaling=0.4)


# -- mikv.layers: per-layer sets in the config, the cache and the layout ------------------------

def test_mikv_layers_round_trip_and_bad_input():
    import json

    from kvlens.config import KVConfig, config_from_dict
    from kvlens.errors import ConfigError

    s = QuantSpec
    base = KVConfig("partial-mikv", LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16),
                    protect=mikv_settings(0.2, 4, "off", set_bits=4, layers=[2, 0]))
    assert base.protect.importance.layers == (0, 2)
    assert base.protect_for(0) == base.protect and base.protect_for(2) == base.protect
    # a layer not listed keeps only the sinks, at fp_dtype
    assert base.protect_for(1) == ProtectSettings(4, "off")
    doc = base.to_dict()
    assert doc["importance"]["layers"] == [0, 2]
    assert config_from_dict(json.loads(json.dumps(doc))) == base
    # null: every compressed layer keeps heavy hitters, and the list is not written
    plain = KVConfig("all", base.default, protect=mikv_settings(0.2, 4, "off"))
    assert "layers" not in plain.to_dict()["importance"]
    assert plain.protect_for(1) == plain.protect
    for bad in ([1, 1], [-1], "0", [True], [0.5]):
        with pytest.raises(ConfigError, match=r"importance.layers .*allowed: null \(every compressed "
                                              "layer\\) or a list of distinct"):
            mikv_settings(0.2, 4, "off", layers=bad)
    with pytest.raises(ConfigError, match="heavy_fraction is 0"):
        mikv_settings(0.0, 4, "off", layers=[0])
    with pytest.raises(ConfigError, match=r"unknown keys \[.layer.\]; allowed: .*heavy_fraction"):
        config_from_dict(doc | {"importance": doc["importance"] | {"layer": [0]}})


def test_mikv_layers_beyond_the_model_are_refused():
    from tiny_models import tiny_model

    from kvlens.config import KVConfig, validate_for
    from kvlens.errors import ConfigError
    from kvlens.model.architecture import describe

    s = QuantSpec
    cfg = KVConfig("x", LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16),
                   protect=mikv_settings(0.2, 4, "off", layers=[1, 7]))
    with pytest.raises(ConfigError, match=r"importance.layers \[7\].*allowed indices: 0-2"):
        validate_for(cfg, describe(tiny_model("llama")))


def test_sets_on_some_layers_hold_what_the_layout_predicts():
    """mikv.layers = [1] with an INT4 set: layer 1 keeps heavy hitters at 4 bits (and its H2O
    mask and accumulators), layers 0 and 2 only their sinks at fp16; while decoding the bytes
    held equal memory_report and the layout, part by part."""
    from test_memory import _check, _model, _prefill_then_decode, _shape

    from kvlens.cache import compressed_attention
    from kvlens.config import KVConfig

    s = QuantSpec
    default = LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16, flush_tokens=8)
    config = KVConfig("partial-mikv", default, {2: LayerKV(s(4, "per-token", 8),
                                                           s(2, "per-channel", 8), 16)},
                      protect=mikv_settings(0.2, 3, "off", set_bits=4, layers=[1]))
    model = _model()
    shape = _shape(model)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), compressed_attention(model, config) as session:
        for prompt in (1, 37):
            cache = session.new_cache()
            _prefill_then_decode(model, cache, ids[:, :prompt + 40], prompt)
            _check(cache, config, shape, prompt + 40)
        cache = session.new_cache()
        _prefill_then_decode(model, cache, ids, 37)
        rep = _check(cache, config, shape, 120)
    heavy = [layer.needs_attention_probs for layer in cache.layers]
    assert heavy == [False, True, False]
    assert [layer.hp_k.bits for layer in cache.layers] == [None, 4, None]
    # 112 of the 120 tokens are quantized (window 16, blocks of 8): 3 sinks + ceil(0.2 * 112)
    assert [layer.hp_pos.shape[-1] for layer in cache.layers] == [3, 3 + 23, 3]
    assert rep["breakdown"]["masks"] == 112 * shape.num_key_value_heads  # one layer's H2O mask


# -- recommend: MiKV set candidates --------------------------------------------------------------

def _heavy_capture(path, heavy_layers=(0,), seed=0):
    """Two layers of random q, k, v; in ``heavy_layers`` every 16th token's key lies along the
    queries' common direction (it draws most of the attention) and its value is 4x larger: the
    heavy hitters a 2-bit cache reads badly and an INT8 set reads well."""
    from helpers import write_capture

    from kvlens.capture.store import CaptureMeta

    g = torch.Generator().manual_seed(seed)
    s, hq, hkv, t, d = 1, 4, 2, 256, 32
    tensors = {}
    for layer in (0, 1):
        q, k, v = (torch.randn(s, h, t, d, generator=g) for h in (hq, hkv, hkv))
        if layer in heavy_layers:
            u = torch.randn(d, generator=g)
            u = u / u.norm()
            q += 3.0 * u
            k[:, :, 7::16] += 3.0 * u
            v[:, :, 7::16] *= 4.0
        tensors[layer] = {"q": q, "k": k, "v": v, "q_pre": q, "k_pre": k}
    meta = CaptureMeta(model="planted", shape=ModelShape(2, hq, hkv, d, has_rope=False),
                       rope_layout="none", rotary_dim=0,
                       compute_dtype="float32", storage_dtype="float32", num_samples=s,
                       num_tokens=t, layers=(0, 1))
    return write_capture(path, meta, tensors)


def _opts(**kw):

    # min/max codes only: set twins are built on them (a fitted twin is not offered), so
    # these tests compare sets with the codes they sit beside
    base = dict(budget_bits=4.2, bits=(2,), group_sizes=(32,), sensitivity="uniform",
                retrieval="off", sink_tokens=0, rotation=False, balancer=False,
                extensions=(MikvSets(),),
                value_fits=("minmax",), scale_dtype="float16")  # budgets sized for float16
    return small_options(**(base | kw))


def test_recommend_puts_a_set_where_the_heavy_hitters_are(tmp_path):
    """Only layer 0 has heavy hitters: its set candidates measure far lower error than its
    plain 2-bit codes (layer 1's barely lower); a budget with room for one set spends it on
    layer 0, the config says so (mikv.layers = [0]) and its bits are the priced ones."""
    from dataclasses import replace

    from kvlens.cache.layout import config_bits
    from kvlens.recommend import Candidate, Stream, choose, measure

    path = _heavy_capture(tmp_path / "h.h5")
    opts = _opts()
    m = measure(path, opts)
    plain = Candidate("value", 2, "per-token", 32)
    twin = set_twin(plain, 8, 0.2)
    s = Stream(128, 32)  # the one window (128 tokens), sliding by 32
    assert m.tables[0][twin, s][0] < 0.3 * m.tables[0][plain, s][0]
    assert m.tables[1][twin, s][0] > 0.7 * m.tables[1][plain, s][0]
    rec = choose(m, opts)
    assert rec.config.protect.importance.layers == (0,) and rec.mean_bits <= opts.budget_bits
    assert [set_of(ch.candidate) is not None for ch in rec.choices] == [True, True, False, False]
    assert rec.config.protect.importance.set_bits == set_of(rec.choices[0].candidate)[0]
    assert rec.config.protect.importance.heavy_fraction == set_of(rec.choices[0].candidate)[1]
    assert config_bits(rec.config, m.meta.shape, opts.context) == pytest.approx(
        rec.mean_bits)
    assert "without a set" in rec.notes[-1]
    # too tight for a set; switched off; --prefer-fast: no set
    assert choose(m, replace(opts, budget_bits=3.6)).config.protect is None
    for off in (replace(opts, extensions=()), replace(opts, prefer_fast=True)):
        assert choose(m, off).config.protect is None


def test_set_candidates_are_priced_by_the_layout():
    """A twin costs its base plus the set (INT4 codes and fp16 scale/zero per token and
    tensor, an int32 position per set token), the H2O mask (a byte per packed token) and the
    accumulators (float32 per held token), per KV head."""
    from kvlens.recommend import Candidate, option_bytes

    shape = ModelShape(1, 2, 2, 32)
    opts = _opts(context=1024)
    k, v = Candidate("key", 2, "per-channel", 32), Candidate("value", 2, "per-token", 32)
    base = option_bytes(k, v, 32, opts, shape, 0)[0]
    twin = option_bytes(set_twin(k, 4, 0.1), set_twin(v, 4, 0.1), 32, opts,
                        shape, 0)[0]
    packed = 928  # ceil((1024 - 128 + 1) / 32) * 32 tokens quantized
    held = 93  # ceil(0.1 * 928)
    per_head = 2 * held * (16 + 2 * 2) + held * 4 + packed + 1024 * 4
    assert twin - base == 2 * per_head


def test_bad_set_widths_and_fractions_name_the_allowed_values(tmp_path):
    from typer.testing import CliRunner

    from kvlens.cli import app
    from kvlens.errors import InputError

    with pytest.raises(InputError, match="allowed: 4, 8"):
        _opts(extensions=(MikvSets(set_bits=(4, 3)),))
    with pytest.raises(InputError, match=r"allowed: fractions in \(0, 0.5\]"):
        _opts(extensions=(MikvSets(fractions=(0.2, 0.7)),))
    path = _heavy_capture(tmp_path / "h.h5")
    res = CliRunner().invoke(app, ["recommend", str(path), "-b", "4", "--set", "mikv=on",
                                   "--set", "mikv-bits=2"])
    assert res.exit_code == 1 and "allowed: 4, 8" in res.output
    res = CliRunner().invoke(app, ["recommend", str(path), "-b", "4", "--set", "mikv=on",
                                   "--set", "mikv-fractions=x"])
    assert res.exit_code == 1 and "expected float,..." in res.output
    # MiKV candidates are an experiment: their settings without the switch are refused
    res = CliRunner().invoke(app, ["recommend", str(path), "-b", "4", "--set", "mikv-bits=4"])
    assert res.exit_code == 1 and "add --set mikv=on" in res.output
    res = CliRunner().invoke(app, ["recommend", str(path), "-b", "4.2", "--set", "bits=2",
                                   "--set", "group-sizes=32", "--set", "sinks=0", "--set", "rotation=off",
                                   "--set", "balancer=off", "--set", "sensitivity=uniform", "--set",
                                   "retrieval=off", "--set", "mikv=off", "--windows", "128", "--json"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads(res.stdout)["config"]["protect"] is None


def test_recommended_sets_run_in_generate_and_hold_the_priced_bytes(tmp_path):
    """recommend on a tiny model's capture, a layer weighted 0 (a set cannot pay there): the
    config keeps sets in the other layers, loads, generates, and after ``context`` tokens the
    cache holds exactly the bytes recommend priced."""
    from test_memory import _check, _model, _prefill_then_decode, _shape

    from kvlens.cache import compressed_attention, memory_report
    from kvlens.capture.run import capture_model
    from kvlens.config import load_config, save_config, validate_for
    from kvlens.evaluation.decode import greedy
    from kvlens.model.architecture import describe
    from kvlens.recommend import choose, measure

    model = _model()
    cap = tmp_path / "tiny.h5"
    capture_model(model, torch.randint(0, 128, (1, 96), generator=torch.Generator()
                                       .manual_seed(0)), cap)
    opts = _opts(budget_bits=16.0, context=512, residual_tokens=32, flush_tokens=32,
                 sink_tokens=2, layer_weights=(1.0, 0.0, 1.0))
    rec = choose(measure(cap, opts), opts)
    assert rec.config.protect.importance.layers == (0, 2)
    save_config(rec.config, tmp_path / "cfg.json")
    cfg = load_config(tmp_path / "cfg.json")
    assert cfg == rec.config
    validate_for(cfg, describe(model))
    ids = torch.randint(3, 128, (1, 512), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), compressed_attention(model, cfg, backend="torch") as session:
        new, _ = greedy(model, ids[:, :40], session, 6)
        assert new.shape == (1, 6)
        cache = session.new_cache()
        _prefill_then_decode(model, cache, ids, 470)
        _check(cache, cfg, _shape(model), 512)
    assert [layer.needs_attention_probs for layer in cache.layers] == [True, False, True]
    assert memory_report(cache)["bits_per_element"] == pytest.approx(rec.mean_bits)
