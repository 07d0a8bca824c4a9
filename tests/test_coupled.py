"""Coupled (CQ) quantization (``kvlens.quant.coupled``) on synthetic tensors with planted
answers, and the ``coupled`` variant of ``compare-axes``."""

from __future__ import annotations

import pytest
import torch
from helpers import make_capture
from typer.testing import CliRunner

from kvlens.analysis.compare import CompareConfig, compare_axes
from kvlens.cli.app import app
from kvlens.errors import ConfigError, InputError
from kvlens.quant import (
    CoupledSpec,
    correlation_permutation,
    decode_coupled,
    encode_coupled,
    fake_quantize_coupled,
    fit_coupled,
    held_out_coupled,
    kmeans,
    pack_codes,
    pack_indices,
    parse_coupled,
    unpack_indices,
)
from kvlens.quant.coupled import nearest


def rel(x, y):
    return float((x - y).norm() / x.norm())


def test_correlated_channels_coupled_beat_scalar_at_equal_bits():
    # two identical channels: a joint 4-bit index (2 bits per channel) puts all 16 centroids
    # on the diagonal, 2-bit scalar codes of each channel get only 4 levels each
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 1, 4096, 1, generator=g)
    x = torch.cat((a, a), dim=-1)
    coupled = fake_quantize_coupled(x, CoupledSpec(2, 4))
    scalar_books = kmeans(a.reshape(1, -1, 1), 4, 20)  # the best 2-bit scalar codebook
    idx = ((a.reshape(-1, 1) - scalar_books[0, :, 0]) ** 2).argmin(-1)
    scalar_hat = scalar_books[0, idx, 0].reshape(a.shape)
    scalar_err = rel(a, scalar_hat)  # both channels identical: same relative error
    assert rel(x, coupled) < 0.5 * scalar_err, (rel(x, coupled), scalar_err)


def test_kmeans_recovers_planted_centres():
    g = torch.Generator().manual_seed(1)
    centres = 10 * torch.randn(8, 4, generator=g)
    labels = torch.arange(8).repeat(200)
    points = centres[labels] + 0.05 * torch.randn(1600, 4, generator=g)
    found = kmeans(points[None], 8, 15, seed=3)[0]
    dist = torch.cdist(centres, found)
    assert float(dist.min(dim=1).values.max()) < 0.05
    assert float(dist.min(dim=0).values.max()) < 0.05  # no stray centroid either


def test_weighted_kmeans_moves_centroids_towards_heavy_coordinates():
    # one cluster, 2 levels: the split follows the coordinate with the larger weight
    g = torch.Generator().manual_seed(2)
    p = torch.randn(1, 2000, 2, generator=g)
    w = torch.tensor([100.0, 0.01])
    c = kmeans(p, 2, 20, weights=w)[0]
    spread = (c[0] - c[1]).abs()
    assert spread[0] > 5 * spread[1]


@pytest.mark.parametrize("weighted", [False, True])
def test_nearest_is_the_brute_force_argmin(weighted):
    # the one-product distance against the plain weighted squared distance, odd shapes
    g = torch.Generator().manual_seed(7)
    p, c = torch.randn(3, 37, 3, generator=g), torch.randn(3, 11, 3, generator=g)
    w = torch.rand(3, 37, 3, generator=g) + 0.1 if weighted else None
    d = (p[:, :, None] - c[:, None]) ** 2
    want = (d if w is None else w[:, :, None] * d).sum(-1).argmin(-1)
    assert torch.equal(nearest(p, c, w), want)


@pytest.mark.parametrize("shape", [(4, 1, 16, 4), (1, 1, 64, 4)])
def test_held_out_codes_each_half_with_the_other_halfs_codebooks(shape):
    # the first half (of the samples; of the tokens with one sample) sits at +5, the second
    # at -5: in-sample the 4 centroids cover both, held out each half only sees the other
    g = torch.Generator().manual_seed(8)
    x = torch.randn(*shape, generator=g)
    dim = 0 if shape[0] > 1 else 2
    n = shape[dim]
    x.narrow(dim, 0, n // 2).add_(5.0)
    x.narrow(dim, n // 2, n - n // 2).sub_(5.0)
    spec = CoupledSpec(2, 2)
    assert rel(x, fake_quantize_coupled(x, spec)) < 0.3
    held = held_out_coupled(x, spec)
    assert held.shape == x.shape
    assert rel(x, held) > 1.0
    # each half is exactly what the other half's codebooks give
    a, b = x.narrow(dim, 0, n // 2), x.narrow(dim, n // 2, n - n // 2)
    want = fake_quantize_coupled(a, books=fit_coupled(b, spec))
    assert torch.equal(held.narrow(dim, 0, n // 2), want)


def test_query_weights_of_an_unread_channel_stay_positive_in_float16():
    # a channel no query reads (Gemma3 has such): its weight is clamped to float16's smallest
    # normal, so the stored weights are positive (the config refuses zeros)
    from kvlens.quant.coupled import query_weights

    q = torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(9))
    q[..., 3] = 0.0
    spec = CoupledSpec(2, 2, weighted=True)
    w = query_weights(q, 1, spec).half()
    assert bool((w > 0).all()) and float(w[0, 3]) == float(torch.finfo(torch.float16).tiny)
    books = fit_coupled(torch.randn(1, 1, 32, 8), spec, q)
    assert bool((books.channel_weights > 0).all())


def test_held_out_needs_two_samples_or_tokens():
    with pytest.raises(InputError, match="2 samples or 2 tokens"):
        held_out_coupled(torch.randn(1, 1, 1, 4), CoupledSpec(2, 2))


def test_deterministic_with_a_seed():
    x = torch.randn(2, 2, 64, 8, generator=torch.Generator().manual_seed(3))
    a = fit_coupled(x, CoupledSpec(4, 6, seed=5))
    b = fit_coupled(x, CoupledSpec(4, 6, seed=5))
    c = fit_coupled(x, CoupledSpec(4, 6, seed=6))
    assert torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.centroids, c.centroids)
    assert torch.equal(a.centroids, a.centroids.half().float())  # stored in float16


@pytest.mark.parametrize("grouping", ["consecutive", "correlation", "hadamard"])
@pytest.mark.parametrize("scope", ["layer", "group", "head"])
@pytest.mark.parametrize("channels", [2, 4, 8])
def test_odd_shapes_encode_decode(grouping, scope, channels):
    g = torch.Generator().manual_seed(4)
    b, h, t, d = 3, 5, 7, 24
    x = torch.randn(b, h, t, d, generator=g)
    q = torch.randn(b, 2 * h, t, d, generator=g)
    spec = CoupledSpec(channels, 5, grouping, scope, weighted=True, iters=5)
    books = fit_coupled(x, spec, q)
    codes = encode_coupled(x, books)
    assert codes.shape == (b, h, t, d // channels) and codes.dtype == torch.int32
    assert int(codes.max()) < 32 and int(codes.min()) >= 0
    x_hat = decode_coupled(codes, books)
    assert x_hat.shape == x.shape and torch.isfinite(x_hat).all()
    assert rel(x, x_hat) < 1.0
    packed = pack_indices(codes, 5)
    assert packed.shape[-1] == spec.index_bytes(d)
    assert torch.equal(unpack_indices(packed, 5, d // channels), codes)


def test_decode_is_the_nearest_centroid_per_group():
    x = torch.randn(1, 2, 50, 8, generator=torch.Generator().manual_seed(5))
    books = fit_coupled(x, CoupledSpec(2, 3, scope="head", iters=3))
    codes = encode_coupled(x, books)
    x_hat = decode_coupled(codes, books)
    # head 1, group 2 (channels 4-5) uses codebook 1 * 4 + 2
    book = books.centroids[1 * 4 + 2]
    pts = x[0, 1, :, 4:6]
    best = ((pts[:, None, :] - book[None]) ** 2).sum(-1).argmin(-1)
    assert torch.equal(codes[0, 1, :, 2].long(), best)
    assert torch.allclose(x_hat[0, 1, :, 4:6], book[best])


def test_correlation_grouping_pairs_correlated_channels():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(1, 1, 500, 4, generator=g)
    # channel 5 copies channel 0, channel 2 copies 3 (up to noise): the pairs are (0, 5), (2, 3)
    x = torch.randn(1, 1, 500, 8, generator=g) * 0.1
    x[..., 0], x[..., 5] = base[..., 0], base[..., 0] + 0.01 * base[..., 1]
    x[..., 2], x[..., 3] = base[..., 2], base[..., 2] - 0.01 * base[..., 3]
    perm = correlation_permutation(x, 2)[0].tolist()
    pairs = {tuple(perm[i:i + 2]) for i in range(0, 8, 2)}
    assert (0, 5) in pairs and (2, 3) in pairs
    assert sorted(perm) == list(range(8))


def test_correlation_grouping_decodes_in_the_original_channel_order():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(1, 1, 400, 1, generator=g)
    noise = torch.randn(1, 1, 400, 4, generator=g) * 0.01
    x = torch.cat((a, noise[..., :1], noise[..., 1:2], a), dim=-1)  # channels 0 and 3 equal
    books = fit_coupled(x, CoupledSpec(2, 4, "correlation", iters=10))
    x_hat = fake_quantize_coupled(x, books=books)
    assert rel(x[..., [0, 3]], x_hat[..., [0, 3]]) < 0.15


def test_bytes_counted():
    spec = CoupledSpec(4, 8)  # one codebook per layer and channel group
    # 64 / 4 = 16 codebooks x 256 centroids x 4 channels x 2 bytes
    assert spec.codebook_bytes(kv_heads=2, head_dim=64) == 16 * 256 * 4 * 2
    assert spec.index_bytes(64) == 16
    assert spec.held_bytes(100, 2, 64) == 2 * 100 * 16 + 32768
    assert spec.bits_per_element(100, 2, 64) == pytest.approx(
        8 * (3200 + 32768) / (2 * 100 * 64))
    assert CoupledSpec(4, 8).bits_per_channel == 2.0
    assert CoupledSpec(4, 10).bits_per_channel == 2.5
    assert CoupledSpec(4, 12).bits_per_channel == 3.0
    head = CoupledSpec(4, 8, scope="head")
    assert head.codebook_bytes(2, 64) == 2 * 32768
    assert CoupledSpec(4, 8, scope="layer").codebook_bytes(2, 64) == 256 * 4 * 2
    corr = CoupledSpec(2, 5, "correlation")
    assert corr.codebook_bytes(3, 64) == 32 * 32 * 2 * 2 + 3 * 64  # + the permutation
    assert CoupledSpec(4, 10).index_bytes(64) == 20  # 16 x 10 bits, packed densely
    # the amortised codebook vanishes with the context
    assert spec.bits_per_element(10**7, 2, 64) == pytest.approx(2.0, abs=1e-3)


def test_packing_matches_the_cache_packing_for_byte_units():
    codes = torch.randint(0, 4, (3, 16), generator=torch.Generator().manual_seed(8))
    assert torch.equal(pack_indices(codes, 2), pack_codes(codes.to(torch.uint8), 2))
    with pytest.raises(InputError):
        pack_indices(torch.tensor([4]), 2)


@pytest.mark.parametrize("bits", range(1, 17))
def test_unpacking_inverts_packing_at_every_width(bits):
    """Every width 1-16 (indices straddling two or three bytes), lengths that leave a partial
    last byte: unpack(pack(x)) == x; planted bits read back little-endian (3-bit index 2 spans
    bits 6-8, across the byte boundary)."""
    gen = torch.Generator().manual_seed(bits)
    for length in (1, 3, 7, 16, 33):
        codes = torch.randint(0, 1 << bits, (2, 3, length), generator=gen)
        packed = pack_indices(codes, bits)
        assert packed.shape[-1] == -(-length * bits // 8)
        out = unpack_indices(packed, bits, length)
        assert out.dtype == torch.int32 and torch.equal(out.long(), codes)
    planted = torch.tensor([[0b10100000, 0b1]], dtype=torch.uint8)  # bits 5, 7 and 8 set
    assert unpack_indices(planted, 3, 3).tolist() == [[0, 4, 6]]


def test_names_and_json_round_trip():
    for name in ("c4b8", "c2b6+corr+head", "c8b16+hadamard+layer+weighted"):
        spec = parse_coupled(name)
        assert spec.name == name
        assert CoupledSpec.from_dict(spec.to_dict()) == spec
    assert parse_coupled("C4B8+Weighted+Corr").name == "c4b8+corr+weighted"
    for bad in ("c3b8", "c4b17", "c4", "x4b8", "c4b8+nope", "c4b8+corr+hadamard", ""):
        with pytest.raises(ConfigError):
            parse_coupled(bad)
    with pytest.raises(ConfigError, match="divide head_dim"):
        fit_coupled(torch.randn(1, 1, 4, 6), CoupledSpec(4, 4))
    with pytest.raises(InputError, match="queries"):
        fit_coupled(torch.randn(1, 1, 4, 8), CoupledSpec(4, 4, weighted=True))


# -- compare-axes -------------------------------------------------------------------------------


def correlated_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    s, hq, hkv, t, d = 4, 4, 2, 32, 8
    q = torch.randn(s, hq, t, d, generator=g)
    base = torch.randn(s, hkv, t, d // 2, generator=g)
    k = torch.cat((base, base + 0.05 * torch.randn(s, hkv, t, d // 2, generator=g)), dim=-1)
    v = torch.cat((base, -base), dim=-1) + 0.05 * torch.randn(s, hkv, t, d, generator=g)
    return q, k, v


def test_compare_axes_coupled_variant(tmp_path):
    path = make_capture(tmp_path / "run.h5", *correlated_tensors(), layers=2)
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), variants=("coupled",),
                        coupled=("c2b4+corr", "c4b8+weighted"), coupled_iters=5)
    res = compare_axes(path, cfg)
    split = res.summary["coupled"]
    assert split["held_out"] and split["fitted_on_samples"] == [0, 1]
    assert split["measured_on_samples"] == [2, 3]
    assert res.summary["capture"]["samples"] == 2
    names = {r.format for r in res.records if r.format}
    assert names == {"coupled:c2b4+corr", "coupled:c4b8+weighted"}
    # weighted settings are for keys only
    assert {r.tensor for r in res.records if r.format == "coupled:c4b8+weighted"} == {"key"}
    info = {f["format"]: f for f in res.summary["formats"]}
    assert info["coupled:c2b4+corr"]["code_bits_per_element"] == 2.0
    # channel j + 4 repeats channel j: the correlation pairs code both at once, far better
    # than 2-bit scalar codes of each
    out = [r.rel_error for r in res.records if r.format == "coupled:c2b4+corr"
           and r.tensor == "key" and r.metric == "reconstruction"]
    scalar = [r.rel_error for r in res.records if r.format is None and r.tensor == "key"
              and r.axis == "per-channel" and r.metric == "reconstruction"]
    assert max(out) < min(scalar)


def test_coupled_settings_need_the_variant(tmp_path):
    with pytest.raises(ConfigError, match="coupled variant"):
        CompareConfig(coupled=("c4b8",))
    assert CompareConfig(variants=("coupled",)).coupled == ("c4b8", "c4b10", "c2b6")
    with pytest.raises(ConfigError):
        CompareConfig(variants=("coupled", "predict"))
    path = make_capture(tmp_path / "run.h5", *correlated_tensors(), layers=1)
    result = CliRunner().invoke(app, ["compare-axes", str(path), "--coupled", "c4b8"])
    assert result.exit_code == 1
    assert "--variants coupled" in result.output or "coupled variant" in result.output
