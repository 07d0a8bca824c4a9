"""kvlens.cache.codebook: the coded store holds what CodebookSpec.held_bytes reports, and the
folded torch read path equals dequantize-then-attend on odd shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import reference_attention, stored_view, stub_session

from kvlens.analysis.metrics import attention_output
from kvlens.cache.codebook import CodebookStore, codebook_attention
from kvlens.cache.layer import CompressedLayer
from kvlens.cache.torch_read import packed_attention
from kvlens.config import LayerKV, MikvSettings
from kvlens.errors import ConfigError, InputError
from kvlens.quant import QuantSpec, fake_quantize_codebook, hadamard_rotation, packed_length
from kvlens.quant.codebook import (
    CodebookSpec,
    codebook_for,
    dequantize_codebook,
    lloyd_max,
    quantize_codebook,
)
from kvlens.quant.rotation import RotationSpec


def _stores(spec_k, spec_v, k, v, chunks=(5, 1, 11)):
    ks = CodebookStore(spec_k, codebook_for(k, spec_k), k.shape[-1])
    vs = CodebookStore(spec_v, codebook_for(v, spec_v), v.shape[-1])
    t0 = 0
    for c in (*chunks, k.shape[2]):  # appended in uneven pieces, as decoding does
        t1 = min(k.shape[2], t0 + c)
        if t1 > t0:
            ks.append(k[:, :, t0:t1])
            vs.append(v[:, :, t0:t1])
        t0 = t1
    return ks, vs


@pytest.mark.parametrize(
    "b,hq,hkv,t,tq,d,bits,renorm,fitted,chunk",
    [
        (1, 3, 1, 37, 1, 24, 3, False, False, 8),   # decode step, block Hadamard (24 = 3 x 8)
        (2, 4, 2, 29, 29, 16, 2, True, True, 7),    # prefill, GQA, renormalised, fitted
        (1, 2, 2, 50, 5, 64, 4, True, False, 64),   # one chunk
        (2, 6, 3, 19, 3, 10, 5, False, True, 4),    # 5-bit codes, head_dim 10 (5 x 2)
    ],
)
def test_read_path_matches_reference(b, hq, hkv, t, tq, d, bits, renorm, fitted, chunk):
    gen = torch.Generator().manual_seed(bits * 100 + d)
    q = torch.randn(b, hq, tq, d, generator=gen)
    k = torch.randn(b, hkv, t, d, generator=gen) + torch.randn(d, generator=gen)
    v = torch.randn(b, hkv, t, d, generator=gen)
    kind = "fitted" if fitted else "lloyd-max"
    spec = CodebookSpec(bits, kind, RotationSpec(seed=4), renormalize=renorm)
    ks, vs = _stores(spec, spec, k, v)
    assert ks.length == t
    ours = codebook_attention(q, ks, vs, scaling=d ** -0.5, chunk_tokens=chunk)
    ref = attention_output(q, ks.dequantize(), vs.dequantize(), scaling=d ** -0.5)
    assert ours.shape == (b, hq, tq, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,bits,d", [("lloyd-max", 3, 64), ("fitted", 3, 64),
                                          ("fitted", 2, 24), ("lloyd-max", 5, 10)])
def test_held_bytes_equal_reported(kind, bits, d):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 21, d, generator=gen)
    spec = CodebookSpec(bits, kind)
    store, _ = _stores(spec, spec, x, x)
    assert store.held_bytes() == store.reported_bytes() == spec.held_bytes(2 * 3 * 21, d)
    assert CodebookStore(spec, codebook_for(x, spec), d).held_bytes() == 0


def test_store_round_trip_equals_reference_quantizer():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 13, 32, generator=gen)
    spec = CodebookSpec(3)
    store, _ = _stores(spec, spec, x, x)
    torch.testing.assert_close(store.dequantize(), fake_quantize_codebook(x, spec))


def test_bad_shapes():
    spec = CodebookSpec(2)
    store = CodebookStore(spec, lloyd_max(2, 8), 8)
    with pytest.raises(InputError, match=r"Expected \[B, H, t, 8\]"):
        store.append(torch.randn(1, 1, 3, 16))
    store.append(torch.randn(1, 1, 3, 8))
    with pytest.raises(InputError, match="does not fit"):
        codebook_attention(torch.randn(1, 1, 4, 8), store, store, 1.0)
    with pytest.raises(InputError, match="cannot code"):
        CodebookStore(CodebookSpec(3), lloyd_max(2, 8), 8)


# -- codebook values in the compressed cache (a KVConfig value layout) --------------------------


@pytest.mark.parametrize("bits,fitted,renorm,flush,total,sinks", [
    (3, True, True, 0, 80, 0),     # recommend's layout, KIVI whole-window flush
    (2, True, True, 16, 134, 4),   # sliding block, sinks kept exact
    (3, False, False, 16, 77, 0),  # Lloyd-Max (nothing stored), no renorm
    (4, True, False, 0, 131, 4),
])
def test_cache_layer_codebook_values_equal_reference(bits, fitted, renorm, flush, total, sinks):
    """A CompressedLayer storing codebook values (rotated window, packed codes + norms) beside
    per-channel keys, decoded token by token, batch 2 with row 1 left-padded, GQA 6/2, several
    chunks: its attention equals "rotate, code with the reference quantizer, attend, un-rotate"
    with the window (and sinks) exact."""
    torch.manual_seed(total + bits)
    b, hq, hkv, d, r = 2, 6, 2, 32, 32
    rot = hadamard_rotation(d, 5)
    kspec = QuantSpec(2, "per-channel", 16)
    kind = "fitted" if fitted else "lloyd-max"
    vspec = CodebookSpec(bits, kind, RotationSpec(5), renormalize=renorm)
    v = torch.randn(b, hkv, total, d) * torch.rand(1, 1, total, 1) * 3
    k = torch.randn(b, hkv, total, d)
    book = codebook_for(v, vspec) if fitted else None
    cents = None if book is None else book.centroids.half().float()
    setting = LayerKV(kspec, vspec, residual_tokens=r, flush_tokens=flush)
    assert setting.rotate_values  # the codebook's rotation is the layer's value rotation
    mikv = MikvSettings(0.0, sinks, "off") if sinks else None
    layer = CompressedLayer(setting, 0, d, rotation=rot, mikv=mikv, session=stub_session(),
                            value_centroids=cents)
    seen = total - 1
    layer.update(k[:, :, :41], v[:, :, :41])
    layer.commit(torch.randn(b, hq, 41, d), None)
    for t in range(41, seen):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    n_q = layer.quantized_length
    assert n_q >= r and layer.n_res > 0
    parts = dict(layer.named_tensors())
    assert parts["codes"].shape == (b, hkv, n_q, packed_length(d, bits))
    assert parts["norms"].dtype == torch.float16
    assert ("codebooks" in parts) == fitted
    # reference, in the rotated basis the layer stores: fp16 window of v R, the flushed part
    # coded by the reference quantizer, the sinks exact (from the window copy), then R^T
    vr = (v[:, :, :seen] @ rot).half().float()
    ref_book = None if book is None else replace(book, centroids=cents)
    coded = fake_quantize_codebook(vr[:, :, :n_q], replace(vspec, rotation=None), ref_book)
    coded[:, :, :sinks] = vr[:, :, :sinks]
    values = torch.cat((coded, vr[:, :, n_q:]), 2) @ rot.T
    keys = stored_view(k[:, :, :seen], kspec, flush or r, n_q)
    keys[:, :, :sinks] = k[:, :, :sinks].half().float()
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :9] = False
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(q, layer, mask, d ** -0.5, chunk_tokens=32)
    out = layer.from_stored_basis(out)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,fitted,renorm,r,flush,total,d,vbook", [
    (3, False, True, 0, 0, 37, 32, False),   # turboquant_k3v4_nc's layout: no window
    (4, False, True, 0, 0, 53, 24, True),    # odd head_dim (Hadamard blocks of 8), codebook V
    (2, True, False, 16, 8, 70, 32, False),  # fitted keys, sliding block
    (3, True, True, 32, 0, 81, 24, True),    # whole-window flushes, both tensors coded
])
def test_cache_layer_codebook_keys_equal_reference(bits, fitted, renorm, r, flush, total, d,
                                                   vbook):
    """A CompressedLayer storing codebook keys (rotated window, packed codes + norms, scores
    from the rotated query times the centroid lookups times each key's scale) beside uniform
    per-token or codebook values, prefilled then decoded token by token, batch 2 with row 1
    left-padded, GQA 6/2: its attention equals "rotate, code the keys with the reference
    quantizer, un-rotate, attend" with the window exact."""
    torch.manual_seed(total + bits)
    b, hq, hkv = 2, 6, 2
    rot = hadamard_rotation(d, 7)
    kind = "fitted" if fitted else "lloyd-max"
    kspec = CodebookSpec(bits, kind, RotationSpec(7), renormalize=renorm)
    vspec = CodebookSpec(3, rotation=RotationSpec(7)) if vbook else QuantSpec(4, "per-token")
    k = torch.randn(b, hkv, total, d) * torch.rand(1, 1, total, 1) * 3
    k[:, :, 0] *= 20  # an outlier token (the attention sink of real keys)
    v = torch.randn(b, hkv, total, d)
    book = codebook_for(k, kspec) if fitted else None
    cents = None if book is None else book.centroids.half().float()
    setting = LayerKV(kspec, vspec, residual_tokens=r, flush_tokens=flush)
    assert setting.rotate_keys and setting.rotate_values == vbook
    layer = CompressedLayer(setting, 0, d, rotation=rot, session=stub_session(),
                            key_centroids=cents)
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
    assert ("codebooks" in parts) == fitted
    kr = (k[:, :, :seen] @ rot).half().float()  # the fp16 window of k R the blocks come from
    ref_book = None if book is None else replace(book, centroids=cents)
    coded = fake_quantize_codebook(kr[:, :, :n_q], replace(kspec, rotation=None), ref_book)
    keys = torch.cat((coded, kr[:, :, n_q:]), 2) @ rot.T
    if vbook:
        vr = (v[:, :, :seen] @ rot).half().float()
        vc = fake_quantize_codebook(vr[:, :, :n_q], replace(vspec, rotation=None))
        values = torch.cat((vc, vr[:, :, n_q:]), 2) @ rot.T
    else:
        values = stored_view(v[:, :, :seen], vspec, flush or r or 1, n_q)
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :5] = False
    q = torch.randn(b, hq, 1, d)
    out, _ = packed_attention(layer.to_stored_basis(q, True), layer, mask, d ** -0.5,
                              chunk_tokens=16)
    out = layer.from_stored_basis(out)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)


def _offset_keys(b, hkv, total, d, gen, outlier=True):
    """Keys with a per-(head, channel) offset 4x their spread, the case centring is for, and
    (``outlier``) an outlier first token."""
    k = torch.randn(b, hkv, total, d, generator=gen) * torch.rand(1, 1, total, 1, generator=gen)
    k = k + 4.0 * torch.randn(hkv, d, generator=gen)[None, :, None]
    if outlier:
        k[:, :, 0] *= 5
    return k


def _centred_codebook_layer(kspec, vspec, k, v, r, flush, rot, mu, cents=None, center=True):
    """A layer with codebook keys (centred on ``mu`` when ``center``), prefilled with 19 tokens
    then decoded one token at a time up to all but the last of ``k``."""
    b, hkv, total, d = k.shape
    setting = LayerKV(kspec, vspec, residual_tokens=r, flush_tokens=flush, center_keys=center)
    layer = CompressedLayer(setting, 0, d, rotation=rot, session=stub_session(),
                            key_centroids=cents, key_mean=mu if center else None)
    layer.update(k[:, :, :19], v[:, :, :19])
    layer.commit(torch.randn(b, 3 * hkv, 19, d), None)
    for t in range(19, total - 1):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, 3 * hkv, 1, d), None)
    return layer


@pytest.mark.parametrize("bits,fitted,renorm,r,flush,total,d", [
    (4, False, True, 0, 0, 45, 32),   # TurboQuant 4-bit _nc's key coding: no window
    (3, False, False, 16, 8, 70, 24),  # odd head_dim (Hadamard blocks of 8), sliding block
    (3, True, True, 32, 0, 81, 32),   # fitted key centroids, whole-window flushes
    (2, True, False, 16, 0, 66, 24),
])
def test_centred_codebook_keys_equal_reference(bits, fitted, renorm, r, flush, total, d):
    """Centred codebook keys (``center_keys``): the layer codes ``k R - mu R`` and its scores
    get ``q · mu`` back, so prefill then decode, batch 2 with row 1 left-padded, GQA 6/2 and a
    window equals "centre, rotate, code with the reference quantizer, un-rotate, add mu back,
    attend" with the window exact. The stored codes are those of the centred keys (and differ
    from an uncentred layer's), so a path that ignored the mean on either side fails."""
    gen = torch.Generator().manual_seed(total + bits)
    b, hq, hkv = 2, 6, 2
    rot = hadamard_rotation(d, 7)
    kspec = CodebookSpec(bits, "fitted" if fitted else "lloyd-max", RotationSpec(7),
                         renormalize=renorm)
    vspec = QuantSpec(4, "per-token")
    k, v = _offset_keys(b, hkv, total, d, gen), torch.randn(b, hkv, total, d, generator=gen)
    mu = k.mean(dim=(0, 2)).half()  # post-RoPE mean per KV head, float16 as the config holds it
    mu_r = mu.float() @ rot  # the mean in the stored (rotated) basis
    kr = (k[:, :, :total - 1] @ rot).half().float()  # the fp16 window of k R
    book = codebook_for(kr - mu_r[None, :, None], kspec) if fitted else None
    cents = None if book is None else book.centroids.half().float()
    layer = _centred_codebook_layer(kspec, vspec, k, v, r, flush, rot, mu, cents)
    seen, n_q = total - 1, layer.quantized_length
    assert n_q > 0 and (layer.n_res > 0) == (r > 0)
    assert torch.equal(layer.key_mean, mu) and "means" in dict(layer.named_tensors())
    # the store holds the reference codes of the centred, rotated keys
    ref_book = layer.kstore.codebook
    centred = kr[:, :, :n_q] - mu_r[None, :, None]
    qt = quantize_codebook(centred, replace(kspec, rotation=None), ref_book)
    assert torch.equal(layer.kstore.packed, qt.packed())
    assert torch.equal(layer.kstore.norms, qt.norms)
    plain = _centred_codebook_layer(kspec, vspec, k, v, r, flush, rot, mu, cents, center=False)
    assert not torch.equal(plain.kstore.packed, layer.kstore.packed)
    # reference: un-rotate the decoded centred keys, add mu back; the window exact
    coded = dequantize_codebook(qt) @ rot.T + mu.float()[None, :, None]
    keys = torch.cat((coded, kr[:, :, n_q:] @ rot.T), 2)
    values = stored_view(v[:, :, :seen], vspec, flush or r or 1, n_q)
    mask = torch.ones(b, 1, 1, seen, dtype=torch.bool)
    mask[1, ..., :5] = False
    q = torch.randn(b, hq, 1, d, generator=gen)
    out, _ = packed_attention(layer.to_stored_basis(q, True), layer, mask, d ** -0.5,
                              chunk_tokens=16)
    torch.testing.assert_close(out, reference_attention(q, keys, values, mask),
                               rtol=1e-5, atol=1e-5)


def test_centring_shrinks_the_error_of_offset_codebook_keys():
    """Planted: keys with a per-channel offset 4x their spread (no outlier token). A codebook
    codes each key's direction and norm, so its error grows with the norm the offset inflates;
    centred, the same 3-bit codes give a much closer attention output (about 5x here)."""
    gen = torch.Generator().manual_seed(12)
    b, hkv, total, d = 2, 2, 90, 32
    rot = hadamard_rotation(d, 7)
    kspec = CodebookSpec(3, rotation=RotationSpec(7), renormalize=True)
    k = _offset_keys(b, hkv, total, d, gen, outlier=False)
    v = torch.randn(b, hkv, total, d, generator=gen)
    mu = k.mean(dim=(0, 2)).half()
    q = torch.randn(b, 6, 1, d, generator=gen)
    mask = torch.ones(b, 1, 1, total - 1, dtype=torch.bool)
    exact = reference_attention(q, k[:, :, :total - 1], v[:, :, :total - 1], mask)
    err = {}
    for center in (False, True):
        layer = _centred_codebook_layer(kspec, QuantSpec(8, "per-token"), k, v, 0, 0, rot, mu,
                                        center=center)
        out, _ = packed_attention(layer.to_stored_basis(q, True), layer, mask, d ** -0.5)
        err[center] = float((out - exact).norm() / exact.norm())
    assert err[True] < 0.4 * err[False], err


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


def test_cache_store_drops_whole_blocks_and_selects_batch_rows():
    spec = CodebookSpec(2)
    store = CodebookStore.for_cache(spec, None, 16, block=4)
    assert store.spec.rotation is None and store.centroids is None
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
    with pytest.raises(InputError, match="needs its centroids"):
        CodebookStore.for_cache(CodebookSpec(2, "fitted"), None, 16, block=4)


def test_codebook_layers_are_read_by_the_kernel():
    """The fused decode kernel reads codebook keys and values (tests/test_kernels_codebook.py);
    the dispatch rule lets them through and still checks the uniform side."""
    from kvlens.cache.triton_glue import kernel_layout_problem

    setting = LayerKV(QuantSpec(2, "per-channel", 32), CodebookSpec(3, "lloyd-max"), 32)
    assert kernel_layout_problem(setting, 64) is None
    keys = LayerKV(CodebookSpec(3, "lloyd-max"), QuantSpec(4, "per-token"), 0)
    assert kernel_layout_problem(keys, 64) is None
    odd = LayerKV(CodebookSpec(3, "lloyd-max"), QuantSpec(4, "per-channel", 24), 48)
    assert "value group 24 per-channel" in kernel_layout_problem(odd, 64)
