"""MiKV's importance set at a bit width, in the cache: stored rows follow their definition, the
read path (torch and the Triton kernel) equals "rebuild densely, then attend exactly", configs
refuse bad values; generate's help names every preset."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_attention, stub_session

from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.cache.triton_glue import triton_unsupported
from kvlens.config import (
    PRESETS,
    LayerKV,
    config_from_dict,
)
from kvlens.errors import ConfigError
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.research.sets import dequantize_rows, mikv_settings, quantize_rows, set_bytes_per_token


def _fill(layer, k, v, prefill, hq):
    layer.update(k[:, :, :prefill], v[:, :, :prefill])
    layer.commit(torch.randn(k.shape[0], hq, prefill, k.shape[-1]), None)
    for t in range(prefill, k.shape[2]):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(k.shape[0], hq, 1, k.shape[-1]), None)


def test_mikv_set_bits_are_validated():
    for bad in (2, 3, 16, "4", True):
        with pytest.raises(ConfigError, match=r"allowed: null \(the set at fp_dtype\), 4, 8"):
            mikv_settings(0.2, 4, "off", set_bits=bad)
    data = PRESETS["mikv-2-int4"].to_dict()
    assert data["importance"]["set_bits"] == 4
    assert config_from_dict(data) == PRESETS["mikv-2-int4"]


def test_set_rows_round_trip_and_bytes():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 7, 64)
    x[..., 9] *= 20
    for bits, tol in ((4, 0.15), (8, 0.01)):
        codes, scale, zero = quantize_rows(x, bits)
        back = dequantize_rows(codes, scale, zero, bits, 64)
        spec = QuantSpec(bits, "per-token", 32)
        assert float((back - fake_quantize(x, spec)).abs().max()) < 0.05 * bits / 4
        assert float((back - x).norm() / x.norm()) < tol
        per_token = sum(t[0, 0, 0].numel() * t.element_size() for t in (codes, scale, zero))
        assert per_token == set_bytes_per_token(bits, 64) == 64 * bits // 8 + 2 * 2 * 2


@pytest.mark.parametrize("set_bits", [None, 4, 8])
def test_mikv_set_at_a_bit_width_is_what_attention_reads(set_bits):
    """The set's tokens are read as their stored codes (dequantized with the reference), their
    packed copies hidden; the rest as packed codes and the window."""
    torch.manual_seed(4)
    b, hq, hkv, d, total = 1, 4, 2, 32, 60
    spec = QuantSpec(2, "per-token", 8)
    mikv = mikv_settings(heavy_fraction=0.25, sink_tokens=2, balancer="off", set_bits=set_bits)
    layer = CompressedLayer(LayerKV(spec, spec, 8), 0, d, protect=mikv, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    for t in range(total):  # decode, choosing heavy hitters by the attention each step paid
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(b, hq, 1, d)
        layer.commit(q, packed_attention(q, layer, None, d ** -0.5, with_probs=True)[1])
    n_q = layer.quantized_length
    keys = torch.cat((layer.kstore.dequantize_range(0, n_q), layer.res_k.view().float()), 2)
    values = torch.cat((layer.vstore.dequantize_range(0, n_q), layer.res_v.view().float()), 2)
    for hh in range(hkv):
        pos = layer.hp_pos[0, hh].long()
        exact_k, exact_v = k[:, hh:hh + 1, pos].half().float(), v[:, hh:hh + 1, pos].half().float()
        if set_bits is not None:  # independent: the reference quantizer on the exact rows
            spec_set = QuantSpec(set_bits, "per-token", 32)
            exact_k, exact_v = fake_quantize(exact_k, spec_set), fake_quantize(exact_v, spec_set)
        keys[0, hh, pos], values[0, hh, pos] = exact_k[0, 0], exact_v[0, 0]
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(q, layer, None, d ** -0.5)
    ref = reference_attention(q, keys, values, torch.ones(1, 1, 1, total, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)  # float16 set scales
    held = sum(t.untyped_storage().nbytes() for t in layer.hp_k.parts)
    per = d * 2 if set_bits is None else set_bytes_per_token(set_bits, d)
    assert held == layer.hp_pos.numel() * per


@pytest.mark.triton  # the decode kernel under the interpreter
@pytest.mark.parametrize("set_bits", [4, 8])
def test_kernel_reads_an_integer_set_like_the_torch_path(set_bits):
    """The Triton decode kernel (interpreter on CPU) gets the integer set dequantized as its
    extra segment and equals the torch path."""
    pytest.importorskip("triton")
    from kvlens.cache.triton_glue import triton_decode

    torch.manual_seed(6)
    b, hq, hkv, d, total = 2, 4, 2, 16, 60
    mikv = mikv_settings(heavy_fraction=0.0, sink_tokens=4, balancer="off", set_bits=set_bits)
    spec_k, spec_v = QuantSpec(2, "per-channel", 16), QuantSpec(2, "per-token", 16)
    layer = CompressedLayer(LayerKV(spec_k, spec_v, 16), 0, d, protect=mikv, session=stub_session())
    k, v = torch.randn(b, hkv, total, d), torch.randn(b, hkv, total, d)
    k[:, :, :4] *= 6  # large sink keys: the set's codes matter
    _fill(layer, k, v, 40, hq)
    assert layer.has_hp and layer.hp_k.bits == set_bits
    q = torch.randn(b, hq, 1, d)
    assert triton_unsupported(layer, q, with_probs=False) is None
    ref, _ = packed_attention(q, layer, None, d ** -0.5)
    out, why = triton_decode(q, layer, None, d ** -0.5)
    assert why is None
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_generate_help_names_every_stable_preset_and_the_lab_note_the_research_ones():
    """``--preset``'s help names every stable preset (those a fresh process has before
    kvlens.research is imported); research presets are named in their lab note, not in help."""
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    from kvlens.cli.generate import generate

    text = inspect.signature(generate).parameters["preset_name"].default.help
    stable = subprocess.run([sys.executable, "-c", "from kvlens.config.presets import PRESETS; "
                             "print(' '.join(PRESETS))"], capture_output=True, text=True,
                            check=True).stdout.split()
    research = [p for p in PRESETS if p not in stable]
    assert "kivi-2" in stable and "mikv-2" in research
    assert [p for p in stable if p not in text] == []
    assert [p for p in research if p in text] == []
    note = (Path(__file__).resolve().parents[1] / "docs/lab-notes/gear-mikv.md").read_text()
    assert [p for p in research if f"`{p}`" not in note] == []
