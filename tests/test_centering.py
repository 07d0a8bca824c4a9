"""Key centering (kvlens.quant.centering): exact for post-RoPE keys (softmax shift), not for a
constant subtracted before RoPE, and it shrinks the per-token range of keys with a common
offset, on planted data and on real SmolLM2 keys."""

from __future__ import annotations

import pytest
import torch

from kvlens.analysis.metrics import attention_output
from kvlens.errors import InputError
from kvlens.quant import QuantSpec, fake_quantize, rope_tables_for
from kvlens.quant.centering import (
    center,
    centering_bytes,
    key_mean,
    quantize_centered,
    token_range,
)
from kvlens.quant.codebook import CodebookSpec, fake_quantize_codebook
from kvlens.rope import apply_rope


def _qkv(seed=0, b=2, hq=4, hkv=2, t=37, d=16, offset=5.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64)
    k = k + offset * torch.randn(hkv, d, generator=gen, dtype=torch.float64)[None, :, None, :]
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=torch.float64)
    return q, k, v


def test_key_mean_shape_and_value():
    _, k, _ = _qkv()
    mu = key_mean(k)
    assert mu.shape == (2, 16)
    torch.testing.assert_close(mu, k.mean(dim=(0, 2)).half().float())
    assert centering_bytes(2, 16) == 64


@pytest.mark.parametrize("scaling,window", [(0.25, 0), (1.0, 5)])
def test_centered_keys_give_the_exact_attention_output(scaling, window):
    q, k, v = _qkv()
    mu = key_mean(k).double()
    exact = attention_output(q, k, v, scaling=scaling, sliding_window=window)
    centred = attention_output(q, k - mu[None, :, None, :], v, scaling=scaling,
                               sliding_window=window)
    torch.testing.assert_close(centred, exact, rtol=1e-5, atol=1e-5)
    # any constant per KV head works, not only the mean
    other = torch.randn(2, 16, dtype=torch.float64) * 10
    shifted = attention_output(q, k - other[None, :, None, :], v, scaling=scaling,
                               sliding_window=window)
    torch.testing.assert_close(shifted, exact, rtol=1e-5, atol=1e-5)


def test_constant_subtracted_before_rope_is_not_exact():
    q, k_pre, v = _qkv()
    cos, sin = rope_tables_for(torch.arange(k_pre.shape[2]), 16)
    k = apply_rope(k_pre, cos.double(), sin.double(), "half")
    mu_pre = key_mean(k_pre).double()
    dropped = apply_rope(k_pre - mu_pre[None, :, None, :], cos.double(), sin.double(), "half")
    exact = attention_output(q, k, v, scaling=0.25)
    off = attention_output(q, dropped, v, scaling=0.25)
    assert float((off - exact).norm() / exact.norm()) > 1e-2  # RoPE_t(mu) varies with t
    # adding mu back before RoPE (the pre-RoPE read path) is exact again
    back = apply_rope(center(k_pre, mu_pre.float()).double() + mu_pre[None, :, None, :],
                      cos.double(), sin.double(), "half")
    torch.testing.assert_close(attention_output(q, back, v, scaling=0.25), exact)


def test_centering_shrinks_token_range_and_per_token_error():
    _, k, _ = _qkv(offset=8.0, t=200)
    k = k.float()
    mu = key_mean(k)
    assert float(token_range(center(k, mu)).mean()) < 0.5 * float(token_range(k).mean())
    spec = QuantSpec(2, "per-token", 16)
    plain = fake_quantize(k, spec)
    centred = quantize_centered(k, mu, lambda x: fake_quantize(x, spec))
    err = lambda y: float((y - k).norm() / k.norm())  # noqa: E731
    assert err(centred) < 0.5 * err(plain)
    # per-channel min/max groups absorb a per-channel offset: centering changes ~nothing
    ch = QuantSpec(2, "per-channel", 32)
    assert err(quantize_centered(k, mu, lambda x: fake_quantize(x, ch))) == pytest.approx(
        err(fake_quantize(k, ch)), rel=0.05)
    # and a codebook (per-vector norm) gains from the smaller norms too
    cb = CodebookSpec(2)
    assert err(quantize_centered(k, mu, lambda x: fake_quantize_codebook(x, cb))) < 0.5 * err(
        fake_quantize_codebook(k, cb))


def test_center_checks_shapes():
    with pytest.raises(InputError, match="does not fit keys"):
        center(torch.randn(1, 2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(InputError, match=r"\[B, H, T, D\]"):
        key_mean(torch.randn(3, 4))


def test_centering_real_smollm2_keys(smollm2, tmp_path):
    """On real post-RoPE keys the mean key is far from zero in some heads: centering shrinks
    the mean per-token range (the quantity a per-token group is stretched over)."""
    from kvlens.capture.run import capture_model
    from kvlens.capture.store import open_capture
    from kvlens.text.corpus import load_text, token_windows

    model, tokenizer = smollm2
    text, source = load_text(None)
    windows = token_windows(tokenizer, text, samples=2, tokens=64, source=source)
    capture_model(model, windows, tmp_path / "c.h5", layers="0,15,29", storage_dtype="float32")
    ratios = []
    with open_capture(tmp_path / "c.h5") as cap:
        for layer in (0, 15, 29):
            k = cap.layer(layer).read("k")
            ratios.append(float(token_range(center(k, key_mean(k))).mean()
                                / token_range(k).mean()))
    assert max(ratios) < 1.0 and min(ratios) < 0.9
