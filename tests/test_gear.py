"""GEAR (sparse outliers + low-rank factors per packed block) and MiKV's importance set at a bit
width, in the cache: stored parts follow their definitions, the folded read path equals
"rebuild densely, then attend exactly", configs refuse bad values."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import reference_attention, small_options, stub_session

from kvlens.cache.gear import GearTensor, part_bytes
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.mixed import dequantize_rows, quantize_rows, set_bytes_per_token
from kvlens.cache.torch_read import packed_attention
from kvlens.cache.triton_glue import triton_unsupported
from kvlens.config import (
    PRESETS,
    GearSettings,
    KVConfig,
    LayerKV,
    MikvSettings,
    config_from_dict,
    validate_for,
)
from kvlens.errors import ConfigError
from kvlens.layouts.packed import PackedTensor
from kvlens.model.shape import ModelShape
from kvlens.quant import QuantSpec, fake_quantize


def _plain_sparse_lowrank(gear: GearTensor, n: int) -> torch.Tensor:
    """S + L of the first ``n`` packed tokens, rebuilt with loops from the raw buffers (an
    independent reading of the layout in ``kvlens.cache.gear``'s docstring)."""
    b, h = gear.out_val.shape[:2]
    d, f, k = gear.head_dim, gear.block, gear.k
    out = torch.zeros(b, h, n, d)
    for blk in range(n // f):
        rows = slice(blk * f, (blk + 1) * f)
        if gear.gear.rank:
            out[:, :, rows] += gear.left[:, :, rows].float() @ gear.right[:, :, blk].float()
        for bi in range(b):
            for hi in range(h):
                if gear.per_channel:
                    for j in range(k):
                        r = blk * k + j
                        for c in range(d):
                            t = blk * f + int(gear.out_idx[bi, hi, r, c])
                            out[bi, hi, t, c] += gear.out_val[bi, hi, r, c].float()
                else:
                    for t in range(blk * f, (blk + 1) * f):
                        for j in range(k):
                            c = int(gear.out_idx[bi, hi, t, j])
                            out[bi, hi, t, c] += gear.out_val[bi, hi, t, j].float()
    return out


def _fill(layer, k, v, prefill, hq):
    layer.update(k[:, :, :prefill], v[:, :, :prefill])
    layer.commit(torch.randn(k.shape[0], hq, prefill, k.shape[-1]), None)
    for t in range(prefill, k.shape[2]):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(k.shape[0], hq, 1, k.shape[-1]), None)


LAYOUTS = {  # keys, values: both outlier scopes on both tensors
    "kch-vtok": (QuantSpec(2, "per-channel", 8), QuantSpec(2, "per-token", 8)),
    "ktok-vch": (QuantSpec(3, "per-token", 8), QuantSpec(4, "per-channel", 16)),
}


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gear_read_path_equals_dense_reference(name, rank):
    """Odd shapes (head_dim 24, 83 tokens cached, GQA 6/2, batch 2 with a left-padded row,
    several chunks, a 3-token query): folded q.L, q.S, P.L, P.S equal dequantize + S + L, then
    exact attention."""
    torch.manual_seed(11 + rank)
    b, hq, hkv, d, total, tq = 2, 6, 2, 24, 86, 3
    kspec, vspec = LAYOUTS[name]
    gear = GearSettings(rank, 0.05, 2)
    layer = CompressedLayer(LayerKV(kspec, vspec, 16), 0, d, gear=gear, session=stub_session())
    k = torch.randn(b, hkv, total, d)
    k[..., 5] *= 8  # an outlier channel
    v = torch.randn(b, hkv, total, d)
    _fill(layer, k[:, :, :total - tq], v[:, :, :total - tq], 37, hq)
    n_q = layer.quantized_length
    assert n_q == 80 and layer.kgear.length == n_q == layer.vgear.length
    layer.update(k[:, :, total - tq:], v[:, :, total - tq:])
    keys = torch.cat((layer.kstore.dequantize_range(0, n_q) + _plain_sparse_lowrank(
        layer.kgear, n_q), layer.res_k.view().float()), 2)
    values = torch.cat((layer.vstore.dequantize_range(0, n_q) + _plain_sparse_lowrank(
        layer.vgear, n_q), layer.res_v.view().float()), 2)
    mask = torch.ones(b, 1, tq, total, dtype=torch.bool).tril(total - tq)
    mask[1, ..., :9] = False
    q = torch.randn(b, hq, tq, d)
    out, _ = packed_attention(q, layer, mask, d ** -0.5, chunk_tokens=32)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask), rtol=1e-5,
                               atol=1e-5)
    # the dense helper used by references agrees with the loop reading
    torch.testing.assert_close(layer.kgear.dense_range(16, 48),
                               _plain_sparse_lowrank(layer.kgear, 48)[:, :, 16:])


@pytest.mark.parametrize("spec", [QuantSpec(2, "per-channel", 8), QuantSpec(2, "per-token", 8)])
def test_gear_parts_follow_their_definitions(spec):
    """S holds the top-k magnitudes of every quantization vector and makes them exact; full
    rank recovers the block; each term lowers the error on data with outliers and a low-rank
    component."""
    torch.manual_seed(3)
    b, h, f, d = 1, 2, 32, 16
    base = torch.randn(b, h, 2 * f, d)
    lowrank = torch.randn(b, h, 2 * f, 2) @ torch.randn(b, h, 2, d) * 0.5
    x = base + lowrank
    x[0, 0, 7, 3] = 40.0  # planted outliers
    x[0, 1, 50, 11] = -35.0

    def stored(rank, fp=torch.float32):
        store = PackedTensor.create(spec, f, d, "float32")
        g = GearTensor(spec, GearSettings(rank, 0.04, 4), f, d, fp)
        g.compress(x, store)
        return store, g, store.dequantize_range(0, 2 * f) + g.dense_range(0, 2 * f)

    store, g0, hat0 = stored(0)
    dim = -2 if g0.per_channel else -1
    assert g0.k == (2 if g0.per_channel else 1)  # ceil(0.04 * 32) tokens, ceil(0.04 * 16) channels
    # every outlier vector's stored indices are its k largest magnitudes
    xv = x.view(b, h, 2, f, d) if g0.per_channel else x
    top = xv.abs().topk(g0.k, dim=dim).indices.sort(dim=dim).values
    got = g0.out_idx.long().view(top.shape) if g0.per_channel else g0.out_idx.long()
    assert torch.equal(got, top)
    assert hat0[0, 0, 7, 3] == pytest.approx(40.0, abs=1e-5)
    assert hat0[0, 1, 50, 11] == pytest.approx(-35.0, abs=1e-5)
    _, _, full = stored(min(f, d))
    torch.testing.assert_close(full, x, atol=1e-4, rtol=1e-4)  # full rank: exact block
    err = {r: float((stored(r)[2] - x).norm() / x.norm()) for r in (0, 2)}
    plain = float((fake_quantize(x.view(b, h, 2, f, d).transpose(1, 2).reshape(2, h, f, d),
                                 spec).reshape(b, 2, h, f, d).transpose(1, 2).reshape(x.shape)
                   - x).norm() / x.norm())
    assert err[2] < 0.9 * err[0] < 0.9 * plain, (plain, err)
    # float16 parts: the bytes the layout names, and close to the float32 result
    _, g16, hat16 = stored(2, torch.float16)
    held = sum(t.untyped_storage().nbytes() for _, t in g16.named_tensors())
    assert held == b * h * sum(part_bytes(spec, g16.gear, 2 * f, f, d, 2))
    assert float((hat16 - x).norm() / x.norm()) < err[2] + 0.01


def test_gear_bytes_per_entry_and_factor_cost():
    """3 bytes per outlier entry at float16 (value + uint8 index); r (F + D) factors per
    block; a vector longer than 256 needs 2-byte indices."""
    g = GearSettings(4, 0.02, 3)
    o, lr = part_bytes(QuantSpec(2, "per-channel", 32), g, 128, 64, 64, 2)
    assert o == 2 * 64 * 2 * 3  # 2 blocks x 64 channels x ceil(0.02 * 64) = 2 entries x 3 bytes
    assert lr == 4 * (128 + 2 * 64) * 2
    o, _ = part_bytes(QuantSpec(2, "per-token", 32), g, 128, 64, 64, 2)
    assert o == 128 * 2 * 3  # one vector per token, ceil(0.02 * 64) = 2 entries
    o, _ = part_bytes(QuantSpec(2, "per-channel", 32), g, 512, 512, 64, 2)
    assert o == 64 * 11 * 4  # ceil(0.02 * 512) = 11 per channel, fp16 + int16 index


def test_gear_config_is_validated_and_versioned():
    for bad in (0, 0.5, -0.1, 0.7, True):
        with pytest.raises(ConfigError, match="strictly between 0 and 0.5"):
            GearSettings(4, bad)
    with pytest.raises(ConfigError, match="allowed: an integer from 0"):
        GearSettings(-1)
    with pytest.raises(ConfigError, match=r"larger than a flushed block of 8 tokens allows; "
                                          r"allowed: 0-8"):
        KVConfig("x", LayerKV(QuantSpec(2, "per-channel", 8), QuantSpec(2, "per-token", 8), 8),
                 gear=GearSettings(9))
    with pytest.raises(ConfigError, match="pre_rope_keys"):
        KVConfig("x", LayerKV(QuantSpec(2, "per-channel", 8), None, 8, pre_rope_keys=True),
                 gear=GearSettings(2))
    cfg = KVConfig("x", LayerKV(QuantSpec(2, "per-channel", 32), QuantSpec(2, "per-token", 16),
                                64), gear=GearSettings(20))
    info = ModelShape(2, 1, 1, 16, architecture="LlamaForCausalLM")
    with pytest.raises(ConfigError, match=r"head_dim 16 allows; allowed: 0-16"):
        validate_for(cfg, info)
    data = PRESETS["gear-2"].to_dict()
    assert data["version"] == 2 and data["gear"] == {"rank": 4, "outlier_fraction": 0.02,
                                                     "power_iters": 3, "layers": None}
    assert config_from_dict(json.loads(json.dumps(data))) == PRESETS["gear-2"]
    assert PRESETS["kivi-2"].to_dict()["version"] == 1 and "gear" not in PRESETS["kivi-2"].to_dict()
    with pytest.raises(ConfigError, match="need KV config version 2"):
        config_from_dict(data | {"version": 1})
    with pytest.raises(ConfigError, match="'gear' must be an object with keys rank"):
        config_from_dict(data | {"gear": {"rank": 4, "n_b": 64}})


def test_mikv_set_bits_are_validated():
    for bad in (2, 3, 16, "4", True):
        with pytest.raises(ConfigError, match=r"allowed: null \(the set at fp_dtype\), 4, 8"):
            MikvSettings(0.2, 4, "off", set_bits=bad)
    data = PRESETS["mikv-2-int4"].to_dict()
    assert data["version"] == 2 and data["mikv"]["set_bits"] == 4
    assert config_from_dict(data) == PRESETS["mikv-2-int4"]


def test_set_rows_round_trip_and_bytes():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 7, 64)
    x[..., 9] *= 20
    for bits, tol in ((4, 0.15), (8, 0.01)):
        codes, scale, zero = quantize_rows(x, bits)
        back = dequantize_rows(codes, scale, zero, bits, 64)
        spec = QuantSpec(bits, "per-token", 32)
        assert float((back - fake_quantize(x, spec)).abs().max()) < 0.05 * bits / 4
        assert float((back - x).norm() / x.norm()) < tol
        per_token = sum(t[0, 0, 0].numel() * t.element_size() for t in (codes, scale, zero))
        assert per_token == set_bytes_per_token(bits, 64) == 64 * bits // 8 + 2 * 2 * 2


@pytest.mark.parametrize("set_bits", [None, 4, 8])
def test_mikv_set_at_a_bit_width_is_what_attention_reads(set_bits):
    """The set's tokens are read as their stored codes (dequantized with the reference), their
    packed copies hidden; the rest as packed codes and the window."""
    torch.manual_seed(4)
    b, hq, hkv, d, total = 1, 4, 2, 32, 60
    spec = QuantSpec(2, "per-token", 8)
    mikv = MikvSettings(heavy_fraction=0.25, sink_tokens=2, balancer="off", set_bits=set_bits)
    layer = CompressedLayer(LayerKV(spec, spec, 8), 0, d, mikv=mikv, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    for t in range(total):  # decode, choosing heavy hitters by the attention each step paid
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(b, hq, 1, d)
        layer.commit(q, packed_attention(q, layer, None, d ** -0.5, with_probs=True)[1])
    n_q = layer.quantized_length
    keys = torch.cat((layer.kstore.dequantize_range(0, n_q), layer.res_k.view().float()), 2)
    values = torch.cat((layer.vstore.dequantize_range(0, n_q), layer.res_v.view().float()), 2)
    for hh in range(hkv):
        pos = layer.hp_pos[0, hh].long()
        exact_k, exact_v = k[:, hh:hh + 1, pos].half().float(), v[:, hh:hh + 1, pos].half().float()
        if set_bits is not None:  # independent: the reference quantizer on the exact rows
            spec_set = QuantSpec(set_bits, "per-token", 32)
            exact_k, exact_v = fake_quantize(exact_k, spec_set), fake_quantize(exact_v, spec_set)
        keys[0, hh, pos], values[0, hh, pos] = exact_k[0, 0], exact_v[0, 0]
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(q, layer, None, d ** -0.5)
    ref = reference_attention(q, keys, values, torch.ones(1, 1, 1, total, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)  # float16 set scales
    held = sum(t.untyped_storage().nbytes() for t in layer.hp_k.parts)
    per = d * 2 if set_bits is None else set_bytes_per_token(set_bits, d)
    assert held == layer.hp_pos.numel() * per


def test_gear_layers_say_why_the_kernel_is_not_used():
    spec = QuantSpec(2, "per-channel", 16)
    layer = CompressedLayer(LayerKV(spec, QuantSpec(2, "per-token", 16), 16), 0, 16,
                            gear=GearSettings(2), session=stub_session())
    assert "GEAR" in triton_unsupported(layer, torch.zeros(1, 2, 1, 16), False)


def test_recommend_measures_prices_and_writes_gear(tmp_path):
    """GEAR twins of the G32 candidates: lower error than their plain twins on keys with
    outlier channels, priced with their outliers and factors, and written as ``gear.layers``
    exactly for the layers that chose them."""
    from dataclasses import replace

    from test_recommend import _planted_capture

    from kvlens.cache.gear import part_bytes
    from kvlens.cache.layout import config_bits
    from kvlens.model.shape import ModelShape
    from kvlens.recommend import (
        Candidate,
        Stream,
        candidates,
        choose,
        gear_settings,
        measure,
        option_bytes,
    )

    path = _planted_capture(tmp_path / "p.h5", has_rope=False)
    opts = small_options(budget_bits=4.0, group_sizes=(32,), bits=(2, 4), balancer=False,
                            rotation=False, sensitivity="uniform", retrieval="off",
                            fp_dtype="float16", gear=True)  # outliers priced at 2 bytes below
    cands = candidates(32, opts, has_rope=False)
    assert {(c.tensor, c.bits, c.granularity) for c in cands if c.gear} == {
        (t, b, g) for t in ("key", "value") for b in (2, 4) for g in ("per-channel", "per-token")}
    assert not any(c.gear for c in candidates(32, replace(opts, gear=False), False))
    m = measure(path, opts)
    f = opts.layer_flush(Candidate("key", 2, "per-channel", 32))
    s = Stream(max(opts.window_sizes), f)
    for table in m.tables:  # measured: 0.63-0.77x, except 2-bit per-token keys (0.77-0.91x)
        for c in (c for c in cands if c.gear):
            plain_err, gear_err = table[replace(c, gear=False), s][0], table[c, s][0]
            coarse = c.tensor == "key" and c.granularity == "per-token" and c.bits == 2
            assert gear_err < (0.95 if coarse else 0.8) * plain_err, (c, gear_err, plain_err)
    shape = ModelShape(2, 2, 2, 32)
    k, v = Candidate("key", 2, "per-channel", 32), Candidate("value", 2, "per-token", 32)
    plain = option_bytes(k, v, f, opts, shape, 0)
    gear = option_bytes(replace(k, gear=True), replace(v, gear=True), f, opts, shape, 0)
    held = opts.context - max(opts.window_sizes) + f  # the layout's quantized tokens at context
    extra = sum(2 * sum(part_bytes(c.spec(), gear_settings(), held - held % f, f, 32, 2))
                for c in (k, v))
    assert gear[0] - plain[0] == extra > 0
    chosen = {}
    for budget in (4.0, 6.0, 9.0):
        rec = choose(m, replace(opts, budget_bits=budget))
        layers = set(rec.config.gear.layers) if rec.config.gear else set()
        for ch in rec.choices:
            assert (ch.layer in layers) == ch.candidate.gear
        assert rec.mean_bits == pytest.approx(config_bits(rec.config, shape, opts.context))
        assert rec.mean_bits <= budget
        chosen[budget] = layers
    # GEAR's factors cost ~2 bits here: not worth it on a tight budget, taken on a loose one
    assert not chosen[4.0] and chosen[9.0]


def test_gear_on_some_layers_generates_and_holds_what_the_layout_predicts():
    """gear.layers = [1]: only layer 1 keeps outliers and factors; layer 2 may then store
    pre-RoPE keys; held bytes equal the prediction while decoding."""
    from dataclasses import replace

    from test_memory import _check, _model, _prefill_then_decode, _shape

    from kvlens.cache import compressed_attention
    from kvlens.model.hooks import cache_argument_name

    s = QuantSpec
    default = LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), 16)
    config = KVConfig("partial-gear", default,
                      {2: replace(default, pre_rope_keys=True)},
                      gear=GearSettings(4, 0.1, 2, layers=[1]))
    assert config.gear_for(0) is None and config.gear_for(1) is not None
    with pytest.raises(ConfigError, match="pre_rope_keys"):
        replace(config, gear=GearSettings(4, 0.1, 2, layers=[1, 2]))
    model = _model()
    shape = _shape(model)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        _prefill_then_decode(model, cache, ids, 37)
        rep = _check(cache, config, shape, 90)
        logits = model(ids[:, -1:], use_cache=True,
                       **{cache_argument_name(model): cache}).logits
    assert torch.isfinite(logits).all()
    assert [layer.kgear is not None for layer in cache.layers] == [False, True, False]
    assert rep["breakdown"]["lowrank"] > 0 and rep["breakdown"]["outliers"] > 0


@pytest.mark.triton  # the decode kernel under the interpreter
@pytest.mark.parametrize("set_bits", [4, 8])
def test_kernel_reads_an_integer_set_like_the_torch_path(set_bits):
    """The Triton decode kernel (interpreter on CPU) gets the integer set dequantized as its
    extra segment and equals the torch path."""
    pytest.importorskip("triton")
    from kvlens.cache.triton_glue import triton_decode

    torch.manual_seed(6)
    b, hq, hkv, d, total = 2, 4, 2, 16, 60
    mikv = MikvSettings(heavy_fraction=0.0, sink_tokens=4, balancer="off", set_bits=set_bits)
    spec_k, spec_v = QuantSpec(2, "per-channel", 16), QuantSpec(2, "per-token", 16)
    layer = CompressedLayer(LayerKV(spec_k, spec_v, 16), 0, d, mikv=mikv, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    k[:, :, :4] *= 6  # large sink keys: the set's codes matter
    _fill(layer, k, v, 40, hq)
    assert layer.has_hp and layer.hp_k.bits == set_bits
    q = torch.randn(b, hq, 1, d)
    assert triton_unsupported(layer, q, with_probs=False) is None
    ref, _ = packed_attention(q, layer, None, d ** -0.5)
    out, why = triton_decode(q, layer, None, d ** -0.5)
    assert why is None
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_generate_help_names_every_preset():
    import inspect

    from kvlens.cli.generate import generate

    text = inspect.signature(generate).parameters["preset_name"].default.help
    assert [p for p in PRESETS if p not in text] == []
