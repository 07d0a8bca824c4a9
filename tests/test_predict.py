"""Cross-layer prediction (AQUA-KV): the ridge fit, cross-fitting, reconstructed inputs along the
chain, and the compare-axes ``predict`` variant on synthetic captures with planted linear maps."""

from __future__ import annotations

import pytest
import torch
from helpers import make_capture

from kvlens.analysis.compare import CompareConfig, compare_axes
from kvlens.analysis.compare.predict import PredictChain
from kvlens.errors import ConfigError, InputError
from kvlens.quant import QuantSpec, fake_quantize
from kvlens.quant.predict import (
    cross_fit_predict,
    explained_variance,
    fit_predict,
    fit_ridge,
    predictor_bytes,
    quantize_residual,
    token_features,
)

S, HQ, HKV, T, D = 3, 4, 2, 32, 8


def test_ridge_recovers_a_planted_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=g) * torch.tensor([1.0, 5, 0.1, 2, 3, 1])
    w = torch.randn(6, 4, generator=g)
    b = torch.tensor([3.0, -1.0, 0.5, 10.0])
    fit = fit_ridge(x, x @ w + b, ridge=0.0)
    torch.testing.assert_close(fit.weight.float(), w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fit.bias.float(), b, atol=1e-5, rtol=1e-5)
    # with noise the fit still lands near the map; a penalty shrinks the weights
    noisy = x @ w + b + 0.01 * torch.randn(500, 4, generator=g)
    assert float((fit_ridge(x, noisy, 0.0).weight.float() - w).abs().max()) < 0.01
    shrunk = fit_ridge(x, noisy, ridge=10.0)
    assert float(shrunk.weight.norm()) < 0.9 * float(w.norm())
    # no inputs: the intercept is the mean
    mean_only = fit_ridge(torch.zeros(500, 0), noisy)
    torch.testing.assert_close(mean_only(torch.zeros(2, 0)), noisy.mean(0).expand(2, -1))


def test_ridge_refuses_bad_shapes_and_penalties():
    with pytest.raises(InputError, match="same N"):
        fit_ridge(torch.zeros(3, 2), torch.zeros(4, 1))
    with pytest.raises(InputError, match="Invalid ridge"):
        fit_ridge(torch.zeros(3, 2), torch.zeros(3, 1), ridge=-1.0)


def test_cross_fit_never_fits_on_the_predicted_sample():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, HKV, T, D, generator=g)
    w = torch.randn(HKV * D, HKV * D, generator=g)
    y = (token_features(x) @ w).reshape(S, T, HKV, D).permute(0, 2, 1, 3)
    pred = cross_fit_predict([x], y, ridge=0.0)
    torch.testing.assert_close(pred, y, atol=1e-3, rtol=1e-3)  # a planted map is found
    assert float(explained_variance(y, pred).min()) > 0.999
    # changing sample 0's target does not move sample 0's prediction (it is not fitted on it),
    # but moves the others'
    y2 = y.clone()
    y2[0] += 5 * torch.randn(HKV, T, D, generator=g)
    pred2 = cross_fit_predict([x], y2, ridge=0.0)
    torch.testing.assert_close(pred2[0], pred[0])
    assert float((pred2[1:] - pred[1:]).abs().max()) > 0.1
    with pytest.raises(InputError, match="at least 2 captured samples"):
        cross_fit_predict([x[:1]], y[:1])


def test_explained_variance_and_residual_quantization():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, HKV, T, D, generator=g) + 3.0
    torch.testing.assert_close(explained_variance(x, x), torch.ones(HKV))
    mean = x.mean(dim=(0, 2), keepdim=True).expand_as(x)
    torch.testing.assert_close(explained_variance(x, mean), torch.zeros(HKV), atol=1e-6,
                               rtol=0)
    # a perfect prediction leaves nothing to quantize; the residual is quantized in x's frame
    spec = QuantSpec(2, "per-token", D)
    torch.testing.assert_close(quantize_residual(x, x, lambda r: fake_quantize(r, spec)), x)
    p = 0.9 * x
    torch.testing.assert_close(quantize_residual(x, p, lambda r: fake_quantize(r, spec)),
                               p + fake_quantize(x - p, spec))


def test_predictor_bytes():
    # keys: [Hkv*D, Hkv*D] weights + Hkv*D intercept; values read two tensors; float16
    assert predictor_bytes(2, 8, 1) == 2 * (16 * 16 + 16)
    assert predictor_bytes(2, 8, 2) == 2 * (32 * 16 + 16)
    assert predictor_bytes(2, 8, 0) == 2 * 16


def _chained_keys(seed=3, layers=3, noise=0.05):
    """Keys of layer l = keys of layer l-1 through a fixed random map, plus a little noise;
    values = the layer's keys through another map."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, HQ, T, D, generator=g)
    ks = [torch.randn(S, HKV, T, D, generator=g)]
    for _ in range(layers - 1):
        w = torch.linalg.qr(torch.randn(HKV * D, HKV * D, generator=g))[0] * 1.5
        nxt = token_features(ks[-1]) @ w + noise * torch.randn(S, T, HKV * D, generator=g)
        ks.append(nxt.reshape(S, T, HKV, D).permute(0, 2, 1, 3).contiguous())
    a = torch.randn(HKV * D, HKV * D, generator=g) / (HKV * D) ** 0.5
    vs = [(token_features(k) @ a).reshape(S, T, HKV, D).permute(0, 2, 1, 3).contiguous()
          + noise * torch.randn(S, HKV, T, D, generator=g) for k in ks]
    return q, ks, vs


def test_chain_predicts_from_the_reconstructed_previous_layer():
    """What a decoder holds for layer l-1 is its reconstruction: the chain's prediction of layer
    1 reads layer 0's reconstruction, not its exact keys."""
    _, ks, vs = _chained_keys(noise=0.0)
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), variants=("predict",), tensors=("key",))
    chain = PredictChain(cfg, rope_ok=False)
    hats0 = chain.advance(0, ks[0], None, vs[0])
    hats1 = chain.advance(1, ks[1], None, vs[1])
    ckey = ("key", "per-channel", 2, 8, "post")
    spec = QuantSpec(2, "per-channel", 8)

    def code(r):
        return fake_quantize(r, spec)

    hat0 = quantize_residual(ks[0], cross_fit_predict([], ks[0], chain.ridge), code)
    torch.testing.assert_close(hats0[ckey], hat0)
    from_reconstruction = quantize_residual(
        ks[1], cross_fit_predict([hat0], ks[1], chain.ridge), code)
    from_exact = quantize_residual(ks[1], cross_fit_predict([ks[0]], ks[1], chain.ridge), code)
    torch.testing.assert_close(hats1[ckey], from_reconstruction)
    # the exact keys would predict the (noise-free) map almost perfectly; the reconstruction
    # cannot, so the two differ clearly
    err = lambda h: float((h - ks[1]).norm() / ks[1].norm())  # noqa: E731
    assert err(from_exact) < 0.5 * err(hats1[ckey])
    # the first layer of a chain has no predecessor: one explained-variance entry per layout,
    # intercept only; layer 1 reads one tensor
    assert {e["inputs"] for e in chain.explained if e["layer"] == 0} == {0}
    assert {e["inputs"] for e in chain.explained if e["layer"] == 1} == {1}
    # a gap in the layers restarts the chain
    chain.advance(3, ks[2], None, vs[2])
    assert {e["inputs"] for e in chain.explained if e["layer"] == 3} == {0}


def test_predict_variant_beats_plain_where_layers_are_linked(tmp_path):
    q, ks, vs = _chained_keys(layers=3)
    path = make_capture(tmp_path / "p.h5", q, ks[0], vs[0], layers=3,
                        per_layer={i: {"k": ks[i], "k_pre": ks[i], "v": vs[i]} for i in range(3)})
    cfg = CompareConfig(bits=(2, 3), group_sizes=(8,), variants=("predict",),
                        codebooks=("fitted+renorm", "fitted+renorm+predict"))
    res = compare_axes(path, cfg)
    r = res.records

    def mean(**match):
        vals = [x.rel_error for x in r if all(getattr(x, k) == v for k, v in match.items())]
        assert vals, match
        return sum(vals) / len(vals)

    for tensor, metric in (("key", "score"), ("key", "attention_output"),
                           ("value", "attention_output"), ("value", "reconstruction")):
        for axis in ("per-token", "per-channel"):
            m = dict(tensor=tensor, metric=metric, axis=axis, bits=2)
            assert mean(variant="predict", layer=2, **m) < 0.5 * mean(variant="plain", layer=2,
                                                                     **m), m
        cb = dict(tensor=tensor, metric=metric, layer=2)
        assert mean(format="codebook2:fitted+renorm+predict", **cb) < 0.5 * mean(
            format="codebook2:fitted+renorm", **cb)
    # bits: the cache codes are the layout's own (same held bits as plain / the codebook);
    # the predictors are reported beside them, per layer, in float16
    info = {f["format"]: f for f in res.summary["formats"]}
    assert info["codebook2:fitted+renorm+predict"]["bits_per_element"] == pytest.approx(
        info["codebook2:fitted+renorm"]["bits_per_element"])
    pred = res.summary["predictors"]
    f = HKV * D
    assert pred["key"]["bytes_per_layer"] == 2 * (f * f + f)
    assert pred["value"]["bytes_per_layer"] == 2 * (2 * f * f + f)
    assert pred["value"]["bits_per_element_at_capture_length"] == pytest.approx(
        8 * 2 * (2 * f * f + f) / (HKV * T * D))
    ev = [e for e in pred["explained_variance"] if e["layer"] == 2 and e["tensor"] == "key"]
    assert ev and min(e["explained_variance"] for e in ev) > 0.5


def test_predict_on_a_layer_subset_runs_the_chain_through_the_others(tmp_path):
    q, ks, vs = _chained_keys(layers=3, seed=4)
    path = make_capture(tmp_path / "s.h5", q, ks[0], vs[0], layers=3,
                        per_layer={i: {"k": ks[i], "k_pre": ks[i], "v": vs[i]} for i in range(3)})
    base = dict(bits=(2,), group_sizes=(8,), variants=("predict",))
    whole = compare_axes(path, CompareConfig(**base)).records
    only = compare_axes(path, CompareConfig(layers=(2,), **base)).records
    pick = sorted((x for x in whole if x.layer == 2), key=repr)
    assert sorted(only, key=repr) == pick


def test_predict_needs_two_samples_and_checks_codebook_names(tmp_path):
    q, ks, vs = _chained_keys()
    path = make_capture(tmp_path / "one.h5", q[:1], ks[0][:1], vs[0][:1])
    with pytest.raises(InputError, match="at least 2 samples"):
        compare_axes(path, CompareConfig(group_sizes=(8,), variants=("predict",)))
    for name in ("fitted+center+predict", "weighted+predict"):
        with pytest.raises(ConfigError, match="does not combine"):
            CompareConfig(codebooks=(name,))
    assert CompareConfig(codebooks=("Fitted+Predict+renorm",)).codebooks == (
        "fitted+renorm+predict",)


def test_fit_predict_applies_a_calibration_fit_to_other_data():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(HKV * D, HKV * D, generator=g)

    def pair(n):
        x = torch.randn(n, HKV, T, D, generator=g)
        y = (token_features(x) @ w).reshape(n, T, HKV, D).permute(0, 2, 1, 3)
        return x, y

    (xc, yc), (xe, ye) = pair(2), pair(1)
    pred, in_sample = fit_predict([xc], yc, [xe], ye, ridge=0.0)
    torch.testing.assert_close(pred, ye, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(in_sample, yc, atol=1e-3, rtol=1e-3)
    # no inputs: the calibration mean, broadcast over the evaluated tensor
    mean, _ = fit_predict([], yc, [], ye[:, :, :5])
    torch.testing.assert_close(mean, yc.mean(dim=(0, 2), keepdim=True).expand(1, -1, 5, -1))
    with pytest.raises(InputError, match="do not match"):
        fit_predict([xc], yc, [], ye)


def test_calibration_chain_fits_on_the_other_capture(tmp_path):
    """With a calibration capture, layer 1's map is fitted on the calibration chain's
    reconstruction of layer 0 and applied to the measured capture's reconstruction."""
    _, ks, vs = _chained_keys(noise=0.0, seed=6)
    _, cal_ks, cal_vs = _chained_keys(noise=0.0, seed=6)  # same maps...
    g = torch.Generator().manual_seed(7)
    cal_ks = [k + 0.01 * torch.randn(k.shape, generator=g) for k in cal_ks]  # ...other data
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), variants=("predict",), tensors=("key",))
    chain = PredictChain(cfg, rope_ok=False)
    chain.advance(0, ks[0], None, vs[0], calibration=(cal_ks[0], None, cal_vs[0]))
    hats1 = chain.advance(1, ks[1], None, vs[1], calibration=(cal_ks[1], None, cal_vs[1]))
    ckey = ("key", "per-token", 2, 8, "post")
    spec = QuantSpec(2, "per-token", 8)

    def code(r):
        return fake_quantize(r, spec)

    p0, c0 = fit_predict([], cal_ks[0], [], ks[0], chain.ridge)
    hat0, cal_hat0 = quantize_residual(ks[0], p0, code), quantize_residual(cal_ks[0], c0, code)
    p1, _ = fit_predict([cal_hat0], cal_ks[1], [hat0], ks[1], chain.ridge)
    torch.testing.assert_close(hats1[ckey], quantize_residual(ks[1], p1, code))


def test_predict_calibration_capture_in_compare_axes(tmp_path):
    q, ks, vs = _chained_keys(layers=3, seed=8)
    per = {i: {"k": ks[i], "k_pre": ks[i], "v": vs[i]} for i in range(3)}
    cal = make_capture(tmp_path / "cal.h5", q, ks[0], vs[0], layers=3, per_layer=per)
    one = make_capture(tmp_path / "one.h5", q[:1], ks[0][:1], vs[0][:1], layers=3,
                       per_layer={i: {n: t[:1] for n, t in d.items()} for i, d in per.items()})
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), variants=("predict",),
                        predict_calibration=str(cal))
    res = compare_axes(one, cfg)  # one sample is enough when the fit is elsewhere
    assert res.summary["predictors"]["fitted_on"] == f"every sample of {cal}"
    r = [x for x in res.records if x.layer == 2 and x.metric == "attention_output"
         and x.tensor == "key"]
    pred = sum(x.rel_error for x in r if x.variant == "predict")
    plain = sum(x.rel_error for x in r if x.variant == "plain")
    assert pred < 0.5 * plain
    other = make_capture(tmp_path / "other.h5", q, torch.cat([ks[0]] * 2, dim=1),
                         torch.cat([vs[0]] * 2, dim=1), layers=3)
    with pytest.raises(InputError, match="does not match"):
        compare_axes(one, CompareConfig(bits=(2,), group_sizes=(8,), variants=("predict",),
                                        predict_calibration=str(other)))
    with pytest.raises(ConfigError, match="needs --variants predict"):
        CompareConfig(predict_calibration=str(cal))
