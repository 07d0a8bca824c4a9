"""MiKV's importance set simulated on q, k, v (``kvlens.heavy_hitters``) against the real cache
layer, step by step: the same set at every query, the same attention output."""

from __future__ import annotations

import pytest
import torch

from kvlens.cache.attention import packed_attention
from kvlens.cache.layer import CompressedLayer
from kvlens.heavy_hitters import set_membership, set_reconstruction
from kvlens.kvconfig import LayerKV, MikvSettings
from kvlens.metrics import (
    Variant,
    attention_errors_many,
    attention_output,
    per_head_rel_error,
    streaming_exact_mask,
)
from kvlens.quant import QuantSpec, fake_quantize


class _Session:
    active = True
    rope: dict = {}


def _decode(layer, q, k, v, scaling):
    """Feed the layer one token at a time as generate does; ``(set before each query [B, Hkv,
    T, T] bool, attention outputs [B, Hq, T, D])``."""
    b, hkv, t, _ = k.shape
    sets = torch.zeros(b, hkv, t, t, dtype=torch.bool)
    outs = []
    for i in range(t):
        layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        if layer.has_hp:
            sets[:, :, i].scatter_(-1, layer.hp_pos.long(), True)
        out, colsum = packed_attention(q[:, :, i:i + 1], layer, None, scaling, with_probs=True)
        layer.commit(q[:, :, i:i + 1], colsum)
        outs.append(out.transpose(1, 2))
    return sets, torch.cat(outs, dim=2)


CASES = {
    # keys, values, set_bits, heavy fraction, window, flush, sinks, head_dim, balancer
    "int4 per-token": (QuantSpec(2, "per-token", 8), QuantSpec(2, "per-token", 8), 4, 0.25, 8,
                       4, 2, 16, False),
    "int8 per-channel whole window": (QuantSpec(2, "per-channel", 4),
                                      QuantSpec(2, "per-token", 8), 8, 0.2, 8, 0, 1, 32, False),
    "fp set, no sinks": (QuantSpec(3, "per-channel", 4), QuantSpec(2, "per-channel", 4), None,
                         0.3, 8, 4, 0, 16, False),
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
    mikv = MikvSettings(heavy, sinks, "fixed" if balanced else "off", set_bits=bits)
    bal = (1.0 + torch.rand(hkv, d, generator=g)) if balanced else None
    layer = CompressedLayer(LayerKV(spec_k, spec_v, residual, flush_tokens=flush), 0, d,
                            fp_dtype="float32", mikv=mikv, balancer=bal, session=_Session())
    cache_sets, cache_out = _decode(layer, q, k, v, scaling)

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

    from kvlens.errors import ConfigError
    from kvlens.kvconfig import KVConfig, config_from_dict

    s = QuantSpec
    base = KVConfig("partial-mikv", LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16),
                    mikv=MikvSettings(0.2, 4, "off", set_bits=4, layers=[2, 0]))
    assert base.mikv.layers == (0, 2)
    assert base.mikv_for(0) == base.mikv and base.mikv_for(2) == base.mikv
    # a layer not listed keeps only the sinks, at fp_dtype
    assert base.mikv_for(1) == MikvSettings(0.0, 4, "off")
    doc = base.to_dict()
    assert doc["version"] == 2 and doc["mikv"]["layers"] == [0, 2]
    assert config_from_dict(json.loads(json.dumps(doc))) == base
    # null: every compressed layer keeps heavy hitters, and version 1 stays readable
    plain = KVConfig("all", base.default, mikv=MikvSettings(0.2, 4, "off"))
    assert "layers" not in plain.to_dict()["mikv"] and plain.to_dict()["version"] == 1
    assert plain.mikv_for(1) == plain.mikv
    with pytest.raises(ConfigError, match="need KV config version 2"):
        config_from_dict(doc | {"version": 1})
    for bad in ([1, 1], [-1], "0", [True], [0.5]):
        with pytest.raises(ConfigError, match=r"mikv.layers .*allowed: null \(every compressed "
                                              "layer\\) or a list of distinct"):
            MikvSettings(0.2, 4, "off", layers=bad)
    with pytest.raises(ConfigError, match="heavy_fraction is 0"):
        MikvSettings(0.0, 4, "off", layers=[0])
    with pytest.raises(ConfigError, match="keys heavy_fraction"):
        config_from_dict(doc | {"mikv": doc["mikv"] | {"layer": [0]}})


def test_mikv_layers_beyond_the_model_are_refused():
    from tiny_models import tiny_model

    from kvlens.architecture import describe
    from kvlens.errors import ConfigError
    from kvlens.kvconfig import KVConfig, validate_for

    s = QuantSpec
    cfg = KVConfig("x", LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16),
                   mikv=MikvSettings(0.2, 4, "off", layers=[1, 7]))
    with pytest.raises(ConfigError, match=r"mikv.layers \[7\].*allowed indices: 0-2"):
        validate_for(cfg, describe(tiny_model("llama")))


def test_sets_on_some_layers_hold_what_the_layout_predicts():
    """mikv.layers = [1] with an INT4 set: layer 1 keeps heavy hitters at 4 bits (and its H2O
    mask and accumulators), layers 0 and 2 only their sinks at fp16; while decoding the bytes
    held equal memory_report and the layout, part by part."""
    from test_memory import _check, _model, _prefill_then_decode, _shape

    from kvlens.cache import compressed_attention
    from kvlens.kvconfig import KVConfig

    s = QuantSpec
    default = LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16, flush_tokens=8)
    config = KVConfig("partial-mikv", default, {2: LayerKV(s(4, "per-token", 8),
                                                           s(2, "per-channel", 8), 16)},
                      mikv=MikvSettings(0.2, 3, "off", set_bits=4, layers=[1]))
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
    assert rep["breakdown"]["masks"] == 112 * shape.kv_heads  # one layer's H2O mask
