"""llama.cpp's CPU attention arithmetic (kvlens.quant.llamacpp_cpu): each step against a
reference on synthetic tensors."""

import pytest
import torch

from kvlens.errors import ConfigError
from kvlens.quant.ggml import GGML_FORMATS, dequantize_ggml, quantize_ggml
from kvlens.quant.llamacpp_cpu import (
    VEC_DOT_TYPE,
    accumulate_f16,
    attend,
    fa_path,
    fa_read_type,
    key_scores,
    quantize_q8_cpu,
    query_to_vec_dot,
)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _causal(tq, n):
    pos = torch.arange(n)
    return (pos[None, :] <= torch.arange(n - tq, n)[:, None])[None, None]


def test_vec_dot_types_follow_type_traits_cpu():
    assert VEC_DOT_TYPE["q8_0"] == VEC_DOT_TYPE["q4_0"] == VEC_DOT_TYPE["q5_0"] == "q8_0"
    assert VEC_DOT_TYPE["iq4_nl"] == "q8_0"
    assert VEC_DOT_TYPE["q4_1"] == VEC_DOT_TYPE["q5_1"] == "q8_1"
    assert VEC_DOT_TYPE["f16"] == "f16" and VEC_DOT_TYPE["bf16"] == "bf16"
    with pytest.raises(ConfigError, match="allowed"):
        query_to_vec_dot(_x(1, 1, 1, 32), "q3_k")


def test_query_through_q8_0_equals_ggml_q8_0_round_trip():
    q = _x(2, 3, 5, 64)
    values, sums = query_to_vec_dot(q, "q4_0")
    ref = dequantize_ggml(quantize_ggml(q, GGML_FORMATS["q8_0"]))
    assert sums is None
    # the x86 writer multiplies by 127/amax and rounds ties to even; the reference divides
    # by d and rounds half away: on continuous data no element sits on a tie
    assert torch.equal(values, ref)
    assert not torch.equal(values, q)
    rel = (values - q).norm() / q.norm()
    assert 1e-3 < rel < 1e-2  # 8-bit blocks: about 1/(127 sqrt(3)) of the block maximum


def test_q8_cpu_rounds_ties_to_even_and_scales_in_fp16():
    x = torch.zeros(32)
    x[0] = 127.0  # amax 127: d = 1, codes = x exactly
    x[1], x[2], x[3] = 2.5, 3.5, -2.5
    codes, d, s = quantize_q8_cpu(x)
    assert codes[0, 1] == 2 and codes[0, 2] == 4 and codes[0, 3] == -2  # ties to even
    assert d[0] == 1.0
    assert s[0] == float(codes.sum())
    y = _x(4, 32, seed=3) * 7.3
    _, d2, _ = quantize_q8_cpu(y)
    assert torch.equal(d2, (y.abs().amax(-1, keepdim=True) / 127).half().float()[..., 0:1]
                       .reshape(d2.shape))


def test_q8_1_block_sum_correction_is_what_vec_dot_adds():
    q = _x(1, 2, 3, 64, seed=1)
    k = _x(1, 2, 7, 64, seed=2) + 3.0  # a positive offset: large block minima
    blocks = quantize_ggml(k, GGML_FORMATS["q4_1"])
    kd, kmin = dequantize_ggml(blocks), blocks.m.float()
    qv, qs = query_to_vec_dot(q, "q4_1")
    got = key_scores(qv, qs, kd, kmin)
    # vec_dot_q4_1_q8_1 block by block: d_k d_q sum(q_k q_q) + m_k s_q
    codes, dq, s = quantize_q8_cpu(q)
    kc = blocks.codes.float()
    dk = blocks.d.float()
    ref = torch.einsum("bhqnj,bhknj,bhkn,bhqn->bhqk", codes, kc, dk, dq) + \
        torch.einsum("bhkn,bhqn->bhqk", kmin, s)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    plain = key_scores(qv, None, kd, None)
    assert not torch.allclose(got, plain, rtol=0, atol=1e-6)  # the fp16 rounding of s shows


def test_f16_and_bf16_query_rounding():
    q = _x(1, 1, 4, 64)
    assert torch.equal(query_to_vec_dot(q, "f16")[0], q.half().float())
    assert torch.equal(query_to_vec_dot(q, "bf16")[0], q.bfloat16().float())
    assert torch.equal(query_to_vec_dot(q, "f32")[0], q)


def test_paths_and_f32_cast():
    assert fa_read_type("f32") == "f16" and fa_read_type("q8_0") == "q8_0"
    assert fa_path("f16", "f16", 64) == "tiled"
    assert fa_path("f16", "f16", 63) == "one_chunk"
    assert fa_path("q8_0", "q8_0", 64) == "one_chunk"
    assert fa_path("f16", "q8_0", 512) == "one_chunk"


def test_f16_accumulation_matches_a_scalar_loop_and_differs_from_f32():
    torch.manual_seed(0)
    n, d = 300, 8
    scores = torch.randn(1, 1, 1, n) * 2
    v = (torch.randn(1, 1, n, d) * 50).half().float()  # large values: fp16 steps are coarse
    vis = torch.ones(1, 1, 1, n, dtype=torch.bool)
    got = accumulate_f16(scores, v, vis)
    # scalar transcription of one_chunk for an F16 V
    acc = torch.zeros(d, dtype=torch.float16)
    big_m, big_s = float("-inf"), 0.0
    for i in range(n):
        s = scores[0, 0, 0, i]
        ms, vs = torch.tensor(1.0), torch.tensor(1.0)
        if s > big_m:
            ms = torch.exp(torch.tensor(big_m) - s)
            big_m = float(s)
            acc = (acc.float() * ms).half()
        else:
            vs = torch.exp(s - big_m)
        acc = (acc.float() + v[0, 0, i] * vs).half()
        big_s = big_s * float(ms) + float(vs)
    assert torch.allclose(got[0, 0, 0], acc.float() / big_s, rtol=1e-6, atol=1e-6)
    exact = torch.softmax(scores.double(), -1) @ v.double()
    err = (got.double() - exact).abs().max() / exact.abs().max()
    assert 1e-5 < err < 1e-2  # fp16's 2^-11 per step, not float32's 2^-24


def test_f16_accumulation_skips_invisible_keys():
    scores = _x(1, 2, 3, 10)
    v = _x(1, 1, 10, 16).half().float()
    vis = _causal(3, 10)
    got = accumulate_f16(scores, v, vis)
    ref = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1) @ v
    assert torch.allclose(got, ref, atol=2e-3)


def test_attend_paths():
    q, k, v = _x(1, 4, 64, 64, seed=1), _x(1, 2, 80, 64, seed=2), _x(1, 2, 80, 64, seed=3)
    vis = _causal(64, 80)
    scale = 0.125

    def exact(kk, vv, qq=q):
        s = (qq.reshape(1, 2, -1, 64) @ kk.transpose(-1, -2)).reshape(1, 4, 64, 80) * scale
        return torch.softmax(s.masked_fill(~vis, float("-inf")), -1).reshape(1, 2, -1, 80) \
            .matmul(vv).reshape(1, 4, 64, 64)

    kh, vh = k.half().float(), v.half().float()
    # f16/f16 with a full tile: float32 arithmetic, the model's own
    assert torch.allclose(attend(q, kh, vh, vis, scale, "f16", "f16"), exact(kh, vh), atol=1e-5)
    # f32 cache: cast to f16 first
    assert torch.allclose(attend(q, k, v, vis, scale, "f32", "f32"), exact(kh, vh), atol=1e-5)
    # q8_0 keys and values: the query through q8_0, float32 V accumulation
    k8 = dequantize_ggml(quantize_ggml(k, GGML_FORMATS["q8_0"]))
    v8 = dequantize_ggml(quantize_ggml(v, GGML_FORMATS["q8_0"]))
    q8 = dequantize_ggml(quantize_ggml(q, GGML_FORMATS["q8_0"]))
    got = attend(q, k8, v8, vis, scale, "q8_0", "q8_0")
    assert torch.allclose(got, exact(k8, v8, q8), atol=1e-5)
    assert not torch.allclose(got, exact(k8, v8), atol=1e-5)
    # no flash attention with an f16 V: probabilities rounded to fp16 before mul_mat(v, kq)
    nofa = attend(q, k8, vh, vis, scale, "q8_0", "f16", flash_attention=False)
    assert torch.allclose(nofa, exact(k8, vh, q8), atol=2e-3)
    assert not torch.allclose(nofa, exact(k8, vh, q8), atol=1e-6)
