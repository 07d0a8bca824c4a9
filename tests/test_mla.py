"""Multi-head latent attention (DeepSeek V2/V3) as engines cache it: one latent row per token
(the decoupled RoPE key, then the compressed latent), attended in the absorbed form
(``kvlens.model.mla``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import exact_cache_generates_like_the_model
from test_memory import _check, _prefill_then_decode
from tiny_models import TINY_VOCAB

from kvlens.cache import compressed_attention
from kvlens.cache.layout import shape_of
from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.config import LayerKV, preset
from kvlens.config.schema import KVConfig
from kvlens.model.architecture import describe
from kvlens.model.mla import absorbed_mla
from kvlens.quant import QuantSpec

ROPE, LATENT = 16, 48  # odd-ish widths: the row is 64 channels


def _deepseek(version: int, *, q_lora: int | None = None, interleave: bool = True,
              attn: str = "sdpa"):
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                  kv_lora_rank=LATENT, q_lora_rank=q_lora, qk_nope_head_dim=24,
                  qk_rope_head_dim=ROPE, v_head_dim=20, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_shared_experts=1, max_position_embeddings=1024)
    if version == 3:
        config = tf.DeepseekV3Config(**common, n_group=1, topk_group=1,
                                     rope_interleave=interleave)
    else:
        config = tf.DeepseekV2Config(**common)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


VARIANTS = [(2, None, True, "sdpa"), (3, None, True, "sdpa"), (3, 40, False, "eager"),
            (3, 40, True, "eager")]


@pytest.mark.parametrize("version,q_lora,interleave,attn", VARIANTS)
def test_absorbed_form_equals_the_model_and_is_undone(version, q_lora, interleave, attn):
    model = _deepseek(version, q_lora=q_lora, interleave=interleave, attn=attn)
    ids = torch.randint(3, TINY_VOCAB, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        with absorbed_mla(model) as patched:
            assert len(patched) == 2
            out = model(ids).logits
        again = model(ids).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(again, ref)  # the model's own forward is back
    assert all("forward" not in m.__dict__ for m in patched)


def test_describe_reads_the_latent_row():
    info = describe(_deepseek(3))
    assert info.mla is not None and info.num_key_value_heads == 1
    assert info.head_dim == ROPE + LATENT and info.num_attention_heads == 3


def test_capture_stores_the_latent_row_once_per_token(tmp_path):
    model = _deepseek(3)
    windows = torch.randint(3, TINY_VOCAB, (1, 33), generator=torch.Generator().manual_seed(2))
    capture_model(model, windows, tmp_path / "c.h5", storage_dtype="float32")
    with open_capture(tmp_path / "c.h5") as cap:
        assert cap.meta.shape.kv_shared and cap.meta.shape.num_key_value_heads == 1
        layer = cap.layer(0)
        k, v, q = layer.read("k"), layer.read("v"), layer.read("q")
        assert k.shape == (1, 1, 33, ROPE + LATENT) and q.shape == (1, 3, 33, ROPE + LATENT)
        assert torch.equal(k, v)
        # the latent part is the model's own kv_a_layernorm output, untouched by RoPE
        attn = model.model.layers[0].self_attn
        seen = []
        h = attn.kv_a_layernorm.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
        with torch.no_grad():
            model(windows)
        h.remove()
        torch.testing.assert_close(k[0, 0, :, ROPE:], seen[-1][0], atol=1e-6, rtol=1e-6)
        # k_pre differs from k only in the RoPE channels
        assert torch.equal(layer.read("k_pre")[..., ROPE:], k[..., ROPE:])


def test_exact_cache_generates_the_models_tokens():
    ids = torch.randint(3, TINY_VOCAB, (1, 21), generator=torch.Generator().manual_seed(3))
    assert exact_cache_generates_like_the_model(_deepseek(3), ids, 10)


SAME = QuantSpec(4, "per-token", 16)
CONFIGS = {
    # keys and values stored alike: one store and one window for the latent row
    "shared": KVConfig("shared", LayerKV(SAME, SAME, 32)),
    # stored differently (KIVI's per-channel keys): two stores
    "kivi-4": replace(preset("kivi-4"), default=replace(preset("kivi-4").default,
                                                          residual_tokens=32)),
    "engine-q8_0": KVConfig("q8", LayerKV(key_format="q8_0+norot", value_format="q8_0+norot")),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_held_bytes_of_the_latent_cache_equal_the_formula(name):
    """Held bytes equal the layout's prediction; an fp16 cache of an MLA model holds the latent
    row once (as engines do), and a layer storing keys and values alike holds it once too."""
    model = _deepseek(3)
    config = CONFIGS[name]
    shape = shape_of(model)
    assert shape.kv_shared and shape.kv_tensors == 1
    ids = torch.randint(3, TINY_VOCAB, (1, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), compressed_attention(model, config) as session:
        cache = session.new_cache()
        _prefill_then_decode(model, cache, ids, 60)
    rep = _check(cache, config, shape, 80)  # held bytes = report = formula, part by part
    assert rep["kv_bytes_fp16"] == 2 * 80 * (ROPE + LATENT) * 2  # 2 layers, one row each
    layer = cache.layers[0]
    assert (layer.kstore is layer.vstore) == (name != "kivi-4")
