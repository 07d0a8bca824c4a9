"""Hadamard rotation: orthonormality, invariance of scores and outputs, seeded signs, pre-RoPE
composition, refusal of unsupported head_dim, and the outlier spreading it exists for."""

import json

import pytest
import torch
from helpers import rand, rel

from kvlens.errors import ConfigError, InputError
from kvlens.quant import (
    QuantSpec,
    RotationSpec,
    fake_quantize,
    hadamard_block_size,
    hadamard_rotation,
    quantize_pre_rope,
    quantize_rotated,
    rope_tables_for,
    rotate,
    unrotate,
)
from kvlens.rope import apply_rope


def _attention(q, k, v):
    """Causal softmax attention, [B, H, T, D] in, [B, H, T, D] out (float64)."""
    t = q.shape[2]
    logits = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double()


@pytest.mark.parametrize("head_dim", [2, 16, 64, 128, 80, 96, 6])
@pytest.mark.parametrize("seed", [None, 7])
def test_orthonormal(head_dim, seed):
    r = hadamard_rotation(head_dim, seed)
    assert r.shape == (head_dim, head_dim) and r.dtype == torch.float32
    eye = torch.eye(head_dim)
    assert torch.allclose(r @ r.T, eye, atol=1e-6)
    assert torch.allclose(r.T @ r, eye, atol=1e-6)


def test_sylvester_entries_and_block_diagonal_layout():
    r = hadamard_rotation(8)
    assert torch.allclose(r.abs(), torch.full((8, 8), 8**-0.5))  # every channel spread evenly
    assert torch.all(r[0] > 0) and torch.all(r[:, 0] > 0)  # Sylvester: first row/col all +
    assert hadamard_block_size(64) == 64 and hadamard_block_size(80) == 16
    assert hadamard_block_size(96) == 32 and hadamard_block_size(6) == 2
    r80 = hadamard_rotation(80)
    # five 16x16 blocks on the diagonal, zero elsewhere
    assert torch.count_nonzero(r80) == 5 * 16 * 16
    assert torch.allclose(r80[16:32, 16:32], hadamard_rotation(16))
    assert torch.all(r80[:16, 16:] == 0)


def test_seeded_signs_reproducible_and_seeds_differ():
    a, b, c = hadamard_rotation(64, 3), hadamard_rotation(64, 3), hadamard_rotation(64, 4)
    plain = hadamard_rotation(64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, plain)
    # sign flips only: same magnitudes, each row of R is +- the same row of H
    signs = (a / plain)[:, 0]
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.allclose(a, signs[:, None] * plain)


def test_scores_unchanged_when_nothing_is_quantized():
    q, k = rand(2, 3, 20, 64, seed=1), rand(2, 3, 20, 64, seed=2)
    k[..., 5] += 40.0
    for seed in (None, 11):
        r = hadamard_rotation(64, seed)
        rotated = rotate(q, r) @ rotate(k, r).transpose(-1, -2)
        plain = q @ k.transpose(-1, -2)
        assert torch.allclose(rotated, plain, atol=1e-3, rtol=1e-5)
        assert rel(plain, rotated) < 1e-6


def test_attention_output_unrotated_equals_plain_output():
    q, k, v = (rand(1, 2, 24, 96, seed=s) for s in (3, 4, 5))
    r = hadamard_rotation(96, seed=2)  # block-diagonal case
    plain = _attention(q, k, v)
    # values stored as v R, attention output un-rotated by R^T
    out = unrotate(_attention(q, k, rotate(v, r)).float(), r)
    assert rel(plain.float(), out) < 1e-6
    # keys stored as k R, queries as q R: same weights, same output
    out_k = _attention(rotate(q, r), rotate(k, r), v)
    assert rel(plain, out_k) < 1e-6


def test_pre_rope_composition_is_identity_without_quantization():
    d, t = 32, 40
    k_pre = rand(2, 3, t, d, seed=6)
    cos, sin = rope_tables_for(torch.arange(t).expand(2, -1), d, theta=10000.0)
    k_post = apply_rope(k_pre, cos, sin, "half")
    r = hadamard_rotation(d, seed=1)
    # store k_pre R, read back: un-rotate, then RoPE
    assert rel(k_post, apply_rope(unrotate(rotate(k_pre, r), r), cos, sin, "half")) < 1e-6
    # with 8 bits the whole pipeline is close, and rotation=None keeps the old behaviour
    spec = QuantSpec(8, "per-token", 8)
    assert rel(k_post, quantize_pre_rope(k_pre, cos, sin, spec, rotation=r)) < 1e-2
    assert torch.equal(
        quantize_pre_rope(k_pre, cos, sin, spec),
        apply_rope(fake_quantize(k_pre, spec), cos, sin, "half"),
    )
    # RoPE and R do not commute: this is why the query cannot absorb R for pre-RoPE keys
    assert rel(apply_rope(rotate(k_pre, r), cos, sin, "half"), rotate(k_post, r)) > 0.1


@pytest.mark.parametrize("bad", [1, 9, 63, 0, -4, True, 64.0])
def test_unsupported_head_dim_refused_with_supported_sizes(bad):
    with pytest.raises(ConfigError, match=r"No Hadamard rotation for head_dim.*Supported: even"):
        hadamard_rotation(bad)


def test_bad_seed_and_shape_mismatch():
    with pytest.raises(ConfigError, match="Invalid rotation seed -1"):
        hadamard_rotation(16, -1)
    with pytest.raises(ConfigError, match="Invalid rotation seed"):
        RotationSpec(seed=True)
    with pytest.raises(InputError, match=r"does not fit head_dim 32; expected \(32, 32\)"):
        rotate(rand(1, 1, 4, 32), hadamard_rotation(16))
    with pytest.raises(InputError, match=r"\[B, H, T, D\]"):
        unrotate(rand(4, 16), hadamard_rotation(16))


def test_rotation_spec_round_trip():
    spec = RotationSpec(seed=5)
    assert RotationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert torch.equal(spec.matrix(32), hadamard_rotation(32, 5))
    assert RotationSpec().label == "hadamard" and spec.label == "hadamard seed 5"
    with pytest.raises(ConfigError, match="Unknown rotation keys"):
        RotationSpec.from_dict({"seed": 1, "kind": "givens"})
    with pytest.raises(ConfigError, match="Unsupported rotation version"):
        RotationSpec.from_dict({"version": 2})


def test_rotation_spreads_a_per_token_outlier_channel():
    # one huge channel on every token rules the per-token groups that hold it; rotated, its
    # energy is spread evenly over all channels and the rest of each token survives
    x = rand(2, 2, 64, 64, seed=8)
    x[..., 9] = 50.0 + rand(2, 2, 64, seed=9)
    q = rand(2, 2, 64, 64, seed=10)
    q[..., 9] *= 0.01  # the query barely reads the outlier channel (as in real keys)
    spec = QuantSpec(4, "per-token", 32)
    plain = fake_quantize(x, spec)
    for seed in (None, 0):
        hat = quantize_rotated(x, spec, hadamard_rotation(64, seed))
        assert rel(x, hat) < 0.5 * rel(x, plain), seed
        scores = q @ x.transpose(-1, -2)
        assert rel(scores, q @ hat.transpose(-1, -2)) < 0.5 * rel(
            scores, q @ plain.transpose(-1, -2)
        ), seed


def test_quantize_rotated_is_the_round_trip_in_the_original_basis():
    x = rand(1, 2, 16, 32, seed=10)
    r = hadamard_rotation(32, 3)
    spec = QuantSpec(4, "per-channel", 8)
    hat = quantize_rotated(x, spec, r)
    assert torch.allclose(hat, fake_quantize(x @ r, spec) @ r.T, atol=1e-6)
    # orthonormal: the error has the same norm in the rotated basis
    assert (x - hat).norm().item() == pytest.approx(
        (rotate(x, r) - fake_quantize(rotate(x, r), spec)).norm().item(), rel=1e-5
    )
    # nearly lossless at 8 bits
    assert rel(x, quantize_rotated(x, QuantSpec(8, "per-token"), r)) < 1e-2
