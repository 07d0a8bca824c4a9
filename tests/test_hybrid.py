"""Hybrid models (only some layers hold a KV cache): Qwen3-Next's Gated DeltaNet layers beside
one full-attention layer, Falcon-H1's attention and Mamba mixer in every layer.

kvlens names layers by their model index, captures, quantizes and counts only the layers with a
KV cache, and leaves the other layers' fixed-size states exact (transformers' own cache layers),
reporting their bytes apart."""

from __future__ import annotations

import pytest
import torch
from helpers import exact_cache_generates_like_the_model
from test_memory import _check, _prefill_then_decode
from tiny_models import TINY_VOCAB

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layout import config_part_bytes, shape_of
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.config import LayerKV, preset
from kvlens.config.schema import KVConfig
from kvlens.errors import ConfigError, InputError
from kvlens.model.architecture import describe
from kvlens.model.hooks import cache_argument_name
from kvlens.quant import QuantSpec


def _qwen3_next(layers=("linear_attention", "linear_attention", "linear_attention",
                        "full_attention")):
    import transformers as tf

    config = tf.Qwen3NextConfig(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=192,
        num_hidden_layers=len(layers), num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        layer_types=list(layers), linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=1024)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _falcon_h1():
    import transformers as tf

    config = tf.FalconH1Config(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, mamba_n_heads=8,
        mamba_d_head=32, mamba_d_ssm=256, mamba_d_state=16, max_position_embeddings=1024)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _small(config: KVConfig) -> KVConfig:
    """``config`` with a 32-token window (quantized blocks appear within a short test)."""
    from dataclasses import replace

    return replace(config, default=replace(config.default, residual_tokens=32))


def test_layers_with_a_kv_cache_are_read_from_the_model():
    info = describe(_qwen3_next())
    assert info.num_layers == 4 and info.attention_layers == (3,) and info.is_hybrid
    assert info.layer_kinds == ("state", "state", "state", "full")
    assert info.state_layers == (0, 1, 2)
    falcon = describe(_falcon_h1())  # attention and a Mamba mixer in every layer
    assert falcon.attention_layers == (0, 1) and falcon.state_layers == (0, 1)
    assert not falcon.is_hybrid


@pytest.mark.parametrize("name", ["kivi-4", "per-token-4"])
def test_held_bytes_count_only_the_attention_layers(name):
    """The cache's K/V bytes are its one attention layer's, exactly the formula's; bits per
    element count that layer alone; the linear layers' states are reported apart and kept."""
    model = _qwen3_next()
    config = _small(preset(name))
    shape = shape_of(model)
    assert shape.attention_layers == (3,)
    ids = torch.randint(3, TINY_VOCAB, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        _prefill_then_decode(model, cache, ids, 70)
    rep = _check(cache, config, shape, 90)  # held bytes = report = formula, part by part
    # an fp16 cache of the one attention layer: K and V, 1 KV head, 90 tokens, 64 channels
    assert rep["kv_bytes_fp16"] == 2 * 1 * 90 * 64 * 2
    states = [layer for i, layer in enumerate(cache.layers) if i != 3]
    state = sum(t.untyped_storage().nbytes() for layer in states
                for d in (layer.conv_states, layer.recurrent_states) for t in d.values()
                if t is not None)
    assert rep["state_bytes"] == state > 0


def test_exact_cache_leaves_the_hybrid_model_unchanged():
    """With nothing quantized, greedy tokens equal transformers' own cache's: the linear
    layers' states are transformers' own, the attention layer reads exact K/V."""
    ids = torch.randint(3, TINY_VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    assert exact_cache_generates_like_the_model(_qwen3_next(), ids, 12)


def test_falcon_h1_layers_keep_their_mamba_state_beside_compressed_kv():
    model = _falcon_h1()
    config = _small(preset("kivi-4"))
    shape = shape_of(model)
    ids = torch.randint(3, TINY_VOCAB, (1, 60), generator=torch.Generator().manual_seed(3))
    assert exact_cache_generates_like_the_model(model, ids[:, :20], 8)
    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        model(ids, use_cache=True, **{cache_argument_name(model): cache})
    rep = memory_report(cache)
    assert rep["kv_bytes"] == sum(config_part_bytes(config, shape, 60).values())
    assert rep["unaccounted"] == 0 and rep["state_bytes"] > 0
    assert rep["breakdown"]["codes"] > 0  # the attention part really holds quantized codes


def test_a_config_naming_a_layer_without_kv_cache_is_refused():
    model = _qwen3_next()
    bits4 = LayerKV(QuantSpec(4, "per-token", 32), QuantSpec(4, "per-token", 32), 16)
    config = KVConfig("x", LayerKV(), layers={1: bits4})
    with pytest.raises(ConfigError, match=r"\[1\], which hold no KV cache.*cache: 3"):
        with compressed_attention(model, config):
            pass


def test_capture_takes_the_attention_layers_and_refuses_the_others(tmp_path):
    model = _qwen3_next()
    windows = torch.randint(3, TINY_VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    capture_model(model, windows, tmp_path / "c.h5", storage_dtype="float32")
    with open_capture(tmp_path / "c.h5") as cap:
        assert cap.meta.layers == (3,) and cap.meta.shape.attention_layers == (3,)
        assert cap.meta.shape.num_layers == 4
        assert cap.layer(3).read("k").shape == (1, 1, 40, 64)
    with pytest.raises(InputError, match="hold no KV cache.*layers with a KV cache: 3"):
        capture_model(model, windows, tmp_path / "d.h5", layers="0,3")
    assert not (tmp_path / "d.h5").exists()
