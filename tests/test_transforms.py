"""Transforms with planted structure: RoPE tables, balancer, outliers."""


import pytest
import torch
from helpers import rand, rel

from kvlens.errors import ConfigError
from kvlens.quant import (
    QuantSpec,
    apply_balancer,
    fake_quantize,
    fit_balancer,
    outlier_count,
    quantize_pre_rope,
    quantize_with_outliers,
    rope_tables_for,
    split_outliers,
)
from kvlens.rope import apply_rope

# -- RoPE ------------------------------------------------------------------------------------


def _rotate_by_hand(x, positions, theta, layout):
    """Rotate each channel pair by position * theta^(-2i/D), written out pair by pair."""
    out = x.double().clone()
    d = x.shape[-1]
    for i in range(d // 2):
        a, b = (i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1)
        angle = positions.double() * theta ** (-2 * i / d)
        c, s = angle.cos(), angle.sin()
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out.float()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_tables_reproduce_planted_post(layout):
    k_pre = rand(2, 3, 12, 16)
    positions = torch.arange(12)
    planted_post = _rotate_by_hand(k_pre, positions, 500.0, layout)
    cos, sin = rope_tables_for(positions, 16, theta=500.0, layout=layout)
    assert cos.shape == (1, 12, 16)
    half = torch.equal(cos[..., :8], cos[..., 8:])  # the halves repeat: rotate-half tables
    assert half == (layout == "half") and (half or torch.equal(cos[..., 0::2], cos[..., 1::2]))
    assert torch.allclose(apply_rope(k_pre, cos, sin, layout), planted_post, atol=1e-5)


def test_rope_tables_match_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=10000.0)
    positions = torch.arange(300).unsqueeze(0)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables_for(positions, 32, theta=10000.0)
    assert torch.allclose(cos, hf_cos, atol=1e-6) and torch.allclose(sin, hf_sin, atol=1e-6)


def test_partial_rotary_and_bad_rotary_dim():
    cos, _ = rope_tables_for(torch.arange(4), 16, rotary_dim=8)
    assert cos.shape == (1, 4, 8)
    with pytest.raises(ConfigError, match="even number"):
        rope_tables_for(torch.arange(4), 16, rotary_dim=7)
    with pytest.raises(ConfigError, match="half, interleaved"):
        rope_tables_for(torch.arange(4), 16, layout="neox")


def test_pre_rope_quantization_keeps_outlier_channel_isolated():
    # Outlier in pre-RoPE channel 3; RoPE mixes it into partner channel 11 with a
    # token-dependent angle, so per-channel groups after RoPE see a smeared range.
    k_pre = rand(1, 2, 256, 16, seed=5)
    k_pre[..., 3] += 30.0
    positions = torch.arange(256)
    cos, sin = rope_tables_for(positions, 16, theta=10.0)
    k_post = apply_rope(k_pre, cos, sin)
    spec = QuantSpec(2, "per-channel", 32)
    pre = rel(k_post, quantize_pre_rope(k_pre, cos, sin, spec))
    post = rel(k_post, fake_quantize(k_post, spec))
    assert pre < post / 2
    exactish = quantize_pre_rope(k_pre, cos, sin, QuantSpec(8, "per-channel", 32))
    assert rel(k_post, exactish) < 0.01


# -- MiKV balancer ---------------------------------------------------------------------------


def test_balancer_recovers_planted_ratio_and_keeps_dot_products():
    k = rand(2, 2, 20, 8, seed=6)
    q = rand(2, 4, 20, 8, seed=7)
    k_max = k.abs().amax(dim=(0, 2))
    # Plant: over each KV head's two query heads, max|q| = 9 * max|k| in every channel.
    q = q / q.abs().amax(dim=(0, 2), keepdim=True)
    q = q * (9 * k_max.repeat_interleave(2, dim=0))[None, :, None, :]
    b = fit_balancer(q, k)
    assert b.shape == (2, 8)
    assert torch.allclose(b, torch.full_like(b, 3.0), rtol=1e-5)
    qb, kb = apply_balancer(q, k, b)
    ref = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    out = qb @ kb.repeat_interleave(2, dim=1).transpose(-1, -2)
    assert torch.allclose(ref, out, rtol=1e-5, atol=1e-5)


def test_balancer_gqa_takes_max_over_the_group_and_guards_zero():
    k = torch.ones(1, 2, 3, 2)
    q = torch.zeros(1, 4, 3, 2)
    q[0, 0, 1, 0] = 4.0  # KV head 0 <- query heads 0, 1
    q[0, 1, 2, 0] = 16.0
    q[0, 3, 0, 1] = 9.0  # KV head 1 <- query heads 2, 3
    k[0, 1, :, 0] = 0.0  # a dead key channel
    b = fit_balancer(q, k, per_sample=True)
    assert b.shape == (1, 2, 2)
    # head 0: channel 0 -> sqrt(16/1); channel 1 has max|q| = 0 -> 1.
    # head 1: channel 0 has max|k| = 0 -> 1; channel 1 -> sqrt(9/1).
    assert b[0].tolist() == [[4.0, 1.0], [1.0, 3.0]]
    assert torch.isfinite(apply_balancer(q, k, b)[0]).all()


def test_balancer_helps_per_token_quantization_of_outlier_keys():
    k = rand(1, 1, 128, 32, seed=8)
    k[..., 4] *= 25.0
    q = rand(1, 2, 128, 32, seed=9)
    qb, kb = apply_balancer(q, k, fit_balancer(q, k))
    spec = QuantSpec(2, "per-token")
    ref = q @ k.transpose(-1, -2)
    plain = q @ fake_quantize(k, spec).transpose(-1, -2)
    balanced = qb @ fake_quantize(kb, spec).transpose(-1, -2)
    assert rel(ref, balanced) < rel(ref, plain)


# -- outliers --------------------------------------------------------------------------------


def test_planted_outliers_found_exactly():
    x = rand(2, 2, 10, 200, seed=10)
    x.clamp_(-3, 3)
    g = torch.Generator().manual_seed(11)
    planted = torch.stack([torch.randperm(200, generator=g)[:2] for _ in range(40)])
    planted = planted.view(2, 2, 10, 2).sort(dim=-1).values
    x.scatter_(-1, planted, 50.0 + torch.rand(2, 2, 10, 2, generator=g))
    dense, outliers = split_outliers(x, 0.01, dim=-1)
    assert torch.equal(outliers.indices, planted)
    assert torch.equal(outliers.values, x.gather(-1, planted))
    assert float(dense.abs().max()) <= 3.0
    assert torch.equal(outliers.scatter_into(dense), x)
    assert torch.equal(dense + outliers.scatter_into(torch.zeros_like(x)), x)


def test_outlier_count_and_token_scope():
    assert outlier_count(64, 0.01) == 1 and outlier_count(100, 0.07) == 7
    assert outlier_count(64, 0.0) == 0
    with pytest.raises(ConfigError, match="0 <= fraction < 1"):
        outlier_count(64, 1.5)
    x = rand(1, 1, 100, 4, seed=12)
    x[0, 0, 17, 2] = 99.0
    _, outliers = split_outliers(x, 0.01, dim=-2)
    assert outliers.indices.shape == (1, 1, 1, 4) and int(outliers.indices[0, 0, 0, 2]) == 17


def test_quantize_with_outliers_beats_plain_and_keeps_outliers_exact():
    x = rand(1, 2, 32, 64, seed=13)
    x[0, 0, :, 7] = 30.0
    x[0, 1, 5, :3] = -40.0
    spec = QuantSpec(2, "per-token", 32)
    recon = quantize_with_outliers(x, spec, 0.05)
    assert rel(x, recon) < rel(x, fake_quantize(x, spec)) / 2
    assert torch.equal(recon[0, 0, :, 7], x[0, 0, :, 7])
    assert torch.equal(recon[0, 1, 5, :3], x[0, 1, 5, :3])
