"""Centred keys in the compressed cache (``LayerKV.center_keys``): the packed store holds
``quant(k - mu)``, the read adds ``mu`` back, so attention over exact window keys and centred
packed keys equals "dequantize, add the mean, attend" (post-RoPE plain, rotated and balanced
keys on a lone layer; pre-RoPE keys through a tiny Llama), and centring really shrinks the error
where keys carry a per-channel offset."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session
from tiny_models import tiny_model

from kvlens.cache import compressed_attention
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.cache.triton_glue import kernel_layout_problem
from kvlens.config import KVConfig, LayerKV, MikvSettings
from kvlens.errors import ConfigError
from kvlens.model.hooks import cache_argument_name
from kvlens.quant import QuantSpec, hadamard_rotation

B, HQ, HKV, D = 2, 6, 2, 32
KSPEC, VSPEC = QuantSpec(2, "per-token", 16), QuantSpec(4, "per-token", 16)
F = 16  # flush block


def _keys(total: int, offset: float, gen) -> torch.Tensor:
    """Keys with a large per-(head, channel) offset, the case centring is for."""
    return torch.randn(B, HKV, total, D, generator=gen) + \
        offset * torch.randn(HKV, D, generator=gen)[None, :, None]


def _filled(variant: str, k, v, mu, center: bool = True) -> CompressedLayer:
    rot = hadamard_rotation(D) if variant == "rotated" else None
    bal = torch.rand(HKV, D, generator=torch.Generator().manual_seed(1)) + 0.5 \
        if variant == "balanced" else None
    setting = LayerKV(KSPEC, VSPEC, residual_tokens=32, flush_tokens=F,
                      rotate_keys=rot is not None, center_keys=center)
    layer = CompressedLayer(setting, 0, D, mikv=MikvSettings(0.0, 0, "fixed") if bal is not None
                            else None, balancer=bal, rotation=rot, session=stub_session(),
                            key_mean=mu if center else None)
    layer.update(k[:, :, :41], v[:, :, :41])
    layer.commit(torch.randn(B, HQ, 41, D), None)
    for t in range(41, k.shape[2]):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(B, HQ, 1, D), None)
    return layer


@pytest.mark.parametrize("variant", ["plain", "rotated", "balanced"])
def test_centred_post_rope_keys_equal_reference(variant):
    """Decode, batch 2 with row 1 left-padded, GQA 6/2, several chunks, window partly full."""
    gen = torch.Generator().manual_seed(7)
    total = 77
    k, v = _keys(total, 4.0, gen), torch.randn(B, HKV, total, D, generator=gen)
    mu = k.mean(dim=(0, 2)).half()
    layer = _filled(variant, k, v, mu)
    n_q = layer.quantized_length
    assert n_q >= 32 and layer.n_res > 0 and layer.key_mean.dtype == torch.float16
    # what the cache holds, in its stored basis: window fp16(k R), packed quant((k R - mu R) b)
    rot = layer.rotation if variant == "rotated" else torch.eye(D)
    window = (k @ rot).half().float()
    mu_s = mu.float() @ rot
    bal = layer.balancer if variant == "balanced" else torch.ones(HKV, D)
    centred = (window - mu_s[None, :, None]) * bal[:, None]
    keys = stored_view(centred, KSPEC, F, n_q, torch.float32)
    keys[:, :, :n_q] = keys[:, :, :n_q] / bal[:, None] + mu_s[None, :, None]
    keys[:, :, n_q:] = window[:, :, n_q:]
    values = stored_view(v, VSPEC, F, n_q)
    mask = torch.ones(B, 1, 1, total, dtype=torch.bool)
    mask[1, ..., :9] = False
    q = torch.randn(B, HQ, 1, D, generator=gen)
    out, _ = packed_attention(q @ rot, layer, mask, D ** -0.5, chunk_tokens=32)
    # scores reach ~20 (keys offset 4x their spread), so float32 rounding of the rotation and
    # the dots, which differs between CPUs' BLAS kernels, moves outputs by ~1e-5; a read that
    # dropped or misplaced the mean would be off by orders of magnitude more
    torch.testing.assert_close(out, reference_attention(q @ rot, keys, values, mask),
                               rtol=1e-4, atol=5e-5)


def test_centring_shrinks_the_attention_error_of_offset_keys():
    """Planted: keys with a per-channel offset 4x their spread. 2-bit per-token codes of the raw
    keys spend their range on the offset; centred, the same codes cost one mean per head and
    the attention output is much closer to exact."""
    gen = torch.Generator().manual_seed(11)
    total = 141
    k, v = _keys(total, 4.0, gen), torch.randn(B, HKV, total, D, generator=gen)
    mu = k.mean(dim=(0, 2)).half()
    q = torch.randn(B, HQ, 1, D, generator=gen) * 3
    mask = torch.ones(B, 1, 1, total, dtype=torch.bool)
    exact = reference_attention(q, k, v, mask)
    err = {}
    for center in (False, True):
        layer = _filled("plain", k, v, mu, center)
        out, _ = packed_attention(q, layer, mask, D ** -0.5)
        err[center] = float((out - exact).norm() / exact.norm())
    assert err[True] < 0.6 * err[False], err


def test_centred_pre_rope_keys_equal_reference():
    """Pre-RoPE centred keys through a tiny Llama (batch 2, left-padded): the pre-RoPE mean is
    added to each dequantized key before RoPE; the window holds the post-RoPE keys exact."""
    from kvlens.rope import apply_rope

    model = tiny_model("llama")
    mu = torch.randn(3, HKV, 16, generator=torch.Generator().manual_seed(2)).half()
    spec = QuantSpec(2, "per-token", 8)
    cfg = KVConfig("c", LayerKV(spec, QuantSpec(2, "per-channel", 8), residual_tokens=16,
                                pre_rope_keys=True, center_keys=True),
                   key_means={i: tuple(map(tuple, mu[i].tolist())) for i in range(3)})
    ids = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        model(ids, attention_mask=mask, **{cache_argument_name(model): cache})
    layer = cache.layers[1]
    assert layer.stores_pre_rope and layer.quantized_length == 32
    assert torch.equal(layer.key_mean, mu[1])
    assert layer.key_score_shift(torch.randn(2, HKV, 1, 16)) is None  # added before RoPE
    n_q, d = layer.quantized_length, layer.head_dim
    cos, sin = layer.rope_tables(layer.q_start, layer.q_end)
    pre = layer.kstore.dequantize_range(0, n_q) + mu[1].float()[None, :, None]
    keys = torch.cat((apply_rope(pre, cos, sin, layer.rope.layout), layer.res_k.view().float()), 2)
    values = torch.cat((layer.vstore.dequantize_range(0, n_q), layer.res_v.view().float()), 2)
    q = torch.randn(2, model.config.num_attention_heads, 1, d)
    m = torch.ones(2, 1, 1, 45, dtype=torch.bool)
    m[1, ..., :5] = False
    out, _ = packed_attention(q, layer, m, d ** -0.5, chunk_tokens=16)
    torch.testing.assert_close(out, reference_attention(q, keys, values, m), rtol=1e-5,
                               atol=1e-5)


def test_centred_layer_needs_its_mean_and_the_kernel_reads_post_rope_ones():
    setting = LayerKV(KSPEC, VSPEC, 32, center_keys=True)
    with pytest.raises(ConfigError, match="centres its keys but no mean key was given"):
        CompressedLayer(setting, 0, D, session=stub_session())
    assert kernel_layout_problem(setting, D) is None
    pre = LayerKV(KSPEC, VSPEC, 32, pre_rope_keys=True, center_keys=True)
    assert "pre-RoPE keys" in kernel_layout_problem(pre, D)


@pytest.mark.parametrize("variant", ["plain", "rotated", "balanced"])
def test_triton_kernel_reads_centred_keys_like_the_torch_path(variant):
    """The fused decode kernel (Triton interpreter on CPU) over a centred layer equals the
    torch read path, masks included."""
    pytest.importorskip("triton")
    from kvlens.cache.triton_glue import triton_decode, triton_unsupported

    gen = torch.Generator().manual_seed(5)
    total = 77
    k, v = _keys(total, 4.0, gen), torch.randn(B, HKV, total, D, generator=gen)
    layer = _filled(variant, k, v, k.mean(dim=(0, 2)).half())
    q = torch.randn(B, HQ, 1, D, generator=gen)
    q = layer.to_stored_basis(q, layer.setting.rotate_keys)
    assert triton_unsupported(layer, q, with_probs=False) is None
    mask = torch.ones(B, 1, 1, total, dtype=torch.bool)
    mask[1, ..., :9] = False
    for m in (mask, None):
        ref, _ = packed_attention(q, layer, m, D ** -0.5)
        out, why = triton_decode(q, layer, m, D ** -0.5)
        assert why is None
        torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_triton_backend_generates_the_same_tokens_as_torch_with_centred_keys():
    """A tiny Llama with centred per-token keys (one layer rotated): greedy tokens through the
    kernel (interpreter) equal the torch path's; only the prefill takes the torch path."""
    pytest.importorskip("triton")
    model = tiny_model("llama")
    tok = QuantSpec(2, "per-token", 16)
    mean = tuple(tuple(0.3 * ((c % 5) - 2) for c in range(16)) for _ in range(HKV))
    cfg = KVConfig("c", LayerKV(tok, tok, 32, center_keys=True),
                   {1: LayerKV(tok, tok, 32, rotate_keys=True, center_keys=True)},
                   key_means={i: mean for i in range(3)})
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    out = {}
    for backend in ("torch", "triton"):
        with compressed_attention(model, cfg, backend=backend) as session:
            cache = session.new_cache()
            out[backend] = model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=8, do_sample=False, pad_token_id=0,
                                          **{cache_argument_name(model): cache})
        assert cache.layers[0].quantized_length >= 16
    assert torch.equal(out["triton"], out["torch"])
    assert session.backend == "triton"
    assert sum(session.torch_path_calls.values()) == 3  # only the prefill
