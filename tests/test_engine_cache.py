"""Engine-format cache layers (``kvlens.cache.engine``): llama.cpp / vLLM semantics and bytes.

- The cache's logits equal a plain reference: exact K/V history from ``DynamicCache``,
  quantize-dequantized with ``kvlens.quant.formats.fake_quantize_format`` (the format's one
  definition) inside the attention function, then the model's own attention.
- The bytes a ggml layer stores are ``gguf.quants.quantize`` of the rotated keys/values, byte
  for byte.
- Write-before-attention: the prefill's own attention reads quantized K/V (unlike the kvlens
  window), and chunked prefill stores the same bytes as token-by-token feeding.
- Held bytes == ``memory_report`` == ``kvlens.cache.layout`` exactly, global and sliding layers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import held_bytes

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layout import config_bits, config_part_bytes, shape_of
from kvlens.config import VERSION, KVConfig, LayerKV, config_from_dict, validate_for
from kvlens.errors import ConfigError
from kvlens.model.hooks import attention_override, cache_argument_name
from kvlens.quant import QuantSpec, engine_rotation, fake_quantize_format, rotate_rows
from kvlens.quant.cachetypes import DenseType, parse_cache_type


def _model(arch: str = "llama", head_dim: int = 64, seed: int = 0):
    import transformers as tf
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=2048)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    else:
        cfg = tf.Gemma3TextConfig(**common, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention",
                                               "sliding_attention"])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _engine(k: str, v: str, name: str = "eng", **kw) -> KVConfig:
    return KVConfig(name, LayerKV(key_format=k, value_format=v), **kw)


def _scales(n_layers: int, heads: int | None = None, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = heads or 1
    return {i: {"key": tuple((torch.rand(n, generator=g) * 0.02 + 0.005).tolist()),
                "value": tuple((torch.rand(n, generator=g) * 0.02 + 0.005).tolist())}
            for i in range(n_layers)}


def _spans(total: int, chunk) -> list[tuple[int, int]]:
    """Forward calls over ``total`` tokens: ``chunk`` tokens each (an int), or the given sizes
    (a tuple; e.g. chunked prefill then one-token decode steps)."""
    sizes = [chunk] * -(-total // chunk) if isinstance(chunk, int) else list(chunk)
    ends = [min(total, sum(sizes[:i + 1])) for i in range(len(sizes))]
    return [(a, b) for a, b in zip([0, *ends], ends) if b > a]


def _reference_logits(model, ids, config: KVConfig, chunk, record: dict | None = None):
    """Plain reference: DynamicCache keeps exact K/V; the attention function reads them
    quantize-dequantized by ``fake_quantize_format`` (per tensor, per layer setting)."""
    from transformers import DynamicCache

    def factory(original):
        def attention(module, query, key, value, mask, **kwargs):
            layer = config.layer(module.layer_idx)
            scales = config.kv_scales.get(module.layer_idx, {})
            out = []
            for tensor, x, ct in (("key", key, layer.key_type), ("value", value,
                                                                  layer.value_type)):
                if record is not None:
                    record[(module.layer_idx, tensor)] = x.detach().clone()
                if isinstance(ct, DenseType):
                    out.append(x.to(getattr(torch, ct.torch_dtype)).to(x.dtype))
                    continue
                s = None
                if ct.format.family == "fp8":
                    s = torch.tensor(scales[tensor]).reshape(1, -1, 1, 1) \
                        if ct.format.fixed_scale is None else \
                        torch.full((1, 1 if ct.format.scope == "tensor" else x.shape[1], 1, 1),
                                   ct.format.fixed_scale)
                out.append(fake_quantize_format(x, ct, tensor, s).to(x.dtype))
            return original(module, query, out[0], out[1], mask, **kwargs)
        return attention

    cache = DynamicCache(config=model.config)
    logits = []
    with attention_override(model, factory), torch.no_grad():
        for a, b in _spans(ids.shape[1], chunk):
            kw = {cache_argument_name(model): cache}
            logits.append(model(ids[:, a:b], use_cache=True, **kw).logits)
    return torch.cat(logits, 1)


def _engine_logits(model, ids, config: KVConfig, chunk):
    """Logits of ``ids`` through kvlens' cache for ``config`` (``chunk``: as ``_spans``)."""
    with compressed_attention(model, config) as session, torch.no_grad():
        cache = session.new_cache()
        kw = {cache_argument_name(model): cache}
        logits = [model(ids[:, a:b], use_cache=True, **kw).logits
                  for a, b in _spans(ids.shape[1], chunk)]
    return torch.cat(logits, 1), cache


SETTINGS = [
    ("q8_0", "q4_0", {}),
    ("q4_1", "q5_0", {}),
    ("q5_1", "iq4_nl+norot", {}),
    ("q4_0+norot", "f16", {}),
    ("fp8_e4m3:s1", "fp8_e5m2:s1", {}),
    ("fp8_e4m3", "fp8_e5m2", {"kv_scales": _scales(3)}),
    ("fp8_e4m3@head", "fp8_e4m3@head", {"kv_scales": _scales(3, heads=2)}),
    ("int8@token-head", "int4@token-head", {}),
    ("fp8@token-head", "bf16", {}),
]


@pytest.mark.parametrize("k,v,kw", SETTINGS, ids=[f"{k}/{v}" for k, v, _ in SETTINGS])
@pytest.mark.parametrize("arch,head_dim", [("llama", 64), ("gemma3", 64), ("llama", 96)])
def test_cache_equals_quantize_dequantize_reference(k, v, kw, arch, head_dim):
    """Logits with the engine cache (chunks of 7 tokens, odd) equal the plain reference, and the
    prefill's own predictions already differ from the exact model (write-before-attention)."""
    model = _model(arch, head_dim)
    config = _engine(k, v, **kw)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = _reference_logits(model, ids, config, 7)
    got, _ = _engine_logits(model, ids, config, 7)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        exact = model(ids[:, :7]).logits
    assert (got[:, :7] - exact).abs().max() > 1e-4  # the first chunk read quantized K/V


@pytest.mark.parametrize("ktype,vtype", [("q4_0", "q8_0"), ("q5_1", "q4_1"),
                                         ("q4_0+norot", "q5_0+norot")])
def test_ggml_bytes_are_gguf_quants_of_the_rotated_rows(ktype, vtype, monkeypatch):
    """Every layer's stored K and V bytes = gguf.quants.quantize of the rows the layer was given
    (rotated by llama.cpp's matrix where it rotates), fed in chunks of 5."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from kvlens.cache.engine import EngineLayer

    seen: dict = {}
    update = EngineLayer.update

    def recording(self, k, v, *args, **kwargs):
        seen.setdefault(self.layer_idx, []).append((k.detach().clone(), v.detach().clone()))
        return update(self, k, v, *args, **kwargs)

    monkeypatch.setattr(EngineLayer, "update", recording)
    model = _model("llama", 128)
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(2))
    _, cache = _engine_logits(model, ids, _engine(ktype, vtype), 5)
    for layer in cache.layers:
        for i, (tensor, store, ct) in enumerate((("key", layer.kstore, layer.key_type),
                                                 ("value", layer.vstore, layer.value_type))):
            x = torch.cat([kv[i] for kv in seen[layer.layer_idx]], dim=2).float()
            if ct.rotates(128):
                x = rotate_rows(x, engine_rotation(tensor, 128))
            qtype = GGMLQuantizationType[ct.format.name.upper()]
            want = gguf_quantize(x.reshape(-1, 128).numpy().astype(np.float32), qtype)
            assert np.array_equal(store.data.reshape(want.shape).numpy(), want), (tensor, ct)


def test_rotation_follows_llama_cpp_rule():
    """Rotated where llama.cpp rotates (quantized type, head_dim % 64 == 0), per tensor; keys by
    the largest power-of-two block (128 here), values by 64x64 blocks; never fp8/f16."""
    model = _model("llama", 128)
    with compressed_attention(model, _engine("q8_0", "f16")) as session:
        layer = session.new_cache().layers[0]
        assert (layer.rotate_keys, layer.rotate_values) == (True, False)
        rk = session.engine_rotation("key", 128, "cpu")
        rv = session.engine_rotation("value", 128, "cpu")
    assert torch.count_nonzero(rk[:64, 64:]) > 0  # one 128-block
    assert torch.count_nonzero(rv[:64, 64:]) == 0  # 64x64 blocks
    assert not parse_cache_type("q4_0").rotates(96)
    assert parse_cache_type("q4_0").rotates(192)
    assert not parse_cache_type("q4_0+norot").rotates(128)
    assert not parse_cache_type("fp8_e4m3:s1").rotates(128)


@pytest.mark.parametrize("k,v", [("q4_0", "q8_0"), ("int4@token-head", "fp8_e4m3:s1")])
def test_chunked_prefill_stores_what_token_by_token_stores(k, v):
    """Per-token formats and static scales do not depend on the chunking: the stored bytes are
    identical, and the last logits agree to float rounding."""
    model = _model("gemma3", 64)
    config = _engine(k, v)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    a, ca = _engine_logits(model, ids, config, 30)
    b, cb = _engine_logits(model, ids, config, 1)
    for la, lb in zip(ca.layers, cb.layers):
        for sa, sb in ((la.kstore, lb.kstore), (la.vstore, lb.vstore)):
            assert torch.equal(sa.data.view(torch.uint8), sb.data.view(torch.uint8))
    torch.testing.assert_close(a[:, -1], b[:, -1], atol=1e-5, rtol=1e-5)


MEMORY = [
    _engine("q8_0", "q4_0"),
    _engine("q5_1", "iq4_nl+norot"),
    _engine("fp8_e4m3:s1", "fp8_e5m2@head:s0.5"),
    _engine("fp8_e4m3@head", "fp8_e4m3", kv_scales={i: {"key": (0.01, 0.02), "value": (0.03,)}
                                                    for i in range(3)}),
    _engine("int8@token-head", "int4@token-head"),
    _engine("fp8@token-head", "f32"),
    # vLLM-style: one dtype, layer 1 skipped (kept at f16)
    KVConfig("skip", LayerKV(key_format="fp8_e4m3:s1", value_format="fp8_e4m3:s1"),
             {1: LayerKV(key_format="f16", value_format="f16")}),
]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("config", MEMORY, ids=[f"{c.default.key_format}/{c.default.value_format}"
                                                for c in MEMORY])
def test_held_bytes_equal_report_and_formula(arch, config):
    """After a 13-token prefill and 1, 5 and 20 decode steps (batch 2, left padding), the cache
    holds exactly what memory_report reports and kvlens.cache.layout predicts."""
    model = _model(arch, 64)
    shape = shape_of(model)
    ids = torch.randint(3, 128, (2, 33), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 33, dtype=torch.long)
    mask[1, :3] = 0
    with compressed_attention(model, config) as session, torch.no_grad():
        cache = session.new_cache()
        kw = {cache_argument_name(model): cache}
        model(ids[:, :13], attention_mask=mask[:, :13], use_cache=True, **kw)
        for step in range(1, 21):
            t = 13 + step
            model(ids[:, t - 1:t], attention_mask=mask[:, :t], use_cache=True, **kw)
            if step in (1, 5, 20):
                rep = memory_report(cache)
                assert rep["unaccounted"] == 0
                assert rep["kv_bytes"] == held_bytes(cache) == sum(rep["breakdown"].values())
                assert rep["breakdown"] == config_part_bytes(config, shape, t, 2)
                assert rep["kv_bytes_fp16"] == shape.fp16_bytes(t, 2)
                assert rep["bits_per_element"] == pytest.approx(config_bits(config, shape, t, 2))


def test_bits_per_element_match_the_formats():
    """At 1024 tokens: q8_0 8.5, q4_0 4.5 bits; fp8 8 + its scales; int4@token-head 4 + 32/D."""
    from kvlens.model.shape import ModelShape

    shape = ModelShape(num_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    assert config_bits(_engine("q8_0", "q4_0"), shape, 1024) == pytest.approx(6.5)
    assert config_bits(_engine("int4@token-head", "int4@token-head"), shape, 1024) == \
        pytest.approx(4.5)
    fp8 = config_bits(_engine("fp8_e4m3:s1", "fp8_e4m3:s1"), shape, 1024)
    assert fp8 == pytest.approx(8 + 32 / (2 * 1024 * 64))


def test_config_json_round_trip():
    cfg = KVConfig("x", LayerKV(key_format="q8_0", value_format="q4_0+norot"),
                   {2: LayerKV(key_format="f16", value_format="f16")},
                   kv_scales={})
    data = cfg.to_dict()
    assert data["version"] == VERSION and data["default"]["key_format"] == "q8_0"
    assert config_from_dict(data) == cfg
    plain = KVConfig("p", LayerKV()).to_dict()
    assert plain["version"] == VERSION and "kv_scales" not in plain
    scaled = _engine("fp8_e4m3", "fp8_e4m3", kv_scales={0: {"key": (0.1,), "value": (0.2,)}})
    assert config_from_dict(scaled.to_dict()).kv_scales == {0: {"key": (0.1,), "value": (0.2,)}}


def test_bad_engine_configs_are_refused_with_the_allowed_values():
    with pytest.raises(ConfigError, match="allowed: .*q8_0.*f16"):
        LayerKV(key_format="q3_0", value_format="f16")
    with pytest.raises(ConfigError, match="both key_format and value_format"):
        LayerKV(key_format="q8_0")
    with pytest.raises(ConfigError, match="cannot be combined"):
        LayerKV(residual_tokens=8, key_format="q8_0", value_format="q8_0")
    model = _model("llama", 64)
    from kvlens.model.architecture import describe

    info = describe(model)
    with pytest.raises(ConfigError, match="no kv_scales.*:s1"):
        validate_for(_engine("fp8_e4m3", "f16"), info)
    with pytest.raises(ConfigError, match="one per KV head"):
        validate_for(_engine("fp8_e4m3@head", "f16", kv_scales={
            i: {"key": (1.0,)} for i in range(3)}), info)
    with pytest.raises(ConfigError, match="block size 32"):
        validate_for(_engine("q4_0", "f16"), describe(_model("llama", 48)))
    with pytest.raises(ConfigError, match="not an engine-format layer"):
        validate_for(replace(_engine("q8_0", "q8_0"), layers={0: LayerKV()},
                             kv_scales={0: {"key": (1.0,)}}), info)


# -- llama.cpp's CPU attention arithmetic (KVConfig.engine_attention) ---------------------------


@pytest.mark.parametrize("k,v", [("q8_0", "q4_0"), ("q4_0+norot", "q8_0+norot")])
def test_llamacpp_arithmetic_equals_query_through_q8_0_reference(k, v):
    """With engine_attention the logits equal the plain reference whose query is first rotated
    by K's rotation, round-tripped through ggml's q8_0 (``quantize_ggml``) and rotated back:
    ``conv(q R) . Q(k R) = (conv(q R) R^T) . k_hat``; a quantized V accumulates in float32."""
    from kvlens.quant.ggml import GGML_FORMATS, dequantize_ggml, quantize_ggml

    model = _model("llama", 64)
    config = _engine(k, v, engine_attention="llamacpp-cpu-fa")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    plain = replace(config, engine_attention=None)
    rotated = parse_cache_type(k).rotates(64)
    r = engine_rotation("key", 64) if rotated else torch.eye(64)
    q8 = GGML_FORMATS["q8_0"]

    def query_conv(module, query, *args, **kwargs):
        return dequantize_ggml(quantize_ggml(query.float() @ r, q8)) @ r.T

    from transformers import DynamicCache

    def factory(original):
        def attention(module, query, key, value, mask, **kwargs):
            lk = plain.layer(module.layer_idx)
            kh = fake_quantize_format(key, lk.key_type, "key", None).to(key.dtype)
            vh = fake_quantize_format(value, lk.value_type, "value", None).to(value.dtype)
            return original(module, query_conv(module, query), kh, vh, mask, **kwargs)
        return attention

    cache = DynamicCache(config=model.config)
    ref = []
    with attention_override(model, factory), torch.no_grad():
        for c0 in range(0, 30, 7):
            ref.append(model(ids[:, c0:c0 + 7], use_cache=True,
                             **{cache_argument_name(model): cache}).logits)
    ref = torch.cat(ref, 1)
    got, _ = _engine_logits(model, ids, config, 7)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    storage_only, _ = _engine_logits(model, ids, plain, 7)
    assert (got - storage_only).abs().max() > 1e-4  # the query conversion shows


def test_llamacpp_arithmetic_f16_tiles_are_float32_and_f16_v_accumulates_in_fp16():
    """f16/f16 in ubatches of 64 takes the tiled path (float32, the model's own arithmetic);
    with a q8_0 K the f16 V is accumulated in fp16 (a different result)."""
    model = _model("llama", 64)
    ids = torch.randint(3, 128, (1, 128), generator=torch.Generator().manual_seed(2))
    f16 = _engine("f16", "f16", engine_attention="llamacpp-cpu-fa")
    tiled, _ = _engine_logits(model, ids, f16, 64)
    plain, _ = _engine_logits(model, ids, replace(f16, engine_attention=None), 64)
    torch.testing.assert_close(tiled, plain, atol=2e-5, rtol=1e-5)
    one_chunk, _ = _engine_logits(model, ids[:, :20], f16, 5)  # 5 queries: one_chunk
    assert (one_chunk - plain[:, :20]).abs().max() > 1e-6
    torch.testing.assert_close(one_chunk, plain[:, :20], atol=5e-3, rtol=1e-3)


def test_engine_attention_in_config_json_and_setting_names():
    from kvlens.config.engine import parse_engine_setting

    s = parse_engine_setting("llamacpp:q8_0/q4_0")
    assert s.kvconfig("x").engine_attention == "llamacpp-cpu-fa"
    assert parse_engine_setting("llamacpp:q8_0:nofa").kvconfig("x").engine_attention == \
        "llamacpp-cpu-nofa"
    off = parse_engine_setting("llamacpp:q8_0/q4_0:norot:noarith")
    assert off.kvconfig("x").engine_attention is None
    assert off.name == "llamacpp:q8_0/q4_0:norot:noarith"
    assert parse_engine_setting(off.name) == off
    cfg = s.kvconfig("x")
    data = cfg.to_dict()
    assert data["version"] == VERSION and data["engine_attention"] == "llamacpp-cpu-fa"
    assert config_from_dict(data) == cfg
    with pytest.raises(ConfigError, match="allowed: null .*llamacpp-cpu-fa"):
        _engine("q8_0", "q8_0", engine_attention="cuda")
    assert "engine_attention" not in _engine("q8_0", "q8_0").to_dict()


# -- configs mixing engine-format and kvlens layers ------------------------------------------
# transformers builds one mask per layer type from the first layer of that type
# (kvlens.cache.layer.HistoryLayer); a sliding engine layer and a sliding kvlens layer in one
# config must read the same mask. An uncompressed kvlens layer (LayerKV(): float16 window, the
# model's own attention) attends to exactly what an f16/f16 engine layer reads back, so the two
# kinds can stand in for each other with equal logits.

FP16 = LayerKV()
ENGINE_F16 = LayerKV(key_format="f16", value_format="f16")
# 4-bit kvlens layer: flushes every 4 tokens, so sliding layers evict packed blocks by 40 tokens
QUANT = LayerKV(QuantSpec(4, "per-channel", 4), QuantSpec(4, "per-token", 32),
                residual_tokens=8, flush_tokens=4)
# chunked prefill past the window (8), then decode steps
SCHEDULE = (7, 7, 7, 5) + (1,) * 14


def _mixed(default: LayerKV, layers: dict, **kw) -> KVConfig:
    return KVConfig("mixed", default, layers, **kw)


@pytest.mark.parametrize("kvlens_at", [0, 2], ids=["kvlens-first-sliding",
                                                   "engine-first-sliding"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_mixed_engine_and_uncompressed_kvlens_layers_equal_reference(arch, kvlens_at):
    """Engine q8_0/q4_0 layers beside float16 kvlens layers (Gemma3: one sliding layer of each
    kind, either one first) equal the plain reference in which the kvlens layers are f16/f16
    engine layers."""
    model = _model(arch, 64)
    eng = LayerKV(key_format="q8_0", value_format="q4_0")
    config = _mixed(eng, {1: FP16, kvlens_at: FP16})
    as_engine = _mixed(eng, {1: ENGINE_F16, kvlens_at: ENGINE_F16})
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    ref = _reference_logits(model, ids, as_engine, SCHEDULE)
    got, cache = _engine_logits(model, ids, config, SCHEDULE)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    if arch == "gemma3":  # both sliding layers dropped what their window hides
        assert cache.layers[0].cumulative_length == 40
        held = [cache.layers[i].held_tokens if i != kvlens_at else cache.layers[i].n_res
                for i in (0, 2)]
        assert held == [7, 7]


@pytest.mark.parametrize("engine_at", [0, 2], ids=["engine-first-sliding",
                                                   "kvlens-first-sliding"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_quantized_kvlens_layers_beside_an_engine_layer_equal_all_kvlens(arch, engine_at):
    """4-bit kvlens layers (packed store, evicted blocks on Gemma3's sliding layers) give the
    same logits whether the remaining layer is a float16 kvlens layer or the f16/f16 engine
    layer that reads back the same values: the packed read path gets the same mask. The mixed
    cache holds what kvlens.cache.layout predicts."""
    model = _model(arch, 64)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    config = _mixed(QUANT, {engine_at: ENGINE_F16})
    mixed, cache = _engine_logits(model, ids, config, SCHEDULE)
    kvlens, _ = _engine_logits(model, ids, _mixed(QUANT, {engine_at: FP16}), SCHEDULE)
    torch.testing.assert_close(mixed, kvlens, atol=2e-5, rtol=1e-5)
    rep = memory_report(cache)
    assert rep["unaccounted"] == 0
    assert rep["breakdown"] == config_part_bytes(config, shape_of(model), 40, 1)
    with torch.no_grad():
        exact = model(ids).logits
    assert (mixed - exact).abs().max() > 1e-3  # the 4-bit layers did quantize
    if arch == "gemma3":
        assert cache.layers[2 - engine_at].q_start > 0  # and evicted packed blocks


def test_mixed_config_with_engine_attention_on_gemma3():
    """llama.cpp's arithmetic on the f16/f16 engine layers (tiled prefill: float32, the model's
    own arithmetic) beside kvlens layers equals the all-kvlens config in the prefill; decode
    steps (one query: fp16 V accumulation) stay close."""
    model = _model("gemma3", 64)
    ids = torch.randint(3, 128, (1, 131), generator=torch.Generator().manual_seed(8))
    schedule = (64, 64, 1, 1, 1)
    mixed, _ = _engine_logits(model, ids, _mixed(QUANT, {0: ENGINE_F16},
                                                 engine_attention="llamacpp-cpu-fa"), schedule)
    kvlens, _ = _engine_logits(model, ids, _mixed(QUANT, {0: FP16}), schedule)
    torch.testing.assert_close(mixed[:, :128], kvlens[:, :128], atol=2e-5, rtol=1e-5)
    assert (mixed[:, 128:] - kvlens[:, 128:]).abs().max() > 1e-6  # llama.cpp's decode path ran
    torch.testing.assert_close(mixed[:, 128:], kvlens[:, 128:], atol=5e-3, rtol=1e-3)


@pytest.mark.parametrize("which", ["inner", "outer"])
def test_mixed_config_in_nested_sessions(which):
    """Sessions nest (``kvlens.evaluation.kld.score_text`` opens one per config): a mixed
    config's cache gives the same logits whichever session built it, each layer's mask trimmed
    once."""
    model = _model("gemma3", 64)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(9))
    config = _mixed(QUANT, {0: LayerKV(key_format="q8_0", value_format="q4_0")})
    alone, _ = _engine_logits(model, ids, config, SCHEDULE)
    other = _engine("q4_0", "q4_0")
    with compressed_attention(model, config if which == "outer" else other) as outer, \
            compressed_attention(model, config if which == "inner" else other) as inner, \
            torch.no_grad():
        cache = (inner if which == "inner" else outer).new_cache()
        kw = {cache_argument_name(model): cache}
        nested = torch.cat([model(ids[:, a:b], use_cache=True, **kw).logits
                            for a, b in _spans(ids.shape[1], SCHEDULE)], 1)
    torch.testing.assert_close(nested, alone, atol=0, rtol=0)
