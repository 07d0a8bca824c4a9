"""kvlens.layouts.codebook (vLLM TurboQuant's keys): the coded store holds what
its layout's ``part_bytes`` reports, and a layer's folded torch read path equals
code-with-the-reference-then-attend on odd shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session

from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.config import LayerKV
from kvlens.errors import ConfigError, InputError
from kvlens.layouts import layout_of
from kvlens.layouts.codebook import CodebookStore
from kvlens.quant import QuantSpec, fake_quantize_codebook, hadamard_rotation
from kvlens.quant.codebook import CodebookSpec, computed_codebook, lloyd_max
from kvlens.quant.rotation import RotationSpec


def _store(spec, x, chunks=(5, 1, 11)):
    store = CodebookStore(spec, computed_codebook(spec, x.shape[-1]), x.shape[-1])
    t0 = 0
    for c in (*chunks, x.shape[2]):  # appended in uneven pieces, as decoding does
        t1 = min(x.shape[2], t0 + c)
        if t1 > t0:
            store.append(x[:, :, t0:t1])
        t0 = t1
    return store


@pytest.mark.parametrize("kind,bits,d", [("lloyd-max", 3, 64), ("lloyd-max-normal", 3, 64),
                                          ("lloyd-max-normal", 2, 24), ("lloyd-max", 5, 10)])
def test_held_bytes_equal_reported(kind, bits, d):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 21, d, generator=gen)
    spec = CodebookSpec(bits, kind)
    store = _store(spec, x)
    assert store.length == 21
    held = sum(t.numel() * t.element_size() for t in store.named_tensors().values())
    assert held == sum(layout_of(spec).part_bytes(2 * 3 * 21, d, 1).values())
    assert CodebookStore(spec, computed_codebook(spec, d), d).named_tensors() == {}


def test_store_round_trip_equals_reference_quantizer():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 13, 32, generator=gen)
    spec = CodebookSpec(3)
    store = _store(spec, x)
    torch.testing.assert_close(store.dequantize_range(0, store.length),
                               fake_quantize_codebook(x, spec))


def test_bad_shapes():
    spec = CodebookSpec(2)
    store = CodebookStore(spec, lloyd_max(2, 8), 8)
    with pytest.raises(InputError, match=r"Expected \[B, H, t, 8\]"):
        store.append(torch.randn(1, 1, 3, 16))
    with pytest.raises(InputError, match="cannot code"):
        CodebookStore(CodebookSpec(3), lloyd_max(2, 8), 8)


@pytest.mark.parametrize("bits,kind,renorm,r,flush,total,d,vbits", [
    (3, "lloyd-max-normal", True, 0, 0, 37, 32, 4),  # turboquant_k3v4_nc's layout: no window
    (4, "lloyd-max", True, 0, 0, 53, 24, 4),         # odd head_dim (Hadamard blocks of 8)
    (2, "lloyd-max-normal", False, 16, 8, 70, 32, 2),  # sliding block, 2-bit values
    (3, "lloyd-max", True, 32, 0, 81, 24, 3),        # whole-window flushes
])
def test_cache_layer_codebook_keys_equal_reference(bits, kind, renorm, r, flush, total, d,
                                                   vbits):
    """A CompressedLayer storing codebook keys (rotated window, packed codes + norms, scores
    from the rotated query times the centroid lookups times each key's scale) beside uniform
    per-token values, prefilled then decoded token by token, batch 2 with row 1 left-padded,
    GQA 6/2: its attention equals "rotate, code the keys with the reference quantizer,
    un-rotate, attend" with the window exact."""
    torch.manual_seed(total + bits)
    b, hq, hkv = 2, 6, 2
    rot = hadamard_rotation(d, 7)
    kspec = CodebookSpec(bits, kind, RotationSpec(7), renormalize=renorm)
    vspec = QuantSpec(vbits, "per-token")
    k = torch.randn(b, hkv, total, d) * torch.rand(1, 1, total, 1) * 3
    k[:, :, 0] *= 20  # an outlier token (the attention sink of real keys)
    v = torch.randn(b, hkv, total, d)
    setting = LayerKV(kspec, vspec, residual_tokens=r, flush_tokens=flush)
    assert setting.rotate_keys and not setting.rotate_values
    layer = CompressedLayer(setting, 0, d, rotation=rot, session=stub_session())
    seen = total - 1
    layer.update(k[:, :, :19], v[:, :, :19])
    layer.commit(torch.randn(b, hq, 19, d), None)
    for t in range(19, seen):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    n_q = layer.quantized_length
    assert n_q > 0 and (layer.n_res > 0) == (r > 0)
    parts = dict(layer.named_tensors())
    assert parts["codes"].shape[:3] == (b, hkv, n_q) and parts["norms"].dtype == torch.float16
    kr = (k[:, :, :seen] @ rot).half().float()  # the fp16 window of k R the blocks come from
    coded = fake_quantize_codebook(kr[:, :, :n_q], replace(kspec, rotation=None))
    keys = torch.cat((coded, kr[:, :, n_q:]), 2) @ rot.T
    values = stored_view(v[:, :, :seen], vspec, flush or r or 1, n_q)
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :5] = False
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(layer.to_stored_basis(q, True), layer, mask, d ** -0.5,
                              chunk_tokens=16)
    out = layer.from_stored_basis(out)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)


def test_write_first_reads_a_forwards_own_tokens_compressed():
    """``write_first`` (KVConfig.write_before_attention, vLLM TurboQuant's order): the first
    forward attends exact and codes its tokens after; every later forward codes its tokens
    before attending, so its own keys and values are read back compressed."""
    torch.manual_seed(3)
    b, hq, hkv, d = 2, 4, 2, 16
    rot = hadamard_rotation(d, None)
    kspec = CodebookSpec(3, "lloyd-max-normal", RotationSpec(), renormalize=True)
    vspec = QuantSpec(4, "per-token")
    layer = CompressedLayer(LayerKV(kspec, vspec), 0, d, rotation=rot, session=stub_session(),
                            write_first=True)
    k, v = torch.randn(b, hkv, 24, d), torch.randn(b, hkv, 24, d)
    layer.update(k[:, :, :20], v[:, :, :20])
    assert layer.quantized_length == 0 and layer.n_res == 20  # the first forward: exact
    layer.commit(torch.randn(b, hq, 20, d), None)
    assert layer.quantized_length == 20 and layer.n_res == 0
    layer.update(k[:, :, 20:23], v[:, :, 20:23])  # a later forward: coded before attention
    assert layer.quantized_length == 23 and layer.n_res == 0
    kr = (k[:, :, :23] @ rot).half().float()
    keys = fake_quantize_codebook(kr, replace(kspec, rotation=None)) @ rot.T
    values = stored_view(v[:, :, :23], vspec, 1, 23)
    q = torch.randn(b, hq, 3, d)
    mask = torch.ones(23, 23, dtype=torch.bool).tril()[None, None, 20:].expand(b, 1, 3, 23)
    out, _ = packed_attention(layer.to_stored_basis(q, True), layer, None, d ** -0.5)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)


def test_codebook_keys_refused_with_pre_rope_keys_and_unrotated_flags():
    with pytest.raises(ConfigError, match="pre_rope_keys"):
        LayerKV(CodebookSpec(3), QuantSpec(4, "per-token"), pre_rope_keys=True)
    with pytest.raises(ConfigError, match="rotate_keys is set but the codebook key spec"):
        LayerKV(CodebookSpec(3, rotation=None), QuantSpec(4, "per-token"), rotate_keys=True)
    assert not LayerKV(CodebookSpec(3, rotation=None), QuantSpec(4, "per-token")).rotate_keys


def test_codebook_values_are_refused_as_removed():
    """Codebook values were a research layout with a negative result (issue #57,
    docs/lab-notes/codebooks.md): a layer that asks for them is one ConfigError saying so."""
    with pytest.raises(ConfigError, match=r"codebook value spec .*removed from kvlens by issue "
                                          r"#57 .*docs/lab-notes/codebooks\.md"):
        LayerKV(QuantSpec(2, "per-channel", 32), CodebookSpec(3), 32)


def test_cache_store_drops_whole_blocks_and_selects_batch_rows():
    spec = CodebookSpec(2)
    store = layout_of(spec).new_store(16, 4)
    assert store.spec.rotation is None and store.codebook is computed_codebook(spec, 16)
    x = torch.randn(3, 2, 12, 16)
    store.append(x)
    full = store.dequantize_range(0, 12)
    store.drop_front(8)
    assert store.length == 4 and store.packed.shape[2] == 4
    torch.testing.assert_close(store.dequantize_range(0, 4), full[:, :, 8:])
    with pytest.raises(ValueError, match="whole blocks"):
        store.drop_front(3)
    store.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(store.dequantize_range(0, 4), full[[2, 0], :, 8:])


def test_codebook_layers_are_read_by_the_kernel():
    """The fused decode kernel reads codebook keys (tests/test_kernels_codebook.py); the
    dispatch rule lets them through and still checks the uniform side."""
    from kvlens.cache.triton_glue import kernel_layout_problem

    keys = LayerKV(CodebookSpec(3, "lloyd-max"), QuantSpec(4, "per-token"), 0)
    assert kernel_layout_problem(keys, 64) is None
    odd = LayerKV(CodebookSpec(3, "lloyd-max"), QuantSpec(4, "per-channel", 24), 48)
    assert "value group 24 per-channel" in kernel_layout_problem(odd, 64)
