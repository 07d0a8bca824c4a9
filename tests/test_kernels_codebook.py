"""Codebook-coded keys in the fused Triton decode kernel (``decode_attention`` with ``k_layout``
``"codebook"``: vLLM TurboQuant's keys) vs "dequantize with the reference, then attend".

Runs on CPU through the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``
before triton loads). The codebook side is coded with the reference quantizer
(``kvlens.quant.codebook.quantize_codebook``: codes packed along channels, float16 norms) and
decoded with ``dequantize_codebook``; the uniform side with ``kvlens.quant.quantize``; the
reference attends in float64 (``test_kernels_decode._reference``'s formula). Partials are
NaN-poisoned. Odd shapes: head_dim 64 and 256, token counts 37, 45, 70, 101; GQA 3 and 2;
2, 3 and 4 bits; the Lloyd-Max codebooks with float32 or float16 tables; renormalised or not;
beside per-token and per-channel values (codebook values were removed by issue #57: the kernel
refuses them); a residual window, left padding and a mask hole. Then the cache: a
``CompressedLayer`` with codebook keys read by ``triton_decode`` equals its torch path, and a
tiny Llama generates the same tokens with both backends.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model

triton = pytest.importorskip("triton")

import kvlens_kernels.decode as kda  # noqa: E402
from kvlens_kernels import KernelInputError  # noqa: E402
from kvlens_kernels import decode_attention as _decode_attention  # noqa: E402

from kvlens.cache import compressed_attention  # noqa: E402
from kvlens.cache.layer import CompressedLayer  # noqa: E402
from kvlens.cache.torch_read import packed_attention  # noqa: E402
from kvlens.cache.triton_glue import kernel_layout_problem, triton_decode  # noqa: E402
from kvlens.config import KVConfig, LayerKV, ProtectSettings  # noqa: E402
from kvlens.config.engine import TurboQuantSetting  # noqa: E402
from kvlens.model.hooks import cache_argument_name  # noqa: E402
from kvlens.quant import (  # noqa: E402
    QTensor,
    QuantSpec,
    dequantize,
    hadamard_rotation,
    pack_codes,
    quantize,
)
from kvlens.quant.codebook import (  # noqa: E402
    CodebookSpec,
    computed_codebook,
    dequantize_codebook,
    quantize_codebook,
)
from kvlens.quant.rotation import RotationSpec  # noqa: E402

#: ``cuda`` runs the direct kernel calls compiled on the GPU (``benchmarks/gpu_check.sh``, with
#: ``TRITON_INTERPRET=0``; the cache tests, which run the interpreter on CPU, are skipped then).
DEVICE = os.environ.get("KVLENS_KERNEL_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="runs the interpreter on CPU tensors")


def decode_attention(*args, **kw):
    """The kernel with every tensor argument on ``DEVICE``; the output back on CPU."""
    def to(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    return _decode_attention(*map(to, args), **{k: to(v) for k, v in kw.items()}).cpu()


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(kda, "POISON_PARTIALS", True)


def _coded(which, x, spec, half=False):
    """The kernel's arguments for ``x`` ``[B, H, T, D]`` coded with ``spec`` and what they
    decode to (float32, the basis the kernel reads: a rotated codebook's rotated basis);
    ``half``: the centroid table passed as float16 (and coded with those values)."""
    if isinstance(spec, CodebookSpec):
        book = computed_codebook(spec, x.shape[-1])
        if half:
            book = replace(book, centroids=book.centroids.half().float())
        qt = quantize_codebook(x, spec, book)
        deq = dequantize_codebook(replace(qt, spec=replace(spec, rotation=None)))
        table = book.centroids.half() if half else book.centroids
        return (qt.packed(), qt.norms, None), {
            f"{which}_layout": "codebook", f"{which}_group": None, f"{which}_bits": spec.bits,
            f"{which}_centroids": table, f"{which}_renormalize": spec.renormalize}, deq
    q = quantize(x, spec)
    scale, zero = q.scale.half(), q.zero.half()
    deq = dequantize(QTensor(q.codes, scale.float(), zero.float(), spec, q.shape))
    packed = pack_codes(q.codes, spec.bits, dim=2 if spec.granularity == "per-channel" else 3)
    return (packed, scale, zero), {f"{which}_layout": spec.granularity,
                                   f"{which}_group": spec.group_size,
                                   f"{which}_bits": spec.bits}, deq


def _reference(q, k, v, valid, scaling):
    """softmax over keys ``[B, Hkv, N, D]`` with ``valid [B, Hkv, N]`` (GQA by repeat), float64."""
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scaling
    s = s.masked_fill(~valid.repeat_interleave(g, dim=1)[:, :, None, :], float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vv).float()


LLOYD, NORMAL = "lloyd-max", "lloyd-max-normal"
CASES = [
    # (B, Hq, Hkv, D, T packed, residual, key spec, value spec, split, float16 tables)
    pytest.param(1, 3, 1, 64, 37, 5, CodebookSpec(3, LLOYD, None, renormalize=True),
                 QuantSpec(3, "per-token", 32), None, True, id="keys-3b-D64-T37-g3-window"),
    pytest.param(2, 3, 1, 256, 45, 0, CodebookSpec(4, NORMAL, None, renormalize=True),
                 QuantSpec(4, "per-token", 32), None, True, id="keys-4b-fp16-D256-T45-B2"),
    pytest.param(2, 6, 2, 64, 70, 3, CodebookSpec(2, LLOYD, None),
                 QuantSpec(2, "per-channel", 32), 32, False, id="keys-2b-vch-D64-T70-g3-splits"),
    pytest.param(1, 4, 2, 256, 101, 7, CodebookSpec(2, NORMAL, None),
                 QuantSpec(4, "per-token", 64), 64, False, id="keys-2b-v4b-D256-T101-g2"),
    pytest.param(1, 3, 1, 64, 37, 0, CodebookSpec(3, NORMAL, None, renormalize=True),
                 QuantSpec(4, "per-token"), None, False, id="turboquant-k3v4-layout"),
]


@pytest.mark.parametrize("b,hq,hkv,d,t,res,kspec,vspec,split,half", CASES)
def test_codebook_decode_matches_dequantize_then_attend(b, hq, hkv, d, t, res, kspec, vspec,
                                                         split, half):
    """Keys scored as ``s_t * (q . c[code_t])`` in the kernel equal attention over the
    reference's dequantized vectors; row 2 of a batch is left-padded and every row has a masked
    token (one in the window when there is one)."""
    g = torch.Generator().manual_seed(t + d + hq)
    k = torch.randn(b, hkv, t + res, d, generator=g) * torch.rand(1, 1, t + res, 1, generator=g)
    k[..., 3] += 3.0
    v = torch.randn(b, hkv, t + res, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    (kc, ks, kz), kw_k, k_deq = _coded("k", k[:, :, :t], kspec, half)
    (vc, vs, vz), kw_v, v_deq = _coded("v", v[:, :, :t], vspec, half)
    rk, rv = k[:, :, t:].half(), v[:, :, t:].half()
    key_mask = torch.ones(b, t + res, dtype=torch.bool)
    key_mask[:, t // 3] = False
    if res:
        key_mask[0, t + res - 1] = False  # a window token
    valid_start = torch.tensor([0, 9][:b])
    scaling = 1 / math.sqrt(d)
    out = decode_attention(q, kc, ks, kz, vc, vs, vz, t, **kw_k, **kw_v, scaling=scaling,
                           residual_k=rk, residual_v=rv, residual_len=res, key_mask=key_mask,
                           valid_start=valid_start, split_tokens=split)
    pos = torch.arange(t + res)
    valid = (key_mask & (pos[None] >= valid_start[:, None]))[:, None].expand(b, hkv, t + res)
    ref = _reference(q, torch.cat((k_deq, rk.float()), 2), torch.cat((v_deq, rv.float()), 2),
                     valid, scaling)
    assert out.shape == (b, hq, 1, d) and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_rotated_codebooks_are_read_in_the_rotated_basis():
    """The kernel reads what the store holds, the rotated keys: given ``q R`` it scores them as
    attention over the reference's un-rotated decode scores them. A kernel that forgot the
    renormalisation or the scale would miss by far more than the tolerance: the same call
    without ``renormalize`` differs."""
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, t = 1, 3, 1, 64, 50
    rot = RotationSpec(seed=3)
    spec = CodebookSpec(3, LLOYD, rot, renormalize=True)
    k = torch.randn(b, hkv, t, d, generator=g) * 2
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    (kc, ks, _), kw_k, _ = _coded("k", k, spec)
    (vc, vs, vz), kw_v, v_ref = _coded("v", v, QuantSpec(4, "per-token", 32))
    book = computed_codebook(spec, d)
    k_ref = dequantize_codebook(quantize_codebook(k, spec, book))  # original basis
    r = rot.matrix(d, q.device)
    out = decode_attention(q @ r, kc, ks, None, vc, vs, vz, t, **kw_k, **kw_v, scaling=0.125)
    ref = _reference(q, k_ref, v_ref, torch.ones(b, hkv, t, dtype=torch.bool), 0.125)
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)
    plain = decode_attention(q @ r, kc, ks, None, vc, vs, vz, t,
                             **{**kw_k, "k_renormalize": False}, **kw_v, scaling=0.125)
    assert (plain - ref).abs().max() > 1e-2


def test_codebook_inputs_raise_clear_errors():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 1, 40, 64, generator=g), torch.randn(1, 1, 40, 64, generator=g)
    q = torch.randn(1, 2, 1, 64, generator=g)
    (kc, ks, _), kw_k, _ = _coded("k", k, CodebookSpec(3, LLOYD, None))
    (vc, vs, vz), kw_v, _ = _coded("v", v, QuantSpec(2, "per-token", 32))
    args = (q, kc, ks, None, vc, vs, vz, 40)
    kw = {**kw_k, **kw_v, "scaling": 0.1}
    decode_attention(*args, **kw)  # the valid call
    for change, message in (
            ({"k_centroids": None}, "k_layout 'codebook' needs k_centroids: the 8 centroids"),
            ({"k_centroids": kw_k["k_centroids"][:4]}, r"k_centroids has shape \[4\]"),
            ({"k_centroids": kw_k["k_centroids"].double()}, "k_centroids has dtype"),
            ({"k_group": 32}, "k_group must be None for k_layout 'codebook'"),
            ({"k_zero_unit": 1.0}, "k_zero_unit must be None for k_layout 'codebook'"),
            ({"k_renormalize": 1}, "k_renormalize must be True or False"),
            ({"k_layout": "codebooks"}, "k_layout 'codebooks' is not a packed layout"),
            # codebook values were removed (issue #57): no config can store them
            ({"v_layout": "codebook"}, "v_layout 'codebook' is not a packed layout; allowed: "
                                       "per-channel, per-token, per-tensor")):
        with pytest.raises(KernelInputError, match=message):
            decode_attention(*args, **{**kw, **change})
    with pytest.raises(KernelInputError, match="k_zero must be None for k_layout 'codebook'"):
        decode_attention(q, kc, ks, vz, vc, vs, vz, 40, **kw)
    with pytest.raises(KernelInputError, match="k_scale must be 3-D"):
        decode_attention(q, kc, ks[..., None], None, vc, vs, vz, 40, **kw)
    with pytest.raises(KernelInputError, match=r"k_codes has shape \[1, 1, 40, 8\]; expected"):
        decode_attention(q, kc[..., :8], ks, None, vc, vs, vz, 40, **kw)
    with pytest.raises(KernelInputError, match="k_scale holds 30 tokens < length 40"):
        decode_attention(q, kc, ks[..., :30], None, vc, vs, vz, 40, **kw)
    with pytest.raises(KernelInputError, match="needs all of"):
        decode_attention(q, kc, None, None, vc, vs, vz, 40, **kw)


# -- through the cache --------------------------------------------------------------------------

def _filled_layer(setting, d, hkv, total, rot, **kw):
    """A ``CompressedLayer`` prefilled with 19 tokens then decoded one token at a time up to
    ``total`` (random K/V, an outlier first token as real keys have)."""
    torch.manual_seed(total)
    b, hq = 2, 3 * hkv
    layer = CompressedLayer(setting, 0, d, rotation=rot,
                            session=SimpleNamespace(active=True, rope={}), **kw)
    k = torch.randn(b, hkv, total, d) * torch.rand(1, 1, total, 1) * 3
    k[:, :, 0] *= 10
    v = torch.randn(b, hkv, total, d)
    layer.update(k[:, :, :19], v[:, :, :19])
    layer.commit(torch.randn(b, hq, 19, d), None)
    for t in range(19, total):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        layer.commit(torch.randn(b, hq, 1, d), None)
    return layer


@cpu_only
@pytest.mark.parametrize("kspec,vspec,residual,sinks", [
    (CodebookSpec(3, renormalize=True), QuantSpec(4, "per-token", 16), 0, 0),
    (CodebookSpec(2, NORMAL), QuantSpec(2, "per-channel", 16), 16, 2),
    (CodebookSpec(4, NORMAL), QuantSpec(3, "per-token", 16), 16, 0),
    (CodebookSpec(4, renormalize=True), QuantSpec(4, "per-token", 16), 16, 2),
])
def test_kernel_reads_a_codebook_layer_like_the_torch_path(kspec, vspec, residual, sinks):
    """A cache layer with codebook keys (rotated window, a MiKV sinks set in the rotated
    basis) beside uniform values: ``triton_decode`` on the rotated query equals the torch path,
    with transformers' bool and additive masks (row 1 left-padded)."""
    d, hkv, total = 32, 1, 83
    rot = hadamard_rotation(d, None)
    mikv = ProtectSettings(sinks, "off") if sinks else None
    layer = _filled_layer(LayerKV(kspec, vspec, residual), d, hkv, total, rot, protect=mikv)
    assert layer.quantized_length > 0 and layer.has_hp == bool(sinks)
    assert kernel_layout_problem(layer.setting, d) is None
    q = layer.to_stored_basis(torch.randn(2, 3 * hkv, 1, d), layer.setting.rotate_keys)
    mask = torch.ones(2, 1, 1, total, dtype=torch.bool)
    mask[1, ..., :6] = False
    for m in (mask, torch.where(mask, 0.0, torch.finfo(torch.float32).min)):
        ref, _ = packed_attention(q, layer, m, d ** -0.5)
        out, why = triton_decode(q, layer, m, d ** -0.5)
        assert why is None
        torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def _generate(model, ids, config, backend):
    """Six new tokens (a prefill and five decode steps) with ``backend``."""
    with compressed_attention(model, config, backend=backend) as session:
        cache = session.new_cache()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, pad_token_id=0,
                             **{cache_argument_name(model): cache})
    assert cache.layers[1].quantized_length >= 16  # the coded store was read
    return out, session


@cpu_only
@pytest.mark.parametrize("name", ["turboquant", "codebook-mix"])
def test_triton_generates_the_same_tokens_with_codebooks(name, monkeypatch):
    """A tiny Llama (head_dim 16) generating with vLLM TurboQuant's layout (codebook keys,
    per-token values, coded before attention; layers 0 and 2 kept exact), and with a mix of
    codebook-key and uniform layers: the Triton path (interpreter) gives the tokens of the
    torch path, and the kernel serves every decode step of every compressed layer."""
    import kvlens.cache.attention as attention

    served = []

    def counted(query, layer, mask, scaling):
        out, why = triton_decode(query, layer, mask, scaling)
        served.append((layer.layer_idx, why))
        return out, why

    monkeypatch.setattr(attention, "triton_decode", counted)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(11))
    if name == "turboquant":
        config = TurboQuantSetting("turboquant_k3v4_nc").kvconfig("tq", 3)
        compressed = [1]
        # the exact layers at every forward, and layer 1's first (it attends exact)
        torch_calls = 2 * 6 + 1
    else:
        config = KVConfig(
            "mix", LayerKV(QuantSpec(2, "per-channel", 16), QuantSpec(2, "per-token", 16), 32),
            {1: LayerKV(CodebookSpec(2, NORMAL, renormalize=True), QuantSpec(4, "per-token"),
                        32)})
        compressed = [0, 1, 2]
        torch_calls = 3  # the prefill: nothing quantized yet
    ref, _ = _generate(model, ids, config, "torch")
    assert not served
    out, session = _generate(model, ids, config, "triton")
    assert torch.equal(out, ref)
    assert sorted(served) == sorted((i, None) for i in compressed for _ in range(5))
    assert session.torch_path_calls == {"nothing quantized yet (model's own attention)":
                                        torch_calls}
