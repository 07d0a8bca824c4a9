"""Codebook quantization (kvlens.quant.codebook, vLLM TurboQuant's keys): Lloyd-Max against known
answers, per-vector norms, packing and the byte count."""

from __future__ import annotations

import math

import pytest
import torch

from kvlens.errors import ConfigError, InputError
from kvlens.layouts import layout_of
from kvlens.quant import QuantSpec, fake_quantize, hadamard_rotation
from kvlens.quant.codebook import (
    Codebook,
    CodebookSpec,
    CodebookTensor,
    computed_codebook,
    dequantize_codebook,
    fake_quantize_codebook,
    lloyd_max,
    normalized_coordinates,
    quantize_codebook,
    sphere_coordinate_density,
)
from kvlens.quant.packing import packed_length
from kvlens.quant.rotation import RotationSpec

# Max (1960), Lloyd-Max quantizers of N(0, 1): positive centroids and MSE.
MAX_TABLE = {
    1: ([0.7979], 0.3634),
    2: ([0.4528, 1.510], 0.1175),
    3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
}


def _integrate(f, lo, hi, n=200_001):
    z = torch.linspace(lo, hi, n, dtype=torch.float64)
    return torch.trapezoid(f(z), z)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_lloyd_max_gaussian_matches_max_table(bits):
    cb = lloyd_max(bits, None)
    positive, mse = MAX_TABLE[bits]
    got = cb.centroids[cb.centroids > 0].tolist()
    assert got == pytest.approx(positive, abs=2e-3)
    z = torch.linspace(-12, 12, 400_001, dtype=torch.float64)
    pdf = torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    err = (z - cb.decode(cb.encode(z)).double()) ** 2
    assert float(torch.trapezoid(err * pdf, z)) == pytest.approx(mse, rel=2e-3)


@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_lloyd_max_normal_is_the_gaussian_codebook_for_every_head_dim(head_dim):
    """``"lloyd-max-normal"`` (vLLM TurboQuant's centroids, Lloyd-Max for N(0, 1/D) in
    unit-variance coordinates) is Max's N(0, 1) quantizer whatever ``D``, stores nothing, and
    differs from the sphere-density ``"lloyd-max"`` codebook, most at small ``D``."""
    spec = CodebookSpec(3, "lloyd-max-normal")
    book = computed_codebook(spec, head_dim)
    assert _held_bytes(spec, 10, head_dim) == 10 * (3 * head_dim // 8 + 2)
    assert book.centroids[4:].tolist() == pytest.approx(MAX_TABLE[3][0], abs=2e-3)
    sphere = computed_codebook(CodebookSpec(3), head_dim).centroids
    assert float((sphere - book.centroids).abs().max()) > 1e-3  # not the same codebook
    assert computed_codebook(spec, head_dim) is book  # computed once per process
    x = torch.randn(1, 1, 4, head_dim)
    assert torch.equal(fake_quantize_codebook(x, spec),
                       dequantize_codebook(quantize_codebook(x, spec, book)))


@pytest.mark.parametrize("bits,head_dim", [(2, 64), (3, 64), (3, 256), (4, 16)])
def test_lloyd_max_sphere_satisfies_lloyd_conditions(bits, head_dim):
    cb = lloyd_max(bits, head_dim)
    c = cb.centroids.double()
    edges = [-math.sqrt(head_dim), *cb.boundaries.double().tolist(), math.sqrt(head_dim)]
    density = lambda z: sphere_coordinate_density(z, head_dim)  # noqa: E731
    for i in range(len(c)):
        mass = _integrate(density, edges[i], edges[i + 1])
        mean = _integrate(lambda z: z * density(z), edges[i], edges[i + 1]) / mass
        assert float(mean) == pytest.approx(float(c[i]), abs=2e-4)  # centroid condition
    # midpoint condition: every boundary halfway between its neighbouring centroids
    torch.testing.assert_close(cb.boundaries.double(), (c[1:] + c[:-1]) / 2)
    assert torch.allclose(c, -c.flip(0))  # the density is symmetric


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_beats_best_uniform_grid(bits):
    head_dim = 64
    z = torch.linspace(-8, 8, 200_001, dtype=torch.float64)
    pdf = sphere_coordinate_density(z, head_dim)
    pdf = pdf / torch.trapezoid(pdf, z)

    def mse(cb):
        return float(torch.trapezoid((z - cb.decode(cb.encode(z)).double()) ** 2 * pdf, z))

    levels = 1 << bits
    best_uniform = min(
        mse(Codebook(((torch.arange(levels) - (levels - 1) / 2) * step).float()))
        for step in torch.linspace(0.05, 2.5, 500).tolist()
    )
    assert mse(lloyd_max(bits, head_dim)) < best_uniform


def test_norms_and_coordinates():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 5, 32, generator=gen) * 3
    x[0, 1, 2] = 0  # zero vector: z = 0, decodes to 0
    spec = CodebookSpec(4)
    z, n = normalized_coordinates(x, spec)
    torch.testing.assert_close(n, x.norm(dim=-1))
    torch.testing.assert_close(z.pow(2).mean(-1)[n > 0], torch.ones(9))
    qt = quantize_codebook(x, spec, lloyd_max(4, 32))
    assert qt.norms.dtype == torch.float16 and qt.codes.dtype == torch.uint8
    out = dequantize_codebook(qt)
    assert torch.equal(out[0, 1, 2], torch.zeros(32))
    rel = (out - x).norm() / x.norm()
    assert float(rel) < 0.12  # 4-bit Lloyd-Max: sqrt(0.0095) ~ 0.1


def test_renormalize_keeps_stored_norm():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 50, 64, generator=gen)
    out = fake_quantize_codebook(x, CodebookSpec(2, renormalize=True))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1).half().float(),
                               rtol=1e-5, atol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    # One huge channel: without rotation nearly every coordinate is ~0 and the outlier takes the
    # top centroid's value; rotated, the Lloyd-Max codebook fits the coordinates.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 400, 64, generator=gen)
    x[..., 5] += 20
    rotated = fake_quantize_codebook(x, CodebookSpec(3))
    plain = fake_quantize_codebook(x, CodebookSpec(3, rotation=None))
    err = lambda y: float((y - x).norm() / x.norm())  # noqa: E731
    assert err(rotated) < 0.5 * err(plain)


def test_codebook_beats_uniform_per_token_on_gaussian_vectors():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 500, 64, generator=gen)
    err = lambda y: float((y - x).norm() / x.norm())  # noqa: E731
    # 3-bit codebook (3.25 bits/element) vs 3-bit per-token G64 min/max (3 + 32/64 = 3.5 bits
    # with float16 scale and zero), and 4-bit codebook (4.25) vs 3-bit per-token G32 (4.0).
    assert err(fake_quantize_codebook(x, CodebookSpec(3))) < err(
        fake_quantize(x, QuantSpec(3, "per-token", 64)))
    assert err(fake_quantize_codebook(x, CodebookSpec(4))) < 0.6 * err(
        fake_quantize(x, QuantSpec(3, "per-token", 32)))


@pytest.mark.parametrize("bits,head_dim", [(3, 64), (3, 24), (2, 10), (4, 256), (5, 6)])
def test_packing_round_trip_on_odd_shapes(bits, head_dim):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 7, head_dim, generator=gen)
    spec = CodebookSpec(bits, rotation=RotationSpec(seed=1))
    qt = quantize_codebook(x, spec, lloyd_max(bits, head_dim))
    packed = qt.packed()
    assert packed.shape == (2, 3, 7, packed_length(head_dim, bits))
    back = CodebookTensor.from_packed(packed, qt.norms, qt.codebook, spec, head_dim)
    assert torch.equal(back.codes, qt.codes)
    assert torch.equal(dequantize_codebook(back), dequantize_codebook(qt))


def _held_bytes(spec: CodebookSpec, num_vectors: int, head_dim: int) -> int:
    """Bytes its layout holds for ``num_vectors`` coded vectors."""
    return sum(layout_of(spec).part_bytes(num_vectors, head_dim, 1).values())


def test_held_bytes_and_bits_per_element():
    # 3-bit codes of D=64 pack into exactly 24 bytes; plus 2 bytes of norm.
    lm = CodebookSpec(3)
    assert _held_bytes(lm, 10, 64) == 10 * (24 + 2)
    assert 8 * _held_bytes(lm, 10, 64) / (10 * 64) == pytest.approx(3 + 16 / 64)
    assert _held_bytes(CodebookSpec(3, "lloyd-max-normal"), 10, 64) == _held_bytes(lm, 10, 64)
    # the stored bytes equal what the packed tensor and norms actually occupy
    x = torch.randn(1, 3, 11, 64)
    qt = quantize_codebook(x, lm, lloyd_max(3, 64))
    held = qt.packed().numel() * qt.packed().element_size() + qt.norms.numel() * 2
    assert _held_bytes(lm, 33, 64) == held


def test_spec_validation_and_json():
    spec = CodebookSpec(3, "lloyd-max-normal", RotationSpec(seed=2), renormalize=True)
    assert CodebookSpec.from_dict(spec.to_dict()) == spec
    assert CodebookSpec.from_dict(CodebookSpec(2, rotation=None).to_dict()).rotation is None
    assert spec.label == "3b codebook lloyd-max-normal hadamard seed 2 renorm"
    with pytest.raises(ConfigError, match="allowed: integers 1-8"):
        CodebookSpec(9)
    with pytest.raises(ConfigError, match="allowed: integers 1-8"):
        CodebookSpec(True)
    for removed in ("kmeans", "fitted", "weighted"):  # fitted codebooks: removed (issue #57)
        with pytest.raises(ConfigError, match="allowed: lloyd-max, lloyd-max-normal[.]$"):
            CodebookSpec(3, removed)
    with pytest.raises(ConfigError, match="RotationSpec or None"):
        CodebookSpec(3, rotation="hadamard")
    with pytest.raises(ConfigError, match="Unknown codebook spec keys"):
        CodebookSpec.from_dict({"bits": 3, "group_size": 32})
    with pytest.raises(ConfigError, match="version"):
        CodebookSpec.from_dict({"version": 9, "bits": 3})
    with pytest.raises(ConfigError, match="missing 'bits'"):
        CodebookSpec.from_dict({"codebook": "lloyd-max"})


def test_bad_inputs():
    with pytest.raises(InputError, match=r"\[B, H, T, D\]"):
        fake_quantize_codebook(torch.randn(4, 8), CodebookSpec(2))
    with pytest.raises(InputError, match="power-of-two"):
        Codebook(torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(InputError, match="sorted"):
        Codebook(torch.tensor([1.0, 0.0]))
    with pytest.raises(InputError, match="2-bit codebook cannot code a 3-bit"):
        quantize_codebook(torch.randn(1, 1, 2, 8), CodebookSpec(3), lloyd_max(2, 8))
    with pytest.raises(ConfigError, match="head_dim"):
        fake_quantize_codebook(torch.randn(1, 1, 2, 7), CodebookSpec(2))


def test_hadamard_used_is_the_rotation_module():
    x = torch.randn(1, 1, 3, 16)
    z, n = normalized_coordinates(x, CodebookSpec(2, rotation=RotationSpec(seed=3)))
    y = x @ hadamard_rotation(16, 3)
    torch.testing.assert_close(z, y * 4 / n[..., None])
