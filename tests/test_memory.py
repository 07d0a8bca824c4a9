"""Memory truth: the cache holds what ``memory_report`` says, and the budget formula
(``kvlens.cache.layout``) is what the cache allocates.

Held bytes are found by walking the cache object (``helpers.held_bytes``: every tensor storage
reachable from the layers, counted once, whole storages); the per-part breakdown comes from the
layers' own named tensors; the formula predicts both from the config and the token count alone. They
must agree exactly: nothing here is rounded. (Python object headers, a few hundred bytes per
tensor, are not counted by either side.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import held_bytes, small_options
from tiny_models import tiny_model

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layout import (
    config_bits,
    config_device_bytes,
    config_part_bytes,
    shape_of,
)
from kvlens.config import (
    PRESETS,
    KVConfig,
    LayerKV,
    ProtectSettings,
    config_from_dict,
)
from kvlens.deploy import engine_config
from kvlens.errors import ConfigError
from kvlens.model.hooks import cache_argument_name
from kvlens.model.shape import ModelShape
from kvlens.quant import CodebookSpec, QuantSpec, RotationSpec
from kvlens.research.sets import mikv_settings

R = 16  # residual window of the scaled-down presets (tiny head_dim 16, groups of 8)


def _model(arch: str = "llama"):
    return tiny_model(arch, max_positions=8192)


def _scaled(cfg: KVConfig, residual: int = R) -> KVConfig:
    """A preset with group sizes that fit head_dim 16 and a window of ``residual`` tokens."""
    d = cfg.default
    if not d.compressed:
        return cfg
    return replace(cfg, default=replace(
        d, residual_tokens=residual, flush_tokens=min(d.flush_tokens, residual // 2),
        key=replace(d.key, group_size=8), value=replace(d.value, group_size=8)))


def _mixed() -> KVConfig:
    """A per-layer config like `recommend` writes: fixed balancer, pre-RoPE keys, 3-bit codes,
    per-channel values, sinks, a sliding block."""
    s = QuantSpec
    default = LayerKV(s(2, "per-channel", 8), s(2, "per-token", 8), R, flush_tokens=8)
    layers = {1: LayerKV(s(3, "per-token", 8), s(4, "per-channel", 16), R),
              2: LayerKV(s(3, "per-channel", 8), s(3, "per-token", 16), R, pre_rope_keys=True,
                         flush_tokens=8)}
    return KVConfig("mixed", default, layers, protect=ProtectSettings(4, "fixed"),
                    balancers={1: ((1.5,) * 16, (0.5,) * 16)})


def _codebook_keys() -> KVConfig:
    """Codebook keys: vLLM turboquant's layout (Lloyd-Max keys renormalised, 4-bit per-token
    values, no window) by default; layer 1 2-bit Lloyd-Max-normal keys beside per-channel values
    with a window and a sliding block; layer 2 kept exact at fp_dtype (turboquant's boundary
    layers)."""
    s = QuantSpec
    rot = RotationSpec(3)
    default = LayerKV(CodebookSpec(3, rotation=rot, renormalize=True), s(4, "per-token"))
    layers = {1: LayerKV(CodebookSpec(2, "lloyd-max-normal", rot), s(3, "per-channel", 8), R,
                         flush_tokens=8),
              2: LayerKV()}
    return KVConfig("codebook-keys", default, layers, rotation_seed=3)


CONFIGS = {name: _scaled(cfg) for name, cfg in PRESETS.items()} | {
    "mixed": _mixed(), "mixed-8bit": replace(_mixed(), name="mixed-8bit", scale_dtype="8bit"),
    "codebook-keys": _codebook_keys(),
    "vllm-turboquant": engine_config("vllm:turboquant_k3v4_nc", num_layers=3).config,
    "vllm-turboquant-4bit": engine_config("vllm:turboquant_4bit_nc", num_layers=3).config}


def _shape(model) -> ModelShape:
    shape = shape_of(model)
    assert shape.dtype_bytes == 4  # float32 tiny models
    return shape


def _prefill_then_decode(model, cache, ids, prefill):
    """One forward over ``ids[:, :prefill]``, then the rest one token at a time."""
    kw = {cache_argument_name(model): cache}
    model(ids[:, :prefill], use_cache=True, **kw)
    for t in range(prefill, ids.shape[1]):
        model(ids[:, t:t + 1], use_cache=True, **kw)


def _check(cache, config, shape, tokens, batch=1):
    rep = memory_report(cache)
    predicted = config_part_bytes(config, shape, tokens, batch)
    assert rep["unaccounted"] == 0
    assert rep["kv_bytes"] == held_bytes(cache) == sum(rep["breakdown"].values())
    assert rep["breakdown"] == predicted, (tokens, rep["breakdown"], predicted)
    assert rep["kv_bytes_fp16"] == shape.fp16_bytes(tokens, batch)
    assert rep["bits_per_element"] == pytest.approx(config_bits(config, shape, tokens, batch))
    # per device (one here: the CPU) the held bytes sum to the total, as the layout predicts
    assert rep["by_device"] == {"cpu": rep["kv_bytes"]}
    assert config_device_bytes(config, shape, tokens, batch) == {"all": rep["kv_bytes"]}
    return rep


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_held_bytes_equal_report_and_formula_while_decoding(arch, name):
    """Prompts of 1, 31 and 1000 tokens, then decode: after 0, 1, R+1 and 3R steps the bytes
    the cache holds are exactly what memory_report reports and what the formula predicts."""
    model = _model(arch)
    config = CONFIGS[name]
    shape = _shape(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), compressed_attention(model, config) as session:
        for prompt in (1, 31, 1000):
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            ids = torch.randint(3, 128, (1, prompt + 3 * R), generator=gen)
            model(ids[:, :prompt], use_cache=True, **kw)
            _check(cache, config, shape, prompt)
            for step in range(1, 3 * R + 1):
                model(ids[:, prompt + step - 1:prompt + step], use_cache=True, **kw)
                if step in (1, R + 1, 3 * R):
                    _check(cache, config, shape, prompt + step)


@pytest.mark.slow  # every config filled to 4096 tokens; shorter contexts are checked above
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formula_bits_equal_held_bits_at_long_contexts(name):
    """Caches filled to 256, 1024 and 4096 tokens (real window of 32, chunked prefill) hold
    exactly the formula's bits; a left-padded batch of 2 too."""
    model = _model("gemma3")  # sliding (window 8) and global layers
    config = _scaled(CONFIGS[name], 32) if not name.startswith(
        ("mixed", "codebook", "vllm")) \
        else CONFIGS[name]
    shape = _shape(model)
    ids = torch.randint(3, 128, (2, 4096), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), compressed_attention(model, config) as session:
        for tokens in (256, 1024, 4096):
            cache = session.new_cache()
            kw = {cache_argument_name(model): cache}
            mask = torch.ones(2, tokens, dtype=torch.long)
            mask[1, :5] = 0
            for c0 in range(0, tokens, 1024):
                model(ids[:, c0:c0 + 1024][:, :tokens - c0], attention_mask=mask[:, :c0 + 1024],
                      use_cache=True, **kw)
            _check(cache, config, shape, tokens, batch=2)


def test_nothing_is_kept_twice_after_a_long_prompt():
    """The issue's reproduction: window 32, 1000-token prefill, 10 decode steps. Full-precision
    K/V exist only for the window: no stale copy of the prompt."""
    model = _model()
    cfg = _scaled(PRESETS["kivi-2"], 32)
    with torch.no_grad(), compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        ids = torch.randint(3, 128, (1, 1010), generator=torch.Generator().manual_seed(3))
        _prefill_then_decode(model, cache, ids, 1000)
    for layer in cache.layers:
        assert layer.res_k.buf.shape[2] == 32 and layer.n_res < 32
        assert layer.quantized_length + layer.n_res == 1010
    rep = memory_report(cache)
    # 2-bit codes + fp16 scales/zeros per group of 8 (6 bits) on 992 tokens, the 32-token window
    assert rep["bits_per_element"] == pytest.approx((6 * 992 + 16 * 32) / 1010)
    assert rep["bits_per_element"] < 7


def test_walk_finds_a_tensor_no_part_declares():
    """The walk is independent of the layers' own bookkeeping: a stray tensor shows up."""
    model = _model()
    with torch.no_grad(), compressed_attention(model, _scaled(PRESETS["kivi-2"])) as session:
        cache = session.new_cache()
        model(torch.randint(3, 128, (1, 40)), use_cache=True,
              **{cache_argument_name(model): cache})
    cache.layers[0].stale_copy = [torch.zeros(1000)]
    rep = memory_report(cache)
    assert rep["unaccounted"] == 4000


def test_sliding_layers_hold_only_their_window():
    """Gemma3-style layers with a window of 8 keep O(window) bytes however long the text; the
    global layer grows. Compression off: exactly the last W-1 tokens, like transformers."""
    model = _model("gemma3")
    for cfg in (PRESETS["exact"], _scaled(PRESETS["kivi-2"])):
        with torch.no_grad(), compressed_attention(model, cfg) as session:
            cache = session.new_cache()
            ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(4))
            _prefill_then_decode(model, cache, ids, 200)
        sliding, full = cache.layers[0], cache.layers[1]
        assert sliding.sliding_window == 8 and full.sliding_window is None
        if not cfg.compressed:
            assert sliding.n_res == 7 and sliding.res_start == 293
            assert full.n_res == 300
        else:  # whole blocks of 16 older than position 293 are gone
            assert sliding.q_start == 288 and full.q_start == 0
            assert sliding.quantized_length < 32


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_sliding_eviction_and_fp16_window_keep_generation_close(arch):
    """Evicting what the sliding mask hides changes nothing: `exact` generates the same tokens
    as DynamicCache (also on sliding-window models), and the fp16 preset stays close."""
    model = _model(arch)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    for name in ("exact", "fp16"):
        with torch.no_grad(), compressed_attention(model, PRESETS[name]) as session:
            cache = session.new_cache()
            out = model.generate(ids, max_new_tokens=30, do_sample=False,
                                 **{cache_argument_name(model): cache})
        if name == "exact":
            assert torch.equal(out, ref)
        else:
            assert (out[0, 40:] == ref[0, 40:]).float().mean() >= 0.8


def test_fp_dtype_float32_and_bfloat16_are_stored_and_counted():
    model = _model()
    shape = _shape(model)
    for fp, size in (("float32", 4), ("bfloat16", 2), ("exact", 4)):
        cfg = replace(_scaled(PRESETS["kivi-2"]), fp_dtype=fp)
        with torch.no_grad(), compressed_attention(model, cfg) as session:
            cache = session.new_cache()
            model(torch.randint(3, 128, (1, 50)), use_cache=True,
                  **{cache_argument_name(model): cache})
        assert cache.layers[0].res_k.buf.element_size() == size
        _check(cache, cfg, shape, 50)


@pytest.mark.parametrize("name", ["kivi-2-sinks", "mikv-4", "mikv-2-int4"])
def test_fp_dtype_float8_halves_the_window_and_sets(name):
    # windows and sink/heavy-hitter sets at one byte (an integer set keeps its codes), as
    # priced; logits stay close to the same config with float16 parts
    model = _model()
    shape = _shape(model)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    out, held = {}, {}
    for fp in ("float16", "float8_e4m3fn"):
        cfg = replace(_scaled(PRESETS[name]), fp_dtype=fp)
        with torch.no_grad(), compressed_attention(model, cfg) as session:
            cache = session.new_cache()
            _prefill_then_decode(model, cache, ids[:, :89], 60)
            out[fp] = model(ids[:, 89:90], **{cache_argument_name(model): cache}).logits[0, -1]
        assert cache.layers[0].res_k.buf.dtype == getattr(torch, fp)
        held[fp] = _check(cache, cfg, shape, 90)["kv_bytes"]
    assert held["float8_e4m3fn"] < held["float16"]
    rel = (out["float8_e4m3fn"] - out["float16"]).norm() / out["float16"].norm()
    assert rel < 0.05
    cfg = replace(_scaled(PRESETS[name]), fp_dtype="float8_e4m3fn")
    assert config_from_dict(cfg.to_dict()) == cfg


def test_config_fields_are_honoured_or_refused():
    # balancers without a balancer mode that reads them
    doc = KVConfig("x", LayerKV(QuantSpec(2, "per-token", 8), QuantSpec(2, "per-token", 8), R),
                   protect=ProtectSettings(4, "fixed"), balancers={0: ((1.0,) * 16,) * 2}
                   ).to_dict()
    for mode in ("off", "online"):
        bad = {**doc, "protect": {**doc["protect"], "balancer": mode}}
        with pytest.raises(ConfigError, match="'balancers'.*allowed: off, online, fixed"):
            config_from_dict(bad)
    with pytest.raises(ConfigError, match="no 'protect' section"):
        config_from_dict({**doc, "protect": None})
    with pytest.raises(ConfigError, match="fp_dtype 'half'; allowed: float16, bfloat16"):
        config_from_dict({**doc, "fp_dtype": "half"})


def test_online_balancer_uses_its_exponent():
    model = _model()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    bals = {}
    for e in (0.5, 1.0):
        cfg = replace(_scaled(PRESETS["mikv-2"]),
                      protect=mikv_settings(0.2, 4, "online", balancer_exponent=e))
        with torch.no_grad(), compressed_attention(model, cfg) as session:
            cache = session.new_cache()
            model(ids, use_cache=True, **{cache_argument_name(model): cache})
        bals[e] = cache.layers[0].balancer
    # b = ratio ** e: the exponent-1 balancer is the square of the exponent-0.5 one
    torch.testing.assert_close(bals[1.0], bals[0.5] ** 2, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(bals[1.0], bals[0.5])


def test_live_cache_stores_what_a_recommend_config_names(tmp_path):
    """A config written by `recommend` (JSON round trip): layer by layer, the live cache
    stores exactly the specs, window, flush block, pre-RoPE and balancer it names."""
    from kvlens.capture.run import capture_model
    from kvlens.config import load_config, save_config
    from kvlens.recommend import recommend

    model = _model()
    cap = tmp_path / "tiny.h5"
    capture_model(model, torch.randint(0, 128, (1, 64), generator=torch.Generator()
                                       .manual_seed(0)), cap)
    rec = recommend(cap, small_options(budget_bits=6.0, context=512, group_sizes=(8, 16),
                                          residual_tokens=16, flush_tokens=8, bits=(2, 3, 4)))
    save_config(rec.config, tmp_path / "cfg.json")
    cfg = load_config(tmp_path / "cfg.json")
    with torch.no_grad(), compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        model(torch.randint(3, 128, (1, 100)), use_cache=True,
              **{cache_argument_name(model): cache})
    for idx, layer in enumerate(cache.layers):
        want = cfg.layer(idx)
        assert layer.setting == want
        assert layer.kstore.spec == want.key and layer.vstore.spec == want.value
        assert layer.flush_every == (want.flush_tokens or want.residual_tokens)
        assert layer.stores_pre_rope == want.pre_rope_keys
        if idx in cfg.balancers:
            torch.testing.assert_close(layer.balancer, torch.tensor(cfg.balancers[idx]))
        else:
            assert layer.balancer is None
    _check(cache, cfg, _shape(model), 100)
    assert memory_report(cache)["bits_per_element"] == pytest.approx(
        config_bits(cfg, _shape(model), 100))
