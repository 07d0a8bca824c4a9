"""The Triton decode kernel wired into generation (``--backend triton``) vs the torch path.

Runs on CPU through the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).
Tiny random Llama (head_dim 16) with a KIVI-2-like layout the kernel supports: keys per-channel
G16, values per-token G16, a 32-token residual window, so a 40-token prompt already fills the
packed store and every decode step reads it through the kernel.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model

pytest.importorskip("triton")

from kvlens.cache import compressed_attention  # noqa: E402
from kvlens.cache.backend import select_backend  # noqa: E402
from kvlens.cache.layer import CompressedLayer  # noqa: E402
from kvlens.cache.torch_read import packed_attention  # noqa: E402
from kvlens.cache.triton_glue import triton_decode, triton_unsupported  # noqa: E402
from kvlens.config import LayerKV, ProtectSettings, preset  # noqa: E402
from kvlens.errors import BackendError  # noqa: E402
from kvlens.model.hooks import cache_argument_name  # noqa: E402
from kvlens.quant import QuantSpec  # noqa: E402
from kvlens.research.sets import mikv_settings  # noqa: E402

KEYS, VALUES = QuantSpec(2, "per-channel", 16), QuantSpec(2, "per-token", 16)


def _config(flush=0, sinks=0):
    cfg = preset("kivi-2")
    return replace(cfg, default=LayerKV(KEYS, VALUES, residual_tokens=32, flush_tokens=flush),
                   protect=ProtectSettings(sinks, "off") if sinks else None)


def _generate(model, ids, mask, backend, n, config=None):
    with compressed_attention(model, config or _config(), backend=backend) as session:
        cache = session.new_cache()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **{cache_argument_name(model): cache})
    assert cache.layers[0].quantized_length >= 16  # the packed store was used
    return out, session


@pytest.mark.parametrize("scale_dtype", ["float16", "8bit"])  # 8bit: decoded in the kernel
def test_triton_backend_generates_the_same_tokens_as_torch(scale_dtype):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    config = replace(_config(), scale_dtype=scale_dtype)
    ref, s_torch = _generate(model, ids, mask, "torch", 10, config)
    out, s_triton = _generate(model, ids, mask, "triton", 10, config)
    assert s_torch.backend == "torch" and s_triton.backend == "triton"
    assert torch.equal(out, ref)
    # Prefill took the torch path and says so; decode steps did not.
    calls = s_triton.torch_path_calls
    assert calls == {"nothing quantized yet (model's own attention)": 3}, calls
    assert "torch path for: nothing quantized yet" in s_triton.backend_reason


@pytest.mark.parametrize("flush,sinks", [(0, 0), (16, 4)])  # KIVI window; sliding + sinks
def test_triton_backend_left_padded_batch(flush, sinks):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1 left-padded by 7 tokens
    ids[1, :7] = 0
    config = _config(flush, sinks)
    ref, _ = _generate(model, ids, mask, "torch", 6, config)
    out, session = _generate(model, ids, mask, "triton", 6, config)
    assert torch.equal(out, ref)
    assert sum(session.torch_path_calls.values()) == 3  # only the prefill


@pytest.mark.parametrize("fp", ["float16", "float8_e4m3fn"])
def test_kernel_reads_mikv_set_and_balancer_like_the_torch_path(fp):
    """A layer with a MiKV high-precision set (hidden in the packed store, attended from fp16
    or fp8) and a fixed channel balancer: the kernel call equals the torch path."""
    torch.manual_seed(4)
    b, hq, hkv, d, total = 2, 4, 2, 16, 75
    mikv = mikv_settings(heavy_fraction=0.1, sink_tokens=2, balancer="fixed")
    bal = torch.rand(hkv, d) + 0.5
    layer = CompressedLayer(LayerKV(KEYS, VALUES, 16), 0, d, protect=mikv, balancer=bal,
                            session=SimpleNamespace(active=True, rope={}), fp_dtype=fp)
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    layer.update(k[:, :, :40], v[:, :, :40])
    q = torch.randn(b, hq, 40, d)
    _, colsum = packed_attention(q, layer, None, d ** -0.5, with_probs=True)
    layer.commit(q, colsum)
    for t in range(40, total):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(b, hq, 1, d)
        _, colsum = packed_attention(q, layer, None, d ** -0.5, with_probs=True)
        layer.commit(q, colsum)
    assert layer.has_hp and layer.n_res > 0
    assert layer.res_k.buf.dtype == getattr(torch, fp)
    q = torch.randn(b, hq, 1, d)
    # Left padding of 5 tokens in row 1, as transformers' bool mask [B, 1, 1, N].
    mask = torch.ones(b, 1, 1, total, dtype=torch.bool)
    mask[1, ..., :5] = False
    assert triton_unsupported(layer, q, with_probs=False) is None
    for m in (mask, torch.where(mask, 0.0, torch.finfo(torch.float32).min), None):
        ref, _ = packed_attention(q, layer, m, d ** -0.5)
        out, why = triton_decode(q, layer, m, d ** -0.5)
        assert why is None
        torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def _layer(key, value, pre_rope=False):
    return CompressedLayer(LayerKV(key, value, 16, pre_rope), 0, 16,
                           session=SimpleNamespace(active=True, rope={}))


def test_unsupported_calls_say_why():
    layer = _layer(QuantSpec(2, "per-token", 8), VALUES)
    q1, q3 = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 3, 16)
    assert "multi-token" in triton_unsupported(layer, q3, False)
    assert "key group 8 per-token" in triton_unsupported(layer, q1, False)
    assert "probabilities" in triton_unsupported(layer, q1, True)
    assert "pre-RoPE" in triton_unsupported(_layer(KEYS, VALUES, True), q1, False)
    assert "value group 8 per-channel" in triton_unsupported(
        _layer(KEYS, QuantSpec(2, "per-channel", 8)), q1, False)
    # every other layout recommend writes is read by the kernel
    for k, v in ((QuantSpec(2, "per-token", 16), QuantSpec(2, "per-channel", 16)),
                 (QuantSpec(3, "per-token", None), QuantSpec(3, "per-token", 16)),
                 (QuantSpec(4, "per-tensor"), QuantSpec(4, "per-tensor"))):
        assert triton_unsupported(_layer(k, v), q1, False) is None


def test_triton_generates_the_same_tokens_for_recommend_layouts():
    """A per-layer mix like recommend's output: per-token keys + per-channel values (2 and
    3 bits), per-tensor, KIVI; batch 2 with left padding. Every decode step uses the kernel."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    cfg = replace(preset("kivi-2"),
                  default=LayerKV(QuantSpec(2, "per-token", 16), QuantSpec(2, "per-channel", 16),
                                  32),
                  layers={1: LayerKV(QuantSpec(3, "per-token", None),
                                     QuantSpec(3, "per-channel", 16), 32),
                          2: LayerKV(QuantSpec(4, "per-tensor"), QuantSpec(4, "per-tensor"), 32)})
    ref, _ = _generate(model, ids, mask, "torch", 6, cfg)
    out, session = _generate(model, ids, mask, "triton", 6, cfg)
    assert torch.equal(out, ref)
    assert sum(session.torch_path_calls.values()) == 3  # only the prefill


def test_backend_choice_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name, reason = select_backend("auto", "cpu")
    assert name == "torch" and reason.startswith("CPU tensors: torch path")
    assert select_backend("triton", "cpu")[0] == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")


def test_kld_scoring_reports_the_torch_path_calls_of_its_chunks():
    """--eval kld under the triton backend: the chunks of a long text are multi-token
    forwards, which the decode kernel does not serve; each config's result says so (its
    ``backend_reason`` counts them) instead of reading as if the kernel had run."""
    from kvlens.evaluation.kld import score_text, summarize

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(3))
    scores = score_text(model, ids, [_config()], chunk=16, backend="triton")
    (doc,) = summarize(scores)["configs"]
    assert "torch path for" in doc["backend_reason"], doc["backend_reason"]
    torch_run = score_text(model, ids, [_config()], chunk=16, backend="torch")
    assert "torch path for" not in (summarize(torch_run)["configs"][0].get("backend_reason")
                                    or "")
