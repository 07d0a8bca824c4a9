"""Fused Triton decode attention (``kvlens_kernels.decode_attention``) vs "dequantize with the
reference, then attend".

Runs on CPU through the Triton interpreter. The reference here is written out in float64: the
packed store is quantized with ``kvlens.quant.quantize`` (scales rounded to fp16 as the cache
stores them), dequantized with ``kvlens.quant.dequantize``, concatenated with the residual window
and extra sets at their absolute positions, masked, and attended with an explicit softmax.
Split partials are NaN-poisoned (``POISON_PARTIALS``) and the output starts NaN, so an unwritten
element fails. Odd shapes: T = 1, 31, 33, 257, 1000; D = 64, 128; Hq/Hkv = 1, 3, 4, 8.
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

import kvlens_kernels.decode as kda  # noqa: E402
from kvlens_kernels import KernelInputError  # noqa: E402
from kvlens_kernels import decode_attention as _decode_attention  # noqa: E402

from kvlens.quant import QTensor, QuantSpec, dequantize, pack_codes, quantize  # noqa: E402

#: ``cuda`` runs every kernel call compiled on the GPU (``benchmarks/gpu_check.sh``, with
#: ``TRITON_INTERPRET=0``); the default runs it on CPU under the interpreter.
DEVICE = os.environ.get("KVLENS_KERNEL_TEST_DEVICE", "cpu")


def _to(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(i) for i in x)
    return x


def decode_attention(*args, **kw):
    """The kernel with every tensor argument on ``DEVICE``; the output back on CPU."""
    return _decode_attention(*_to(args), **{k: _to(v) for k, v in kw.items()}).cpu()


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(kda, "POISON_PARTIALS", True)


def _pack(x, spec, dim):
    q = quantize(x, spec)
    scale, zero = q.scale.half(), q.zero.half()
    deq = dequantize(QTensor(q.codes, scale.float(), zero.float(), spec, q.shape))
    return pack_codes(q.codes, spec.bits, dim=dim), scale, zero, deq


def _reference(q, k, v, valid, scaling):
    """softmax over keys ``[B, Hkv, N, D]`` with ``valid [B, Hkv, N]`` (GQA by repeat)."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scaling  # [B, Hq, 1, N]
    ok = valid.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]
    s = s.masked_fill(~ok, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no visible key -> zeros
    return (w @ vv).float()


def _case(seed, b, hq, hkv, d, t, res, kb, vb, gk, gv, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g) * 1.5
    k[..., 3] += 4.0  # an outlier channel, as real keys have
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    n_packed = t - res
    packed = {}
    k_deq, v_deq = k[:, :, :0], v[:, :, :0]
    if n_packed:
        kc, ks, kz, k_deq = _pack(k[:, :, :n_packed], QuantSpec(kb, "per-channel", gk), 2)
        vc, vs, vz, v_deq = _pack(v[:, :, :n_packed], QuantSpec(vb, "per-token", gv), 3)
        packed = dict(k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz)
    else:
        packed = dict(k_codes=None, k_scale=None, k_zero=None, v_codes=None, v_scale=None,
                      v_zero=None)
    res_k = k[:, :, n_packed:].to(dtype)
    res_v = v[:, :, n_packed:].to(dtype)
    full_k = torch.cat((k_deq, res_k.float()), dim=2)
    full_v = torch.cat((v_deq, res_v.float()), dim=2)
    return q.to(dtype), packed, n_packed, res_k, res_v, full_k, full_v


CASES = [
    # (B, Hq, Hkv, D, T, residual, k_bits, v_bits, Gk, Gv, split)
    pytest.param(1, 1, 1, 64, 1, 0, 2, 2, 32, 32, None, id="T1-packed-only-partial-group"),
    pytest.param(1, 3, 1, 128, 1, 1, 4, 4, 64, 64, None, id="T1-residual-only-g3"),
    pytest.param(1, 4, 1, 128, 31, 0, 2, 4, 32, 64, None, id="T31-no-residual-g4"),
    pytest.param(1, 8, 2, 64, 33, 1, 4, 2, 32, 32, 32, id="T33-partial-residual-g4-2splits"),
    pytest.param(1, 8, 1, 128, 257, 32, 2, 2, 32, 32, 64, id="T257-full-residual-g8-4splits"),
    pytest.param(1, 3, 3, 64, 257, 17, 8, 8, 64, 64, None, id="T257-mha3-8bit"),
    pytest.param(1, 4, 2, 128, 1000, 104, 2, 2, 128, 128, 256, id="T1000-G128-g2"),
    pytest.param(2, 4, 4, 64, 1000, 0, 4, 4, 64, 64, 512, id="T1000-B2-mha4"),
]


@pytest.mark.parametrize("b,hq,hkv,d,t,res,kb,vb,gk,gv,split", CASES)
def test_decode_matches_dequantize_then_attend(b, hq, hkv, d, t, res, kb, vb, gk, gv, split):
    q, packed, n_packed, res_k, res_v, full_k, full_v = _case(
        t * 7 + d + hq, b, hq, hkv, d, t, res, kb, vb, gk, gv)
    scaling = 1 / math.sqrt(d)
    out = decode_attention(q, **packed, length=n_packed, k_bits=kb, v_bits=vb, k_group=gk,
                           v_group=gv, scaling=scaling, residual_k=res_k, residual_v=res_v,
                           residual_len=res, split_tokens=split)
    valid = torch.ones(b, hkv, t, dtype=torch.bool)
    ref = _reference(q, full_k, full_v, valid, scaling)
    assert out.shape == (b, hq, 1, d) and out.dtype == q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_masks_balancer_and_mikv_extra_set():
    """Left padding (valid_start), a key mask hole, the channel balancer folded into q, and a
    MiKV-style high-precision set: its tokens are hidden in the packed store (packed_valid) and
    attended from the fp16 copies instead (an extra split)."""
    b, hq, hkv, d, t, res = 2, 4, 2, 64, 257, 33
    q, packed, n_packed, res_k, res_v, full_k, full_v = _case(11, b, hq, hkv, d, t, res,
                                                                2, 2, 32, 32, torch.float16)
    g = torch.Generator().manual_seed(3)
    # Balancer: the store holds k * bal; the model's key is the stored one divided by bal.
    bal = torch.rand(hkv, d, generator=g) + 0.5
    # High-precision set: 5 positions per head (one slot unused: pos -1).
    hp_pos = torch.stack([torch.randperm(n_packed, generator=g)[:5] for _ in range(b * hkv)])
    hp_pos = hp_pos.reshape(b, hkv, 5)
    hp_pos[1, 0, 4] = -1
    hp_k = (torch.randn(b, hkv, 5, d, generator=g)).half()
    hp_v = (torch.randn(b, hkv, 5, d, generator=g)).half()
    packed_valid = torch.ones(b, hkv, n_packed, dtype=torch.bool)
    for bi in range(b):
        for hi in range(hkv):
            for p in hp_pos[bi, hi].tolist():
                if p >= 0:
                    packed_valid[bi, hi, p] = False
    valid_start = torch.tensor([0, 40])
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[0, 100:110] = False
    key_mask[1, n_packed + 5] = False  # a residual token
    scaling = 0.125
    out = decode_attention(q, **packed, length=n_packed, k_bits=2, v_bits=2, k_group=32,
                           v_group=32, scaling=scaling, residual_k=res_k, residual_v=res_v,
                           residual_len=res, extra=[(hp_k, hp_v, hp_pos)],
                           packed_valid=packed_valid, balancer=bal, key_mask=key_mask,
                           valid_start=valid_start, split_tokens=96)
    # Reference: packed keys seen by q/bal  <=>  keys (k_deq / bal) seen by q.
    ref_k = full_k.clone()
    ref_k[:, :, :n_packed] = ref_k[:, :, :n_packed] / bal[None, :, None, :]
    pos = torch.arange(t)
    valid = (key_mask[:, None, :] & (pos[None, None, :] >= valid_start[:, None, None]))
    valid = valid.expand(b, hkv, t).clone()
    valid[:, :, :n_packed] &= packed_valid
    hp_ok = hp_pos >= 0
    hp_idx = hp_pos.clamp_min(0)
    hp_ok &= key_mask.gather(1, hp_idx.reshape(b, -1)).reshape(b, hkv, 5)
    hp_ok &= hp_idx >= valid_start[:, None, None]
    ref = _reference(q.float(), torch.cat((ref_k, hp_k.float()), 2),
                     torch.cat((full_v, hp_v.float()), 2), torch.cat((valid, hp_ok), 2), scaling)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("scale_dtype", ["float16", "8bit"])
def test_reads_the_cache_packed_store_in_place(scale_dtype):
    """The buffers of ``kvlens.layouts.packed.PackedTensor`` (fp16 scales, sized to what they
    hold, also after a sliding layer's eviction) are read as they are, 8-bit metadata as its
    uint8/int8 bytes; reference = the store's own ``dequantize_range``."""
    from kvlens.layouts.packed import PackedTensor

    g = torch.Generator().manual_seed(2)
    b, hq, hkv, d, flush = 1, 4, 2, 128, 64
    k = torch.randn(b, hkv, 3 * flush, d, generator=g)
    v = torch.randn(b, hkv, 3 * flush, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    ks = PackedTensor.create(QuantSpec(2, "per-channel", 32), flush, d, scale_dtype)
    vs = PackedTensor.create(QuantSpec(2, "per-token", 32), flush, d, scale_dtype)
    for i in range(3):  # three flushes, then the oldest block evicted
        ks.append(k[:, :, i * flush:(i + 1) * flush])
        vs.append(v[:, :, i * flush:(i + 1) * flush])
    ks.drop_front(flush)
    vs.drop_front(flush)
    assert ks.capacity == ks.length == 2 * flush
    if scale_dtype == "8bit":  # the stored bytes, decoded by the kernel
        from kvlens.quant.meta8 import zero_unit

        assert ks.zero_unit == vs.zero_unit == zero_unit(2)
        assert ks.scale.dtype == torch.uint8 and vs.zero.dtype == torch.int8
    else:
        assert ks.zero_unit is None
    out = decode_attention(q, ks.codes, ks.scale, ks.zero, vs.codes, vs.scale, vs.zero,
                           ks.length, k_bits=2, v_bits=2, k_group=32, v_group=32,
                           scaling=0.09, k_zero_unit=ks.zero_unit, v_zero_unit=vs.zero_unit)
    ref = _reference(q, ks.dequantize_range(0, ks.length), vs.dequantize_range(0, vs.length),
                     torch.ones(b, hkv, ks.length, dtype=torch.bool), 0.09)
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


META8_CASES = [
    # (Hq, Hkv, D, T, residual, k_bits, v_bits, k layout, v layout, Gk, Gv)
    pytest.param(4, 1, 128, 33, 1, 2, 2, "per-channel", "per-token", 32, 128, id="T33-kivi"),
    pytest.param(3, 3, 64, 257, 17, 4, 2, "per-token", "per-channel", 32, 32, id="T257-swap"),
    pytest.param(8, 2, 64, 257, 0, 8, 4, "per-token", "per-token", 64, 16, id="T257-tok-8b"),
    pytest.param(4, 2, 64, 65, 1, 3, 3, "per-channel", "per-token", 32, 64, id="T65-kivi-3b"),
]


@pytest.mark.parametrize("hq,hkv,d,t,res,kb,vb,kl,vl,gk,gv", META8_CASES)
def test_decodes_8bit_group_metadata_in_the_kernel(hq, hkv, d, t, res, kb, vb, kl, vl, gk, gv):
    """Scales as uint8 codes and zeros as int8 codes (``kvlens.quant.meta8``) are decoded by the
    kernel: the result is the attention over ``dequantize`` of the codec's own ``QTensor``, on
    per-channel and per-token layouts of both tensors and odd lengths."""
    from kvlens.quant.meta8 import quantize_meta8, zero_unit

    g = torch.Generator().manual_seed(t + d + kb)
    k = torch.randn(1, hkv, t, d, generator=g) * 1.5
    k[..., 3] += 40.0  # far off zero: the zero's int8 code does real work
    v = torch.randn(1, hkv, t, d, generator=g)
    q = torch.randn(1, hq, 1, d, generator=g)
    n = t - res
    packed, deq = {}, {}
    for name, x, bits, layout, group in (("k", k, kb, kl, gk), ("v", v, vb, vl, gv)):
        qt, e, z = quantize_meta8(x[:, :, :n], QuantSpec(bits, layout, group))
        assert e.dtype == torch.uint8 and z.dtype == torch.int8 and (z != 0).any()
        packed |= {f"{name}_codes": pack_codes(qt.codes, bits, dim=2 if layout == "per-channel"
                                               else 3),
                   f"{name}_scale": e, f"{name}_zero": z, f"{name}_zero_unit": zero_unit(bits),
                   f"{name}_layout": layout}
        deq[name] = torch.cat((dequantize(qt), x[:, :, n:]), dim=2)
    scaling = 1 / math.sqrt(d)
    out = decode_attention(q, **packed, length=n, k_bits=kb, v_bits=vb, k_group=gk,
                           v_group=None if vl == "per-token" and gv == d else gv,
                           scaling=scaling, residual_k=k[:, :, n:], residual_v=v[:, :, n:],
                           residual_len=res)
    ref = _reference(q, deq["k"], deq["v"], torch.ones(1, hkv, t, dtype=torch.bool), scaling)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)
    # float metadata said to be 8-bit, or the bytes without their unit, is refused
    for wrong in ({"k_scale": packed["k_scale"].float()}, {"v_zero_unit": None}):
        with pytest.raises(KernelInputError, match="k_scale|v_scale"):
            decode_attention(q, **{**packed, **wrong}, length=n, k_bits=kb, v_bits=vb,
                             k_group=gk, v_group=gv, scaling=scaling)
    with pytest.raises(KernelInputError, match="k_zero_unit"):
        decode_attention(q, **{**packed, "k_zero_unit": -1.0}, length=n, k_bits=kb,
                         v_bits=vb, k_group=gk, v_group=gv, scaling=scaling)


def test_no_visible_token_gives_zeros():
    q, packed, n_packed, res_k, res_v, _, _ = _case(5, 1, 2, 1, 64, 33, 1, 2, 2, 32, 32)
    out = decode_attention(q, **packed, length=n_packed, k_bits=2, v_bits=2, k_group=32,
                           v_group=32, scaling=0.1, residual_k=res_k, residual_v=res_v,
                           residual_len=1, valid_start=torch.tensor([1000]))
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_inputs_raise_clear_errors():
    q, packed, n_packed, res_k, res_v, _, _ = _case(5, 1, 4, 2, 64, 33, 1, 2, 2, 32, 32)
    kw = dict(length=n_packed, k_bits=2, v_bits=2, k_group=32, v_group=32, scaling=0.1,
              residual_k=res_k, residual_v=res_v, residual_len=1)
    with pytest.raises(KernelInputError, match="one query token"):
        decode_attention(q.expand(1, 4, 2, 64), **packed, **kw)
    with pytest.raises(KernelInputError, match="multiple of KV heads"):
        decode_attention(q[:, :3], **packed, **kw)
    with pytest.raises(KernelInputError, match="k_group 24"):
        decode_attention(q, **packed, **{**kw, "k_group": 24})
    with pytest.raises(KernelInputError, match="v_group 48"):
        decode_attention(q, **packed, **{**kw, "v_group": 48})
    with pytest.raises(KernelInputError, match="needs all of"):
        decode_attention(q, **{**packed, "k_scale": None}, **kw)
    with pytest.raises(KernelInputError, match="residual_k holds 1 tokens < residual_len 5"):
        decode_attention(q, **packed, **{**kw, "residual_len": 5})
    with pytest.raises(KernelInputError, match="k_codes holds"):
        decode_attention(q, **packed, **{**kw, "length": 64})
    with pytest.raises(KernelInputError, match="split_tokens 40"):
        decode_attention(q, **packed, **kw, split_tokens=40)


def _store(x, spec, block):
    """The cache's own packed store (``kvlens.layouts.packed``) holding ``x`` rounded up to whole
    blocks; returns the store and its kernel group argument."""
    from kvlens.layouts.packed import PackedTensor

    b, h, t, d = x.shape
    st = PackedTensor.create(spec, block, d)
    cap = -(-t // block) * block
    pad = torch.cat((x, torch.randn(b, h, cap - t, d)), 2)
    st.append(pad)
    group = {"per-channel": spec.group_size or block, "per-tensor": block,
             "per-token": spec.group_size}[spec.granularity]
    return st, group


NEW_LAYOUTS = [
    # (k spec, v spec, block F, B, Hq, Hkv, D, T packed, residual, split)
    pytest.param(QuantSpec(2, "per-token", 32), QuantSpec(2, "per-channel", 32), 32,
                 1, 4, 1, 64, 257, 5, 64, id="Ktok32-Vch32-2b-T257-g4-partial-group"),
    pytest.param(QuantSpec(3, "per-token", None), QuantSpec(3, "per-channel", 64), 64,
                 1, 8, 2, 128, 1000, 17, 256, id="KtokNone-Vch64-3b-T1000-D128-splits"),
    pytest.param(QuantSpec(4, "per-tensor"), QuantSpec(4, "per-tensor"), 64,
                 1, 3, 3, 64, 200, 0, None, id="Ktensor-Vtensor-4b-mha"),
    pytest.param(QuantSpec(2, "per-channel", 32), QuantSpec(2, "per-channel", 32), 64,
                 1, 4, 2, 64, 33, 1, None, id="Kch32-Vch32-T33"),
    pytest.param(QuantSpec(4, "per-token", 16), QuantSpec(4, "per-token", 16), 16,
                 2, 6, 2, 64, 31, 3, None, id="Ktok16-Vtok16-4b-B2-T31"),
    pytest.param(QuantSpec(3, "per-channel", None), QuantSpec(3, "per-token", 32), 32,
                 1, 3, 1, 64, 95, 32, 32, id="KchNone-Vtok32-3b"),
    # dense widths whose codes straddle bytes: every load site of the kernel
    pytest.param(QuantSpec(3, "per-tensor"), QuantSpec(5, "per-tensor"), 64,
                 1, 4, 2, 64, 131, 3, None, id="Ktensor3-Vtensor5-odd"),
    pytest.param(QuantSpec(6, "per-channel", 32), QuantSpec(7, "per-token", 16), 32,
                 1, 2, 1, 64, 97, 0, None, id="Kch6-Vtok7"),
]


@pytest.mark.parametrize("ks,vs,block,b,hq,hkv,d,t,res,split", NEW_LAYOUTS)
def test_decode_new_layouts_match_reference(ks, vs, block, b, hq, hkv, d, t, res, split):
    """Per-token keys, per-channel values, per-tensor, G=None, 3-bit codes: the kernel reads the
    cache's own buffers; reference = the store's dequantize_range (the reference quantizer,
    tested in test_cache.py), then attend. Left padding + a mask hole in batch 2."""
    g = torch.Generator().manual_seed(t + d)
    k = torch.randn(b, hkv, t + res, d, generator=g)
    k[..., 3] += 4.0
    v = torch.randn(b, hkv, t + res, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    kst, kg = _store(k[:, :, :t], ks, block)
    vst, vg = _store(v[:, :, :t], vs, block)
    rk, rv = k[:, :, t:].half(), v[:, :, t:].half()
    valid_start = torch.tensor([0, 7][:b])
    key_mask = torch.ones(b, t + res, dtype=torch.bool)
    key_mask[-1, t // 2] = False
    out = decode_attention(q, kst.codes, kst.scale, kst.zero, vst.codes, vst.scale, vst.zero, t,
                           k_bits=ks.bits, v_bits=vs.bits, k_group=kg, v_group=vg,
                           k_layout=ks.granularity, v_layout=vs.granularity, scaling=d ** -0.5,
                           residual_k=rk, residual_v=rv, residual_len=res, key_mask=key_mask,
                           valid_start=valid_start, split_tokens=split)
    cap = kst.length
    full_k = torch.cat((kst.dequantize_range(0, cap)[:, :, :t], rk.float()), 2)
    full_v = torch.cat((vst.dequantize_range(0, cap)[:, :, :t], rv.float()), 2)
    pos = torch.arange(t + res)
    valid = (key_mask & (pos[None] >= valid_start[:, None]))[:, None].expand(b, hkv, t + res)
    ref = _reference(q, full_k, full_v, valid, d ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_per_token_keys_balancer_folded_into_q():
    """Per-token keys stored balanced (``k * bal``), per-channel values: q / bal is folded into
    the grouped query."""
    g = torch.Generator().manual_seed(12)
    b, hq, hkv, d, t = 1, 4, 2, 64, 130
    ks, vs = QuantSpec(2, "per-token", 32), QuantSpec(2, "per-channel", 64)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    bal = torch.rand(hkv, d, generator=g) + 0.5
    kst, kg = _store(k * bal[:, None], ks, 64)
    vst, vg = _store(v, vs, 64)
    out = decode_attention(q, kst.codes, kst.scale, kst.zero, vst.codes, vst.scale, vst.zero, t,
                           k_bits=2, v_bits=2, k_group=kg, v_group=vg, k_layout="per-token",
                           v_layout="per-channel", scaling=0.125, balancer=bal)
    keys = kst.dequantize_range(0, kst.length)[:, :, :t] / bal[:, None]
    ref = _reference(q, keys, vst.dequantize_range(0, vst.length)[:, :, :t],
                     torch.ones(b, hkv, t, dtype=torch.bool), 0.125)
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("ks", [QuantSpec(2, "per-token", 32), QuantSpec(3, "per-channel", 32)])
def test_balancer_per_batch_row_and_its_shape_check(ks):
    """A balancer given per batch row (``[B, Hkv, D]``): the store holds ``k * bal[b]`` and the
    kernel divides each row's query by its own, so attention equals the reference over
    ``deq / bal[b]`` packed keys beside exact window keys; a balancer of the wrong head_dim is
    refused by name."""
    g = torch.Generator().manual_seed(21)
    b, hq, hkv, d, t, res = 2, 4, 2, 64, 130, 7
    k = torch.randn(b, hkv, t + res, d, generator=g)
    v = torch.randn(b, hkv, t + res, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    bal = torch.rand(b, hkv, d, generator=g) * 3 + 0.25
    kst, kg = _store(k[:, :, :t] * bal[:, :, None], ks, 64)
    vst, vg = _store(v[:, :, :t], QuantSpec(2, "per-token", 32), 64)
    rk, rv = k[:, :, t:].half(), v[:, :, t:].half()
    kw = dict(k_bits=ks.bits, v_bits=2, k_group=kg, v_group=vg, k_layout=ks.granularity,
              v_layout="per-token", scaling=0.125)
    out = decode_attention(q, kst.codes, kst.scale, kst.zero, vst.codes, vst.scale, vst.zero, t,
                           residual_k=rk, residual_v=rv, residual_len=res, balancer=bal, **kw)
    keys = kst.dequantize_range(0, kst.length)[:, :, :t] / bal[:, :, None]
    full_k = torch.cat((keys, rk.float()), 2)
    full_v = torch.cat((vst.dequantize_range(0, vst.length)[:, :, :t], rv.float()), 2)
    ref = _reference(q, full_k, full_v, torch.ones(b, hkv, t + res, dtype=torch.bool), 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)
    with pytest.raises(KernelInputError, match="balancer"):
        decode_attention(q, kst.codes, kst.scale, kst.zero, vst.codes, vst.scale, vst.zero, t,
                         balancer=bal[..., :8], **kw)


def test_new_layout_inputs_raise_clear_errors():
    q = torch.randn(1, 2, 1, 64)
    kst, _ = _store(torch.randn(1, 1, 64, 64), QuantSpec(2, "per-token", 32), 64)
    vst, _ = _store(torch.randn(1, 1, 64, 64), QuantSpec(2, "per-channel", 32), 64)
    args = (q, kst.codes, kst.scale, kst.zero, vst.codes, vst.scale, vst.zero, 64)
    kw = dict(k_bits=2, v_bits=2, k_group=32, v_group=32, k_layout="per-token",
              v_layout="per-channel", scaling=0.1)
    with pytest.raises(KernelInputError, match="k_layout 'per-row'"):
        decode_attention(*args, **{**kw, "k_layout": "per-row"})
    with pytest.raises(KernelInputError, match="v_group is required for per-channel"):
        decode_attention(*args, **{**kw, "v_group": None})
    with pytest.raises(KernelInputError, match="k_group 8 must divide head_dim 64 and be >= 16"):
        decode_attention(*args, **{**kw, "k_group": 8})
    with pytest.raises(KernelInputError, match="k_codes has shape"):  # keys given as per-channel
        decode_attention(*args, **{**kw, "k_layout": "per-channel"})


def test_kernel_layout_constants_match_kvlens():
    """kvlens_kernels restates the packing geometry and 8-bit metadata constants (it imports
    nothing of kvlens); they must equal kvlens' own definitions."""
    from kvlens_kernels import _common

    from kvlens.quant import meta8, packing

    for bits in range(1, 9):
        assert _common.pack_unit(bits) == packing.pack_unit(bits)
    assert (_common.META8_SCALE_BIAS, _common.META8_SCALE_STEPS) == (meta8.SCALE_BIAS,
                                                                       meta8.SCALE_STEPS)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(KernelInputError, match="bits must be an integer in 1..8"):
            _common.pack_unit(bad)
