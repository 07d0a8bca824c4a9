"""Metrics and attention semantics checked against explicit loops, SDPA and transformers."""

import math

import pytest
import torch
from helpers import rand

from kvlens.analysis.attention import (
    attention_output,
    attention_scores,
    attention_weights,
    causal_mask,
    expand_kv,
    per_head_rel_error,
    rel_error,
)
from kvlens.analysis.metrics import Variant, attention_errors_many
from kvlens.errors import InputError


def _one(q, k, v, k_hat=None, v_hat=None, **kw):
    """The errors of one variant (keys and/or values replaced)."""
    return attention_errors_many(q, k, v, [Variant(k_hat, v_hat)], **kw)[0]


def _qkv(b=2, hq=6, hkv=2, t=11, d=8, seed=0):
    return (
        rand(b, hq, t, d, seed=seed),
        rand(b, hkv, t, d, seed=seed + 1),
        rand(b, hkv, t, d, seed=seed + 2),
    )


def test_rel_error_known_values():
    ref = torch.tensor([3.0, 4.0])
    assert rel_error(ref, torch.tensor([3.0, 3.0])) == pytest.approx(0.2)
    assert rel_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isinf(rel_error(torch.zeros(3), torch.ones(3)))
    x = rand(2, 3, 4, 5)
    y = x.clone()
    y[:, 1] *= 1.5
    assert per_head_rel_error(x, y).tolist() == pytest.approx([0.0, 0.5, 0.0])


def test_gqa_mapping_matches_explicit_loop():
    q, k, _ = _qkv()
    scores = attention_scores(q, k, scaling=0.3)
    for h in range(6):
        expected = q[:, h] @ k[:, h // 3].transpose(-1, -2) * 0.3
        assert torch.allclose(scores[:, h], expected, atol=1e-6)
    assert torch.equal(expand_kv(k, 6), k.repeat_interleave(3, dim=1))
    with pytest.raises(InputError, match="not a multiple"):
        expand_kv(k, 5)


def test_output_matches_sdpa_with_gqa_and_causal():
    q, k, v = _qkv(t=13, d=16)
    ours = attention_output(q, k, v, scaling=0.25)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, scale=0.25
    )
    assert torch.allclose(ours, sdpa, atol=1e-5)


def test_sliding_window_output_matches_sdpa_with_explicit_mask():
    q, k, v = _qkv(t=12, d=8, seed=3)
    mask = causal_mask(12, 12, sliding_window=4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True, scale=0.5
    )
    assert torch.allclose(attention_output(q, k, v, 0.5, sliding_window=4), sdpa, atol=1e-5)
    assert int(mask.sum(-1).max()) == 4  # each query sees itself and 3 earlier keys


@pytest.mark.parametrize("tq,tk,window", [(7, 7, 0), (3, 9, 0), (8, 8, 3), (4, 10, 2), (5, 5, 1)])
def test_causal_mask_matches_transformers_mask_functions(tq, tk, window):
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = (
        causal_mask_function
        if window == 0
        else and_masks(causal_mask_function, sliding_window_overlay(window))
    )
    offset = tk - tq  # transformers indexes queries by absolute (cache) position
    expected = torch.tensor(
        [
            [bool(fn(0, 0, torch.tensor(offset + i), torch.tensor(j))) for j in range(tk)]
            for i in range(tq)
        ]
    )
    assert torch.equal(causal_mask(tq, tk, window), expected)


def test_bottom_right_alignment_equals_last_rows_of_full_attention():
    q, k, v = _qkv(t=10, seed=4)
    full = attention_output(q, k, v, 0.4)
    tail = attention_output(q[:, :, -3:], k, v, 0.4)
    assert torch.allclose(full[:, :, -3:], tail, atol=1e-6)
    with pytest.raises(InputError, match="Tq <= Tk"):
        causal_mask(5, 4)


def test_softcap_applied_before_softmax():
    q, k, _ = _qkv(seed=5)
    raw = attention_scores(q, k, 1.0)
    capped = attention_scores(q, k, 1.0, softcap=2.0)
    assert torch.allclose(capped, torch.tanh(raw / 2.0) * 2.0)
    assert float(capped.abs().max()) < 2.0
    w = attention_weights(q, k, 1.0, softcap=2.0)
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
    assert float(w[..., 0, 1:].abs().max()) == 0.0  # first query sees only the first key


def _brute_force(q, k, v, k_hat, v_hat, scaling, window=0, softcap=0.0):
    mask = causal_mask(q.shape[2], k.shape[2], window)
    s, s_hat = (
        attention_scores(q, k, scaling, softcap),
        attention_scores(q, k_hat, scaling, softcap),
    )
    o = attention_output(q, k, v, scaling, window, softcap)
    o_hat = attention_output(q, k_hat, v_hat, scaling, window, softcap)
    w = attention_weights(q, k, scaling, window, softcap)
    w_hat = attention_weights(q, k_hat, scaling, window, softcap)
    heads = q.shape[1]
    score_err = [rel_error(s[:, h][:, mask], s_hat[:, h][:, mask]) for h in range(heads)]
    return (
        torch.tensor(score_err, dtype=torch.float64),
        per_head_rel_error(w, w_hat),
        per_head_rel_error(o, o_hat),
    )


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4, 0.0), (0, 3.0)])
def test_key_errors_match_brute_force_with_odd_chunks(window, softcap):
    q, k, v = _qkv(t=13, seed=6)
    k_hat = k + 0.1 * rand(*k.shape, seed=9)
    scores, weights, output = _brute_force(q, k, v, k_hat, v, 0.35, window, softcap)
    errs = _one(
        q, k, v, k_hat, scaling=0.35, sliding_window=window, softcap=softcap, chunk_size=4
    )
    assert errs.scores.shape == (6,) and errs.key_reconstruction.shape == (2,)
    assert torch.allclose(errs.scores, scores, rtol=1e-4)
    assert torch.allclose(errs.weights, weights, rtol=1e-4)
    assert torch.allclose(errs.output, output, rtol=1e-4)
    assert torch.allclose(errs.key_reconstruction, per_head_rel_error(k, k_hat))
    assert errs.value_reconstruction is None


def test_score_error_excludes_masked_entries():
    q, k, v = _qkv(t=6, seed=7)
    k_hat = k.clone()
    k_hat[:, :, -1] += 5.0  # only the last key changes: visible only to the last query
    errs = _one(q, k, v, k_hat, scaling=1.0)
    s = attention_scores(q, k, 1.0)
    s_hat = attention_scores(q, k_hat, 1.0)
    causal = causal_mask(6, 6)
    diff = ((s - s_hat).square() * causal).sum((0, 2, 3))
    ref = (s.square() * causal).sum((0, 2, 3))
    assert torch.allclose(errs.scores, (diff / ref).sqrt().double(), rtol=1e-4)
    unmasked = ((s - s_hat).square().sum((0, 2, 3)) / s.square().sum((0, 2, 3))).sqrt()
    assert bool((errs.scores < unmasked.double()).all())


def test_value_errors_and_identity_variant():
    q, k, v = _qkv(t=9, seed=8)
    v_hat = v + 0.05 * rand(*v.shape, seed=10)
    _, _, output = _brute_force(q, k, v, k, v_hat, 0.3)
    errs = _one(q, k, v, v_hat=v_hat, scaling=0.3, chunk_size=2)
    assert errs.scores is None and errs.weights is None and errs.key_reconstruction is None
    assert torch.allclose(errs.output, output, rtol=1e-4)
    same = _one(q, k, v, scaling=0.3, k_hat=k.clone(), v_hat=v.clone())
    assert float(same.output.abs().max()) == 0.0 and float(same.scores.max()) == 0.0
    with pytest.raises(InputError, match="no variant"):
        _one(q, k, v, scaling=0.3)


def test_many_variants_share_the_reference_and_match_single_calls():
    q, k, v = _qkv(t=10, seed=11)
    k_hat = k + 0.1 * rand(*k.shape, seed=12)
    v_hat = v + 0.1 * rand(*v.shape, seed=13)
    variants = [Variant(k_hat=k_hat), Variant(v_hat=v_hat), Variant(k_hat, v_hat)]
    many = attention_errors_many(q, k, v, variants, scaling=0.3, sliding_window=3, chunk_size=3)
    for var, got in zip(variants, many, strict=True):
        one = _one(q, k, v, var.k_hat, var.v_hat, scaling=0.3, sliding_window=3)
        assert torch.allclose(got.output, one.output)
    both = many[2]
    assert both.key_reconstruction is not None and both.value_reconstruction is not None
    _, _, output = _brute_force(q, k, v, k_hat, v_hat, 0.3, window=3)
    assert torch.allclose(both.output, output, rtol=1e-4)
    with pytest.raises(InputError, match="expected"):
        attention_errors_many(q, k, v, [Variant(k_hat=k[:, :, :5])], scaling=0.3)
    lean = attention_errors_many(q, k, v, variants, scaling=0.3, sliding_window=3,
                                 reconstruction=False)
    for full, got in zip(many, lean, strict=True):
        assert got.key_reconstruction is None and got.value_reconstruction is None
        assert torch.allclose(full.output, got.output)


def _mixed_output(q, k, v, k_hat, v_hat, scaling, exact):
    """Brute force: query i reads (k, v)[j] where exact[i, j], else (k_hat, v_hat)[j]."""
    tq = q.shape[2]
    out = torch.empty(q.shape[0], q.shape[1], tq, v.shape[-1])
    for i in range(tq):
        sel = exact[i][None, None, :, None]
        kk, vv = torch.where(sel, k, k_hat), torch.where(sel, v, v_hat)
        row = attention_output(q, kk, vv, scaling)  # row i of this mix
        out[:, :, i] = row[:, :, i]
    return out


def test_exact_mask_matches_a_per_query_mixture():
    from kvlens.analysis.attention import streaming_exact_mask
    from kvlens.analysis.metrics import Variant, attention_errors_many

    q, k, v = _qkv(t=13, seed=14)
    k_hat = k + 0.2 * rand(*k.shape, seed=15)
    v_hat = v + 0.2 * rand(*v.shape, seed=16)
    exact = streaming_exact_mask(13, residual_tokens=4, flush_tokens=2, sink_tokens=1)
    got = attention_errors_many(q, k, v, [Variant(k_hat, v_hat), Variant(v_hat=v_hat)],
                                scaling=0.3, chunk_size=5, exact=exact)
    ref = attention_output(q, k, v, 0.3)
    for var, errs in zip(((k_hat, v_hat), (k, v_hat)), got, strict=True):
        want = per_head_rel_error(ref, _mixed_output(q, k, v, *var, 0.3, exact))
        assert torch.allclose(errs.output, want, rtol=1e-4)
    plain = attention_errors_many(q, k, v, [Variant(k_hat, v_hat)], scaling=0.3)[0]
    assert bool((got[0].output < plain.output).all())  # exact entries can only help here
    everything = torch.ones(13, 13, dtype=torch.bool)
    none = attention_errors_many(q, k, v, [Variant(k_hat, v_hat)], scaling=0.3,
                                 exact=everything)[0]
    assert float(none.output.max()) < 1e-6 and float(none.scores.max()) == 0.0
    with pytest.raises(InputError, match="exact mask"):
        attention_errors_many(q, k, v, [Variant(k_hat)], scaling=0.3, exact=exact[:5])


@pytest.mark.parametrize("residual,flush,sinks", [(8, 0, 0), (8, 4, 2), (8, 8, 3), (0, 0, 0),
                                                  (12, 4, 0)])
def test_streaming_mask_matches_the_real_cache_layer(residual, flush, sinks):
    """n_q(i) from the formula equals the compressed layer's quantized length at step i."""
    from kvlens.analysis.attention import streaming_exact_mask
    from kvlens.cache.layer import CompressedLayer
    from kvlens.config import LayerKV, ProtectSettings
    from kvlens.quant import QuantSpec

    class Session:
        active = True
        rope: dict = {}

    spec = QuantSpec(2, "per-token", 4)
    layer = CompressedLayer(LayerKV(spec, spec, residual, flush_tokens=flush), 0, 8,
                            protect=ProtectSettings(sinks, "off") if sinks else None,
                            session=Session())
    t = 30
    mask = streaming_exact_mask(t, residual, flush, sinks)
    for i in range(t):
        x = rand(1, 1, 1, 8, seed=100 + i)
        layer.update(x, x)
        hp = set() if not layer.has_hp else set(layer.hp_pos.flatten().tolist())
        exact_now = set(range(layer.quantized_length, i + 1)) | hp
        assert exact_now == set(torch.nonzero(mask[i]).flatten().tolist()), i
        layer.commit(x.expand(1, 1, 1, 8), None)
