"""Capture on tiny random models of several architectures: exactness and non-interference."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import ARCHS, tiny_model

from kvlens.capture.run import capture_model
from kvlens.capture.store import open_capture
from kvlens.model.hooks import attention_override, rope_inputs

S, T = 2, 21


def _windows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (S, T), generator=g)


def _reference_run(model, windows):
    """Per-sample logits, per-layer attention outputs and RoPE tables, without kvlens capture
    (the override below only records what the model's own attention function returns)."""
    outs: dict[int, list] = {}

    def make(orig):
        def fn(module, q, k, v, mask, **kw):
            out = orig(module, q, k, v, mask, **kw)
            outs.setdefault(module.layer_idx, []).append(out[0][0].detach().clone())
            return out
        return fn

    logits = []
    with torch.no_grad(), rope_inputs(model) as tables, attention_override(model, make):
        for s in range(windows.shape[0]):
            logits.append(model(input_ids=windows[s:s + 1], use_cache=False).logits)
        tables = dict(tables)
    return torch.cat(logits), outs, tables


def _attend(q, k, v, scaling, sliding_window):
    """Plain causal attention [H, T, D] with GQA by repeat_interleave (the test's reference)."""
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, 0)
    v = v.repeat_interleave(groups, 0)
    t = q.shape[1]
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if sliding_window:
        allowed &= pos[None, :] > pos[:, None] - sliding_window
    scores = (q.double() @ k.double().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_is_exact_and_harmless(arch, tmp_path):
    model = tiny_model(arch)
    windows = _windows()
    ref_logits, ref_outs, tables = _reference_run(model, windows)

    path = tmp_path / "cap.h5"
    summary = capture_model(model, windows, path, storage_dtype="float32")

    # Capturing must not change the model's outputs, and must leave no override behind.
    after_logits, _, _ = _reference_run(model, windows)
    assert torch.equal(ref_logits, after_logits)
    assert not model.config._attn_implementation.startswith("kvlens")

    module = sys.modules[type(model).__module__]
    with open_capture(path) as cap:
        assert cap.meta.num_samples == S and cap.meta.num_tokens == T
        assert torch.equal(cap.tokens(), windows)
        # the model's size, for recommend's cost prediction
        head = model.get_output_embeddings().weight
        assert cap.meta.extra["vocab_size"] == head.shape[0] == model.config.vocab_size
        assert cap.meta.extra["hidden_size"] == head.shape[1] == model.config.hidden_size
        assert cap.meta.extra["num_parameters"] == sum(p.numel() for p in model.parameters())
        for layer in map(cap.layer, cap.layers):
            q, k, v = layer.read("q"), layer.read("k"), layer.read("v")
            assert q.shape[1] == cap.meta.shape.num_attention_heads
            assert k.shape[1] == cap.meta.shape.num_key_value_heads
            # Attention recomputed from the captured q, k, v equals the model's own.
            for s in range(S):
                mine = _attend(q[s], k[s], v[s], layer.attrs.scaling, layer.attrs.sliding_window)
                theirs = ref_outs[layer.index][s].transpose(0, 1)  # [T, H, D] -> [H, T, D]
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
            q_pre, k_pre = layer.read("q_pre"), layer.read("k_pre")
            if summary.rope_layout == "none":
                assert torch.equal(q_pre, q) and torch.equal(k_pre, k)
                continue
            # The model's own RoPE function re-applied to the captured pre-RoPE tensors
            # reproduces the captured post-RoPE tensors (independent of our layout detection).
            cos, sin, _ = tables[layer.index]
            q_re, k_re = module.apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
            torch.testing.assert_close(q_re, q, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k_re, k, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(q_pre, q)  # RoPE did something at positions > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pre_rope_matches_projection_or_norm_output(arch, tmp_path):
    """Independent ground truth: the tensor RoPE is applied to is k_proj's output (Llama) or
    k_norm's output (QK-norm models such as Qwen3), reshaped to [B, H, T, D]."""
    model = tiny_model(arch)
    windows = _windows(1)[:1]
    attn = model.model.layers[1].self_attn
    source = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
    seen = []
    handle = source.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    try:
        capture_model(model, windows, tmp_path / "c.h5", storage_dtype="float32")
    finally:
        handle.remove()
    # the last call is the capture's own forward (a short forward checks the shapes first)
    truth = seen[-1].reshape(1, T, -1, attn.head_dim).transpose(1, 2)
    with open_capture(tmp_path / "c.h5") as cap:
        torch.testing.assert_close(cap.layer(1).read("k_pre"), truth, atol=1e-5, rtol=1e-5)


def test_layer_selection_and_storage_dtypes(tmp_path):
    model = tiny_model("llama")
    windows = _windows()
    capture_model(model, windows, tmp_path / "f32.h5", storage_dtype="float32")
    for dtype, tol in (("float16", 1e-3), ("bfloat16", 1e-2)):
        path = tmp_path / f"{dtype}.h5"
        capture_model(model, windows, path, layers="0,2", storage_dtype=dtype)
        with open_capture(path) as cap, open_capture(tmp_path / "f32.h5") as ref:
            assert cap.layers == (0, 2) and cap.meta.storage_dtype == dtype
            exact = ref.layer(2).read("k")
            got = cap.layer(2).read("k")
            # Lossless storage of the dtype: equal to a direct cast of the float32 values.
            assert torch.equal(got, exact.to(getattr(torch, dtype)).float())
            torch.testing.assert_close(got, exact, atol=tol, rtol=tol)
            with pytest.raises(Exception, match="Layer 1 is not in"):
                cap.layer(1)


def test_the_model_beside_a_capture_is_loaded_once_where_named(tmp_path, monkeypatch):
    """``kvlens.capture.source.CaptureModel``, the one loader of a model beside a capture:
    ``--model`` (or the capture's own), placed as asked, loaded once; a capture that does not
    say which model it came from, with no ``--model``, is an error, never a default model."""
    from helpers import make_capture, rand

    import kvlens.capture.source
    from kvlens.capture.source import CaptureModel
    from kvlens.errors import InputError

    path = tmp_path / "cap.h5"
    make_capture(path, rand(1, 2, 8, 16), rand(1, 2, 8, 16, seed=1), rand(1, 2, 8, 16, seed=2))
    calls, said = [], []
    monkeypatch.setattr(kvlens.capture.source, "load_model",
                        lambda spec, **kw: calls.append((spec, kw)) or ("model", "tok", None))
    loaded = CaptureModel(path, "some/dir", {"dtype": "bfloat16"}, said.append, " for x")
    assert loaded.get() == ("model", "tok") and loaded.get() == ("model", "tok")
    assert calls == [("some/dir", {"dtype": "bfloat16"})] and said == ["Loading some/dir for x ..."]
    with pytest.raises(InputError, match="does not say which model it came from; pass --model"):
        CaptureModel(path).get()
    assert len(calls) == 1
