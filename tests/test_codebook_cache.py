"""kvlens.cache.codebook: the coded store holds what CodebookSpec.held_bytes reports, and the
folded torch read path equals dequantize-then-attend on odd shapes."""

from __future__ import annotations

import pytest
import torch

from kvlens.analysis.metrics import attention_output
from kvlens.cache.codebook import CodebookStore, codebook_attention
from kvlens.errors import InputError
from kvlens.quant.codebook import CodebookSpec, codebook_for, lloyd_max
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
    from kvlens.quant.codebook import fake_quantize_codebook

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
