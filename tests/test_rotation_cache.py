"""Hadamard-rotated keys and values in the compressed cache (``rotate_keys``/``rotate_values``):
stored ``k R``/``v R``, attended with ``q R``, output un-rotated by ``R^T``; torch and Triton
(interpreter) paths, accounting and bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session
from tiny_models import tiny_model

from kvlens.cache import compressed_attention, memory_report
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.config import KVConfig, LayerKV, ProtectSettings, config_from_dict, validate_for
from kvlens.errors import ConfigError
from kvlens.model.hooks import cache_argument_name
from kvlens.model.shape import ModelShape
from kvlens.quant import QuantSpec, hadamard_rotation

KEYS, VALUES = QuantSpec(2, "per-channel", 16), QuantSpec(2, "per-token", 16)


@pytest.mark.parametrize("rot_k,rot_v", [(True, True), (True, False), (False, True)])
def test_rotated_layer_equals_reference_attention_over_unrotated_dequantized(rot_k, rot_v):
    """What the cache computes = attention with the plain query over ``deq(x R) R^T``."""
    torch.manual_seed(0)
    b, hq, hkv, d, total = 2, 4, 2, 32, 90
    r = hadamard_rotation(d, seed=3)
    setting = LayerKV(KEYS, QuantSpec(2, "per-token", 8), 32, rotate_keys=rot_k,
                      rotate_values=rot_v)
    layer = CompressedLayer(setting, 0, d, rotation=r, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    k[..., 5] *= 20  # an outlier channel the rotation spreads
    layer.update(k[:, :, :50], v[:, :, :50])
    layer.commit(torch.randn(b, hq, 50, d), None)
    for t in range(50, total):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    n_q = layer.quantized_length
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(layer.to_stored_basis(q, rot_k), layer, None, d ** -0.5)
    out = layer.from_stored_basis(out)
    keys = stored_view(k @ r, KEYS, 32, n_q) @ r.T if rot_k else stored_view(k, KEYS, 32, n_q)
    vspec = setting.value
    values = stored_view(v @ r, vspec, 32, n_q) @ r.T if rot_v else \
        stored_view(v, vspec, 32, n_q)
    ref = reference_attention(q, keys, values, torch.ones(1, 1, 1, total, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rotation_changes_nothing_when_nothing_is_quantized():
    """A window longer than the text: every token exact, rotated or not -> the same logits as
    the model's own cache (float32 storage), to float rounding."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    cfg = KVConfig("rot", LayerKV(KEYS, VALUES, 64, rotate_keys=True, rotate_values=True),
                   fp_dtype="exact")
    with torch.no_grad(), compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        kw = {cache_argument_name(model): cache}
        out = torch.cat([model(ids[:, :20], **kw).logits,
                         *[model(ids[:, t:t + 1], **kw).logits for t in range(20, 30)]], 1)
    assert cache.layers[0].quantized_length == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rotation_matrix_is_shared_and_counted_once():
    model = tiny_model("llama")
    cfg = KVConfig("rot", LayerKV(KEYS, VALUES, 32, rotate_values=True))
    with torch.no_grad(), compressed_attention(model, cfg) as session:
        cache = session.new_cache()
        model(torch.randint(3, 128, (1, 70)), **{cache_argument_name(model): cache})
    mats = {layer.rotation.data_ptr() for layer in cache.layers}
    assert len(mats) == 1
    rep = memory_report(cache)
    assert rep["breakdown"]["rotations"] == 16 * 16 * 4 and rep["unaccounted"] == 0


@pytest.mark.triton  # the decode kernel under the interpreter
def test_triton_generates_like_torch_with_rotation():
    pytest.importorskip("triton")
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    cfg = KVConfig("rot", LayerKV(KEYS, VALUES, 32, rotate_keys=True, rotate_values=True),
                   rotation_seed=0)
    outs = {}
    for backend in ("torch", "triton"):
        with compressed_attention(model, cfg, backend=backend) as session:
            cache = session.new_cache()
            outs[backend] = model.generate(ids, max_new_tokens=8, do_sample=False,
                                           pad_token_id=0, **{cache_argument_name(model): cache})
        assert cache.layers[0].quantized_length >= 32
    assert session.backend == "triton" and not any(
        "layout" in why or "rotat" in why for why in session.torch_path_calls)
    assert torch.equal(outs["torch"], outs["triton"])


def test_bad_rotation_settings_are_refused():
    base = LayerKV(KEYS, VALUES, 32)
    with pytest.raises(ConfigError, match="rotate_keys is set but that tensor is not quantized"):
        LayerKV(None, VALUES, 32, rotate_keys=True)
    with pytest.raises(ConfigError, match="do not commute"):
        replace(base, rotate_keys=True, pre_rope_keys=True)
    with pytest.raises(ConfigError, match="rotation_seed"):
        KVConfig("x", base, rotation_seed=-1)
    info = ModelShape(2, 1, 1, 15, architecture="tiny")
    odd = KVConfig("x", replace(base, key=QuantSpec(2, "per-channel", 16), value=None,
                                rotate_keys=True))
    with pytest.raises(ConfigError, match="No Hadamard rotation for head_dim 15.*Supported"):
        validate_for(odd, info)
    info = replace(info, head_dim=16)
    bal = KVConfig("x", replace(base, key=QuantSpec(2, "per-token", 16), rotate_keys=True),
                   protect=ProtectSettings(0, "online"))
    with pytest.raises(ConfigError, match="balancer"):
        validate_for(bal, info)
    doc = KVConfig("x", replace(base, rotate_values=True), rotation_seed=4).to_dict()
    assert config_from_dict(doc).default.rotate_values and config_from_dict(doc).rotation_seed == 4
