"""The compressed cache: identity with compression off, packed layout round trip, decode
attention over the packed store vs "dequantize with the reference, then attend"."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session
from tiny_models import tiny_model

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.backend import select_backend
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.config import KVConfig, LayerKV, ProtectSettings, preset
from kvlens.errors import BackendError, ConfigError
from kvlens.layouts import layout_of
from kvlens.layouts.packed import PackedTensor
from kvlens.model.hooks import cache_argument_name
from kvlens.quant import QTensor, QuantSpec, dequantize, quantize
from kvlens.research.sets import mikv_settings


def _small(name: str, residual: int):
    """A preset with group sizes that fit the tiny models' head_dim 16."""
    cfg = preset(name)
    d = cfg.default
    return replace(cfg, default=replace(d, residual_tokens=residual,
                                        flush_tokens=min(d.flush_tokens, residual // 2),
                                        key=replace(d.key, group_size=8),
                                        value=replace(d.value, group_size=8)))


def _generate(model, ids, mask, cache=None, n=12):
    kw = {cache_argument_name(model): cache} if cache is not None else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt_neox"])
def test_identity_cache_matches_dynamic_cache(arch):
    model = tiny_model(arch)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    ref = _generate(model, ids, mask)
    with compressed_attention(model, preset("fp16")) as session:
        cache = session.new_cache()
        out = _generate(model, ids, mask, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 12 - 1
    # Registration is undone: the plain model still generates the same.
    assert torch.equal(_generate(model, ids, mask), ref)


def test_identity_cache_smollm2(smollm2):
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    ref = _generate(model, ids, mask, n=8)
    with compressed_attention(model, preset("fp16")) as session:
        out = _generate(model, ids, mask, session.new_cache(), n=8)
    assert torch.equal(out, ref)


def test_cache_outside_its_context_is_refused():
    model = tiny_model("llama")
    with compressed_attention(model, _small("kivi-2", 16)) as session:
        cache = session.new_cache()
    with pytest.raises(ConfigError, match="compressed_attention"):
        _generate(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), cache)


@pytest.mark.parametrize("spec,residual", [
    (QuantSpec(2, "per-channel", 32), 64),
    (QuantSpec(4, "per-token", 16), 0),
    (QuantSpec(3, "per-token", 8), 16),
    (QuantSpec(3, "per-channel", 8), 24),
    (QuantSpec(2, "per-tensor"), 16),
    (QuantSpec(4, "per-channel", None, symmetric=True), 8),
    (QuantSpec(2, "per-token", 32, fit="mse"), 16),
])
def test_packed_round_trip_equals_reference(spec, residual):
    torch.manual_seed(1)
    store = PackedTensor.create(spec, residual, 64)
    f = store.block
    x = torch.randn(2, 3, 5 * f, 64) * 3
    store.append(x[:, :, :f])
    store.append(x[:, :, f:])  # grows the capacity once
    got = store.dequantize_range(0, 5 * f)
    blocks = x.reshape(2, 3, 5, f, 64).transpose(1, 2).reshape(10, 3, f, 64)
    q = quantize(blocks, spec)
    ref = dequantize(QTensor(q.codes, q.scale.half().float(), q.zero.half().float(), spec,
                             q.shape))
    ref = ref.reshape(2, 5, 3, f, 64).transpose(1, 2).reshape(2, 3, 5 * f, 64)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # held bytes are exactly the layout's prediction (no spare capacity), far below fp32
    held = sum(t.untyped_storage().nbytes() for t in store.named_tensors().values())
    assert held == 2 * 3 * sum(layout_of(spec).part_bytes(5 * f, 64, f).values())
    assert held < x.numel() * 2 * spec.bits / 8 + x.numel()
    # codes are dense: exactly bits/8 bytes per element (3 bits: 8 codes in 3 bytes)
    assert store.codes.untyped_storage().nbytes() == x.numel() * spec.bits // 8
    # a sliding layer's eviction drops whole blocks from the front and keeps the rest intact
    store.drop_front(2 * f)
    torch.testing.assert_close(store.dequantize_range(0, 3 * f), ref[:, :, 2 * f:], rtol=0,
                               atol=1e-6)
    held = sum(t.untyped_storage().nbytes() for t in store.named_tensors().values())
    assert held == 2 * 3 * sum(layout_of(spec).part_bytes(3 * f, 64, f).values())


# T not a multiple of G, window partly full; flush 0 = the whole window, 16 = sliding window
@pytest.mark.parametrize("total,flush", [(77, 0), (100, 0), (131, 0), (77, 16), (100, 16),
                                         (131, 16)])
def test_packed_decode_attention_equals_reference(total, flush):
    torch.manual_seed(total)
    b, hq, hkv, d = 2, 6, 2, 32
    kspec, vspec = QuantSpec(2, "per-channel", 16), QuantSpec(3, "per-token", 8)
    setting = LayerKV(kspec, vspec, residual_tokens=32, flush_tokens=flush)
    layer = CompressedLayer(setting, 0, d, session=stub_session())
    k = torch.randn(b, hkv, total, d)
    k[..., 3] *= 10  # an outlier channel
    v = torch.randn(b, hkv, total, d)
    prefill = 41
    layer.update(k[:, :, :prefill], v[:, :, :prefill])
    layer.commit(torch.randn(b, hq, prefill, d), None)
    for t in range(prefill, total):  # decode one token at a time, as generate() does
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    n_q = layer.quantized_length
    f = flush or 32
    if flush:  # the window keeps R-F..R-1 tokens: the newest are always exact
        assert n_q == -(-(total - 31) // f) * f and 16 <= layer.n_res <= 31
    else:
        assert n_q == (total // 32) * 32 and layer.n_res == total % 32
    assert n_q + layer.n_res == total
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(q, layer, None, d ** -0.5, chunk_tokens=32)
    keys = stored_view(k, kspec, f, n_q)
    values = stored_view(v, vspec, f, n_q)
    ref = reference_attention(q, keys, values, torch.ones(1, 1, 1, total, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_packed_attention_with_left_padding_mask_and_multi_token_queries():
    torch.manual_seed(3)
    b, hq, hkv, d, total, tq = 2, 4, 1, 16, 70, 3
    spec = QuantSpec(4, "per-channel", 8)
    layer = CompressedLayer(LayerKV(spec, spec, 16), 0, d, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    layer.update(k[:, :, :total - tq], v[:, :, :total - tq])
    layer.commit(torch.randn(b, hq, total - tq, d), None)
    layer.update(k[:, :, total - tq:], v[:, :, total - tq:])
    mask = torch.ones(b, 1, tq, total, dtype=torch.bool).tril(total - tq)
    mask[1, :, :, :9] = False  # row 1 is left-padded by 9 tokens
    q = torch.randn(b, hq, tq, d)
    out, _ = packed_attention(q, layer, mask, d ** -0.5, chunk_tokens=16)
    n_q = layer.quantized_length
    ref = reference_attention(q, stored_view(k, spec, 16, n_q),
                               stored_view(v, spec, 16, n_q), mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The None mask means causal, bottom-right aligned.
    out_none, _ = packed_attention(q, layer, None, d ** -0.5)
    causal = torch.ones(1, 1, tq, total, dtype=torch.bool).tril(total - tq)
    ref_none = reference_attention(q, stored_view(k, spec, 16, n_q),
                                    stored_view(v, spec, 16, n_q), causal)
    torch.testing.assert_close(out_none, ref_none, rtol=1e-5, atol=1e-5)


def test_mikv_high_precision_tokens_replace_their_low_bit_copies():
    torch.manual_seed(4)
    b, hq, hkv, d, total = 1, 4, 2, 16, 40
    spec = QuantSpec(2, "per-token", 8)
    mikv = mikv_settings(heavy_fraction=0.25, sink_tokens=2, balancer="off")
    layer = CompressedLayer(LayerKV(spec, spec, 8), 0, d, protect=mikv, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    for t in range(total):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(b, hq, 1, d)
        _, colsum = packed_attention(q, layer, None, d ** -0.5, with_probs=True)
        layer.commit(q, colsum)
    assert layer.has_hp and bool((layer.hp_pos[..., :2].sort(-1).values
                                  == torch.tensor([0, 1])).all())
    n_q = layer.quantized_length
    keys, values = stored_view(k, spec, 8, n_q), stored_view(v, spec, 8, n_q)
    for hh in range(hkv):  # high-precision tokens are exact
        pos = layer.hp_pos[0, hh]
        pos = pos.long()
        keys[0, hh, pos] = k[0, hh, pos].half().float()
        values[0, hh, pos] = v[0, hh, pos].half().float()
    q = torch.randn(b, hq, 1, d)
    out, colsum = packed_attention(q, layer, None, d ** -0.5, with_probs=True)
    ref = reference_attention(q, keys, values, torch.ones(1, 1, 1, total, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(colsum.sum(), torch.tensor(float(hq)), rtol=1e-5, atol=1e-5)


def test_balancer_pre_rope_and_sinks_generate_close_to_fp16():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    logits = {}
    # 34 tokens, window 16: flushed whole at 32; kivi-2-sinks slides by 8 (24 quantized)
    expected = {"kivi-2-prerope": 32, "mikv-4": 32, "kivi-2-sinks": 24}
    for name in ("fp16", "kivi-2-prerope", "mikv-4", "kivi-2-sinks"):
        cfg = preset(name) if name == "fp16" else _small(name, 16)
        with compressed_attention(model, cfg) as session:
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            model(ids[:, :33], attention_mask=mask[:, :33], **kw)
            out = model(ids[:, 33:34], **kw).logits[0, -1]
        logits[name] = out
        if name != "fp16":
            assert cache.layers[0].quantized_length == expected[name]
            report = memory_report(cache)
            assert 0 < report["kv_bytes"] < report["kv_bytes_fp16"] * 2
        if name == "kivi-2-sinks":  # the sinks' full-precision copies are positions 0-3
            assert sorted(set(cache.layers[0].hp_pos.flatten().tolist())) == [0, 1, 2, 3]
    for name in expected:
        rel = (logits[name] - logits["fp16"]).norm() / logits["fp16"].norm()
        assert 0 < rel < 0.2, name


def test_memory_report_counts_packed_bytes():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(6))
    cfg = _small("kivi-2", 32)
    with compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        model(ids, **{cache_argument_name(model): cache})
    rep = memory_report(cache)
    # 3 layers x 2 KV heads x 64 tokens x head_dim 16, K and V, all flushed (2 blocks of 32):
    # 2-bit codes + fp16 scale and zero per group of 8 -> 2 + 32/8 = 6 bits per element, plus
    # the empty window's buffer, which keeps room for 32 fp16 tokens: 32/64 * 16 = 8 bits.
    assert rep["breakdown"]["window"] == 3 * 2 * 2 * 32 * 16 * 2
    assert rep["unaccounted"] == 0
    assert rep["kv_bytes_fp16"] == 3 * 2 * 2 * 64 * 16 * 2
    assert rep["bits_per_element"] == pytest.approx(16 * rep["kv_bytes"] / rep["kv_bytes_fp16"])
    assert rep["bits_per_element"] == pytest.approx(6.0 + 8.0)


def test_select_backend_reports_why_triton_is_not_used(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, reason = select_backend("auto", "cpu")
    assert name == "torch" and "CUDA" in reason
    with pytest.raises(BackendError, match="unavailable"):
        select_backend("triton", "cpu")
    assert select_backend("torch", "cpu")[0] == "torch"


# Every layout `recommend` can write: per-token keys (with and without the balancer), per-channel
# values, per-tensor, G=None, densely packed 3-bit codes (8 per 3 bytes), symmetric specs.
LAYOUTS = {
    "ktok16-vch16-2b": (QuantSpec(2, "per-token", 16), QuantSpec(2, "per-channel", 16)),
    "ktokNone-vchNone-2b": (QuantSpec(2, "per-token", None), QuantSpec(2, "per-channel", None)),
    "ktensor-vtensor-4b": (QuantSpec(4, "per-tensor"), QuantSpec(4, "per-tensor")),
    "ktok8-vch16-3b": (QuantSpec(3, "per-token", 8), QuantSpec(3, "per-channel", 16)),
    "kch16sym-vch16sym": (QuantSpec(4, "per-channel", 16, symmetric=True),
                          QuantSpec(2, "per-channel", 16, symmetric=True)),
    "ktok16bal-vtok16": (QuantSpec(2, "per-token", 16), QuantSpec(2, "per-token", 16)),
    "kdense-vch16": (None, QuantSpec(2, "per-channel", 16)),
}


@pytest.mark.parametrize("flush", [0, 16])
@pytest.mark.parametrize("total", [80, 134])  # 77, 131 tokens cached before the query
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_folded_reads_every_layout_equal_reference(name, total, flush):
    """Decode (one query) and a 3-token query, batch 2 with row 1 left-padded by 9 tokens, GQA
    6/2, T not a multiple of G, window partly full, several chunks: equal to "dequantize with
    the reference, then attend"."""
    torch.manual_seed(total + flush)
    b, hq, hkv, d = 2, 6, 2, 32
    kspec, vspec = LAYOUTS[name]
    bal = torch.rand(hkv, d) + 0.5 if name.startswith("ktok16bal") else None
    mikv = ProtectSettings(0, "fixed") if bal is not None else None
    setting = LayerKV(kspec, vspec, residual_tokens=32, flush_tokens=flush)
    layer = CompressedLayer(setting, 0, d, protect=mikv, balancer=bal, session=stub_session())
    k = torch.randn(b, hkv, total, d)
    k[..., 3] *= 10  # an outlier channel
    v = torch.randn(b, hkv, total, d)
    layer.update(k[:, :, :41], v[:, :, :41])
    layer.commit(torch.randn(b, hq, 41, d), None)
    for t in range(41, total - 3):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    n_q = layer.quantized_length
    assert n_q >= 32 and layer.n_res > 0
    f = flush or 32
    seen = total - 3
    if kspec is None:
        keys = k[:, :, :seen].half().float()
    elif bal is None:
        keys = stored_view(k[:, :, :seen], kspec, f, n_q)
    else:  # the store holds k * bal (quantized); q / bal reads it
        keys = stored_view(k[:, :, :seen].half().float() * bal[:, None], kspec, f, n_q,
                            torch.float32)
        keys[:, :, :n_q] /= bal[:, None]
        keys[:, :, n_q:] = k[:, :, n_q:seen].half().float()
    values = stored_view(v[:, :, :seen], vspec, f, n_q)
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :9] = False
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(q, layer, mask, d ** -0.5, chunk_tokens=32)
    ref = reference_attention(q, keys, values, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a 3-token query (chunked prefill) with the causal mask
    layer.update(k[:, :, seen:], v[:, :, seen:])
    tq = 3
    mask3 = torch.ones(b, 1, tq, total, dtype=torch.bool).tril(total - tq)
    mask3[1, ..., :9] = False
    q3 = torch.randn(b, hq, tq, d)
    out3, _ = packed_attention(q3, layer, mask3, d ** -0.5, chunk_tokens=32)
    keys3 = torch.cat((keys, k[:, :, seen:].half().float()), 2)
    values3 = torch.cat((values, v[:, :, seen:].half().float()), 2)
    torch.testing.assert_close(out3, reference_attention(q3, keys3, values3, mask3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kspec", [QuantSpec(2, "per-channel", 8), QuantSpec(3, "per-token", 8)])
def test_pre_rope_keys_equal_reference(kspec):
    """Pre-RoPE keys (re-rotated from stored positions) on a tiny Llama, batch 2 left-padded:
    the layer's attention equals the reference dequantize + apply_rope (float64) + attend."""
    from kvlens.rope import apply_rope

    model = tiny_model("llama")
    vspec = QuantSpec(2, "per-channel", 8)
    cfg = replace(preset("kivi-2-prerope"),
                  default=LayerKV(kspec, vspec, residual_tokens=16, pre_rope_keys=True))
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        model(ids, attention_mask=mask, **{cache_argument_name(model): cache})
    layer = cache.layers[1]
    assert layer.stores_pre_rope and layer.quantized_length == 32
    n_q, d = layer.quantized_length, layer.head_dim
    cos, sin = layer.rope_tables(layer.q_start, layer.q_end)
    keys = torch.cat((apply_rope(layer.kstore.dequantize_range(0, n_q), cos, sin,
                                 layer.rope.layout), layer.res_k.view().float()), 2)
    values = torch.cat((layer.vstore.dequantize_range(0, n_q), layer.res_v.view().float()), 2)
    hq = model.config.num_attention_heads
    q = torch.randn(2, hq, 1, d)
    m = torch.ones(2, 1, 1, 45, dtype=torch.bool)
    m[1, ..., :5] = False
    out, _ = packed_attention(q, layer, m, d ** -0.5, chunk_tokens=16)
    torch.testing.assert_close(out, reference_attention(q, keys, values, m), rtol=1e-5,
                               atol=1e-5)


def test_pre_rope_keys_on_gemma3_use_each_layer_types_theta():
    # Gemma3 rotates sliding layers at theta 1e4 and global ones at 1e6: stored pre-RoPE keys
    # must be re-rotated with the right table per layer (8-bit codes: near-exact logits)
    model = tiny_model("gemma3")
    thetas = {t["rope_theta"] for t in model.config.rope_parameters.values()}
    assert thetas == {10000.0, 1000000.0}
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, pre in (("fp16", None), ("pre", True)):
        cfg = preset("fp16") if pre is None else KVConfig(
            name, LayerKV(QuantSpec(8, "per-channel", 8), None, 8, pre_rope_keys=True))
        with compressed_attention(model, cfg) as session, torch.no_grad():
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            model(ids[:, :59], **kw)
            out[name] = model(ids[:, 59:60], **kw).logits[0, -1]
            if pre:
                assert all(layer.stores_pre_rope and layer.quantized_length > 0
                           for layer in cache.layers)
    rel = (out["pre"] - out["fp16"]).norm() / out["fp16"].norm()
    assert rel < 5e-3
