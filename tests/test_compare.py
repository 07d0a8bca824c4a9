"""compare-axes library: records and summary on synthetic captures with planted answers."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_capture

from kvlens.analysis.compare import CompareConfig, compare_axes, parse_int_list, parse_layers
from kvlens.errors import CaptureFileError, ConfigError, InputError
from kvlens.quant import rope_tables_for
from kvlens.rope import apply_rope

S, HQ, HKV, T, D = 2, 4, 2, 64, 16


def kivi_tensors(seed=0):
    """Planted KIVI structure.

    Keys: channel 3 is an outlier (30 on every token), so per-token groups holding it are
    coarse while per-channel groups isolate it; queries are ~0 there. Token 0 is an attention sink: every query
    points along channel 0 and k[0, 0] = 40, so each query puts weight ~1 on token 0.
    Values: every channel has its own offset (spread over [-8, 8]) plus small noise, so a
    token's channels span a wide range (per-token coarse) while a channel's tokens do not
    (per-channel fine) -- except in the first token group, where token 1 mirrors the offsets
    and the sink token 0 is the constant 1.0. Per-token quantization reproduces that constant
    token exactly; per-channel puts it mid-range in a coarse group. The output is ~v[0], so
    per-channel has lower reconstruction but far higher attention-output error.
    """
    g = torch.Generator().manual_seed(seed)
    q = 0.3 * torch.randn(S, HQ, T, D, generator=g)
    q[..., 0] += 4.0
    q[..., 3] *= 0.03  # queries barely read the key outlier channel (what MiKV exploits)
    k = torch.randn(S, HKV, T, D, generator=g)
    k[..., 3] = 30.0 + 0.1 * torch.randn(S, HKV, T, generator=g)
    k[:, :, 0, 0] = 40.0
    offsets = torch.linspace(-8, 8, D)[torch.randperm(D, generator=g)]
    v = offsets + 0.1 * torch.randn(S, HKV, T, D, generator=g)
    v[:, :, 1] = -offsets
    v[:, :, 0] = 1.0
    return q, k, v


def by(records, **match):
    return [r for r in records if all(getattr(r, k) == val for k, val in match.items())]


def mean(records, **match):
    vals = [r.rel_error for r in by(records, **match)]
    assert vals, match
    return sum(vals) / len(vals)


@pytest.fixture(scope="module")
def kivi_run(tmp_path_factory):
    path = make_capture(tmp_path_factory.mktemp("kivi") / "run.h5", *kivi_tensors(), layers=2)
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), variants=("balancer", "outliers"))
    return path, compare_axes(path, cfg)


def test_planted_key_outlier_channel_per_channel_wins(kivi_run):
    _, res = kivi_run
    plain = dict(tensor="key", variant="plain", stage="post")
    for metric in ("reconstruction", "score", "attention_weights"):
        tok = mean(res.records, axis="per-token", metric=metric, **plain)
        ch = mean(res.records, axis="per-channel", metric=metric, **plain)
        assert ch < tok / 1.5, (metric, tok, ch)
    # every single (layer, head), not only the mean
    for r in by(res.records, axis="per-channel", metric="score", **plain):
        (other,) = by(
            res.records, axis="per-token", metric="score", layer=r.layer, head=r.head, **plain
        )
        assert r.rel_error < other.rel_error
    wins = {
        (w["metric"]): w
        for w in res.summary["winners"]
        if w["tensor"] == "key" and w["variant"] == "plain"
    }
    assert wins["score"]["winner"] == "per-channel"
    assert wins["score"]["layers_per_channel_better"] == 2 == wins["score"]["layers"]


def test_planted_value_structure_reconstruction_and_output_disagree(kivi_run):
    _, res = kivi_run
    plain = dict(tensor="value", variant="plain")
    rec_tok = mean(res.records, axis="per-token", metric="reconstruction", **plain)
    rec_ch = mean(res.records, axis="per-channel", metric="reconstruction", **plain)
    out_tok = mean(res.records, axis="per-token", metric="attention_output", **plain)
    out_ch = mean(res.records, axis="per-channel", metric="attention_output", **plain)
    assert rec_ch < rec_tok / 2
    assert out_ch > 10 * out_tok
    (dis,) = [d for d in res.summary["disagreements"] if d["variant"] == "plain"]
    assert dis["tensor"] == "value" and dis["reconstruction"] == "per-channel"
    assert dis["attention_output"] == "per-token"
    (kivi,) = res.summary["kivi_pattern"]
    assert kivi["holds"] and kivi["bits"] == 2 and kivi["group_size"] == 8


def test_exact_sink_token_removes_the_value_disagreement(kivi_run):
    """In the planted data the per-channel value output error comes from the sink token alone:
    read exact (as a cache keeping sinks at full precision does), per-channel wins output too."""
    path, before = kivi_run
    cfg = CompareConfig(bits=(2,), group_sizes=(8,), tensors=("value",), sink_tokens=1)
    res = compare_axes(path, cfg)
    plain = dict(tensor="value", variant="plain", metric="attention_output")
    out_ch_before = mean(before.records, axis="per-channel", **plain)
    out_ch = mean(res.records, axis="per-channel", **plain)
    assert out_ch < 1e-3 * out_ch_before
    assert out_ch <= mean(res.records, axis="per-token", **plain) + 1e-6
    # reconstruction still covers every token: unchanged
    rec = dict(tensor="value", variant="plain", metric="reconstruction", axis="per-channel")
    assert mean(res.records, **rec) == pytest.approx(mean(before.records, **rec))
    assert CompareConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="sink tokens"):
        CompareConfig(sink_tokens=-1)


def test_record_shape_heads_and_json(kivi_run):
    _, res = kivi_run
    out = json.loads(json.dumps(res.to_dict()))
    rec = out["records"][0]
    assert set(rec) >= {
        "layer",
        "head",
        "tensor",
        "axis",
        "bits",
        "group_size",
        "stage",
        "variant",
        "metric",
        "rel_error",
    }
    # reconstruction per KV head, attention metrics per query head
    assert {r.head for r in by(res.records, metric="reconstruction")} == set(range(HKV))
    assert {r.head for r in by(res.records, metric="attention_output")} == set(range(HQ))
    assert {r.stage for r in by(res.records, tensor="value")} == {None}
    assert not by(res.records, tensor="value", metric="score")
    assert not by(res.records, tensor="value", variant="balancer")
    # 2 layers x 2 axes: keys 3 transforms x (2 + 3 x 4) records, values 2 x (2 + 4)
    assert len(res.records) == 2 * 2 * (3 * 14 + 2 * 6)
    assert out["summary"]["config"]["variants"] == ["balancer", "outliers"]
    means = {
        (m["tensor"], m["axis"], m["variant"], m["metric"]): m for m in out["summary"]["means"]
    }
    m = means[("key", "per-channel", "plain", "score")]
    assert m["count"] == 2 * HQ
    assert m["mean"] == pytest.approx(
        mean(res.records, tensor="key", axis="per-channel", variant="plain", metric="score")
    )


def test_transforms_help_where_planted(kivi_run):
    _, res = kivi_run
    key_tok = dict(tensor="key", axis="per-token")
    # MiKV balancer: q is small on the outlier channel, so it squeezes the key outlier
    assert mean(res.records, variant="balancer", metric="score", **key_tok) < 0.5 * mean(
        res.records, variant="plain", metric="score", **key_tok
    )
    # one outlier per token vector: the planted channel is taken out of the per-token range
    assert mean(res.records, variant="outliers", metric="reconstruction", **key_tok) < 0.5 * mean(
        res.records, variant="plain", metric="reconstruction", **key_tok
    )


def outlier_channel_tensors(seed=0):
    """Keys and values with one huge channel on every token (keys: channel 3, which queries
    barely read; values: channel 5), Gaussian elsewhere: the case rotation is made for."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, HQ, T, D, generator=g)
    q[..., 3] *= 0.03
    k = torch.randn(S, HKV, T, D, generator=g)
    k[..., 3] = 30.0 + torch.randn(S, HKV, T, generator=g)
    v = torch.randn(S, HKV, T, D, generator=g)
    v[..., 5] = 30.0 + torch.randn(S, HKV, T, generator=g)
    return q, k, v


def test_rotate_spreads_a_planted_outlier_channel(tmp_path):
    path = make_capture(tmp_path / "o.h5", *outlier_channel_tensors())
    # per-token groups are whole token vectors (G = D): rotation spreads the outlier over them
    cfg = CompareConfig(bits=(4,), group_sizes=(D,), variants=("rotate",))
    res = compare_axes(path, cfg)
    for tensor, metrics in (
        ("key", ("reconstruction", "score")),
        ("value", ("reconstruction", "attention_output")),
    ):
        for metric in metrics:
            tok = dict(tensor=tensor, axis="per-token", metric=metric)
            rotated = mean(res.records, variant="rotate", **tok)
            plain = mean(res.records, variant="plain", **tok)
            assert rotated < 0.6 * plain, (tensor, metric, rotated, plain)
            # per-channel groups already isolate the outlier; rotating changes little
            ch = dict(tok, axis="per-channel")
            assert mean(res.records, variant="rotate", **ch) == pytest.approx(
                mean(res.records, variant="plain", **ch), rel=0.1
            )
    assert {w["variant"] for w in res.summary["winners"]} == {"plain", "rotate"}


def test_rotate_records_are_errors_in_the_original_basis(tmp_path):
    from kvlens.quant import QuantSpec, hadamard_rotation, quantize_pre_rope, quantize_rotated

    q, k, v, q_pre, k_pre = rope_tensors()
    path = make_capture(tmp_path / "r.h5", q, k, v, q_pre=q_pre, k_pre=k_pre, rope_theta=10000.0)
    cfg = CompareConfig(
        bits=(2,), group_sizes=(8,), stages=("post", "pre"), variants=("rotate",), rotation_seed=4
    )
    res = compare_axes(path, cfg)
    r = hadamard_rotation(D, 4)
    spec = QuantSpec(2, "per-token", 8)
    cos, sin = rope_tables_for(torch.arange(T).expand(S, -1), D, 10000.0)
    expected = {
        ("value", None): quantize_rotated(v, spec, r),
        ("key", "post"): quantize_rotated(k, spec, r),
        ("key", "pre"): quantize_pre_rope(k_pre, cos, sin, spec, rotation=r),
    }
    for (tensor, stage), hat in expected.items():
        x = v if tensor == "value" else k
        for head in range(HKV):
            (rec,) = by(
                res.records,
                tensor=tensor,
                stage=stage,
                variant="rotate",
                axis="per-token",
                metric="reconstruction",
                head=head,
            )
            want = float((x[:, head] - hat[:, head]).norm() / x[:, head].norm())
            assert rec.rel_error == pytest.approx(want, rel=1e-4), (tensor, stage, head)
    # the seed matters: plain Hadamard gives other errors
    other = compare_axes(path, CompareConfig(bits=(2,), group_sizes=(8,), variants=("rotate",)))
    a = mean(
        res.records, variant="rotate", tensor="value", axis="per-token", metric="reconstruction"
    )
    b = mean(
        other.records, variant="rotate", tensor="value", axis="per-token", metric="reconstruction"
    )
    assert a != b


def test_rotate_refuses_odd_head_dim(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 9, generator=g) for h in (2, 1, 1))
    path = make_capture(tmp_path / "odd.h5", q, k, v)
    with pytest.raises(ConfigError, match=r"Variant 'rotate' does not fit.*head_dim 9.*Supported"):
        compare_axes(path, CompareConfig(group_sizes=(3,), variants=("rotate",)))
    assert compare_axes(path, CompareConfig(group_sizes=(3,), bits=(2,))).records


def test_constant_tensors_give_zero_error_and_ties(tmp_path):
    q = torch.full((S, HQ, T, D), 0.5)
    k = torch.full((S, HKV, T, D), -0.75)
    v = torch.full((S, HKV, T, D), 1.25)
    res = compare_axes(make_capture(tmp_path / "c.h5", q, k, v), CompareConfig(group_sizes=(8,)))
    assert res.records and all(r.rel_error == 0.0 for r in res.records)
    assert {w["winner"] for w in res.summary["winners"]} == {"tie"}
    assert not res.summary["disagreements"]
    assert not any(k["holds"] for k in res.summary["kivi_pattern"])


def test_gqa_mapping_matches_repeated_heads(tmp_path):
    q, k, v = kivi_tensors(seed=3)
    gqa = compare_axes(
        make_capture(tmp_path / "gqa.h5", q, k, v), CompareConfig(bits=(2, 4), group_sizes=(8,))
    )
    groups = HQ // HKV
    mha = compare_axes(
        make_capture(
            tmp_path / "mha.h5", q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        ),
        CompareConfig(bits=(2, 4), group_sizes=(8,)),
    )
    ref = {(r.tensor, r.axis, r.bits, r.metric, r.head): r.rel_error for r in mha.records}
    assert len(gqa.records) < len(mha.records)
    for r in gqa.records:
        if r.metric == "reconstruction":  # KV head j of GQA = heads j*groups.. of MHA
            for h in range(r.head * groups, (r.head + 1) * groups):
                assert r.rel_error == pytest.approx(
                    ref[(r.tensor, r.axis, r.bits, r.metric, h)], rel=1e-9
                )
        else:
            assert r.rel_error == pytest.approx(
                ref[(r.tensor, r.axis, r.bits, r.metric, r.head)], rel=1e-6, abs=1e-12
            )


def rope_tensors(theta=10000.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_pre = torch.randn(S, HQ, T, D, generator=g)
    k_pre = torch.randn(S, HKV, T, D, generator=g)
    k_pre[..., 0] = (
        20.0  # a stable pre-RoPE outlier channel; RoPE (1 rad/token) smears it over (0, 8)
    )
    v = torch.randn(S, HKV, T, D, generator=g)
    cos, sin = rope_tables_for(torch.arange(T).expand(S, -1), D, theta)
    return apply_rope(q_pre, cos, sin), apply_rope(k_pre, cos, sin), v, q_pre, k_pre


def test_pre_rope_keys_isolate_the_outlier_that_rope_smears(tmp_path):
    q, k, v, q_pre, k_pre = rope_tensors()
    path = make_capture(tmp_path / "r.h5", q, k, v, q_pre=q_pre, k_pre=k_pre, rope_theta=10000.0)
    res = compare_axes(
        path, CompareConfig(bits=(2,), group_sizes=(8,), stages=("post", "pre"), tensors=("key",))
    )
    ch = dict(tensor="key", axis="per-channel", variant="plain")
    for metric in ("reconstruction", "score"):
        pre = mean(res.records, stage="pre", metric=metric, **ch)
        post = mean(res.records, stage="post", metric=metric, **ch)
        assert pre < 0.5 * post, (metric, pre, post)
    assert not by(res.records, tensor="value")


def test_pre_rope_refuses_unreproducible_rope_and_missing_rope(tmp_path):
    q, k, v, q_pre, k_pre = rope_tensors(theta=10000.0)
    # metadata that disagrees with the stored keys, or none: the layer's theta is found
    for i, record in enumerate((True, False)):
        other = make_capture(tmp_path / f"t{i}.h5", q, k, v, q_pre=q_pre, k_pre=k_pre,
                             rope_theta=500000.0, record_theta=record)
        res = compare_axes(other, CompareConfig(stages=("pre",), group_sizes=(8,)))
        assert by(res.records, stage="pre")
    # linearly scaled positions (as in scaled RoPE variants): no default table rebuilds them
    cos, sin = rope_tables_for(torch.arange(k.shape[2]).expand(k.shape[0], -1) * 0.5,
                               k.shape[-1], 10000.0)
    wrong = make_capture(tmp_path / "yarn.h5", q, apply_rope(k_pre, cos, sin), v, q_pre=q_pre,
                         k_pre=k_pre, rope_theta=10000.0)
    with pytest.raises(InputError, match="RoPE variant"):
        compare_axes(wrong, CompareConfig(stages=("pre",), group_sizes=(8,)))
    compare_axes(wrong, CompareConfig(stages=("post",), group_sizes=(8,)))  # post is fine
    plain = make_capture(tmp_path / "norope.h5", *kivi_tensors())
    with pytest.raises(InputError, match="needs a capture of a model with RoPE"):
        compare_axes(plain, CompareConfig(stages=("post", "pre"), group_sizes=(8,)))


def test_fit_errors_layers_samples_and_progress(tmp_path):
    path = make_capture(tmp_path / "k.h5", *kivi_tensors(), layers=3)
    with pytest.raises(
        ConfigError, match="does not divide head_dim 16; allowed group sizes: 1, 2, 4, 8, 16"
    ):
        compare_axes(path, CompareConfig(group_sizes=(6,)))
    with pytest.raises(InputError, match="Layer 5 is not in"):
        compare_axes(path, CompareConfig(layers=(5,), group_sizes=(8,)))
    with pytest.raises(CaptureFileError, match="not found"):
        compare_axes(tmp_path / "missing.h5")
    calls = []
    res = compare_axes(
        path,
        CompareConfig(layers=parse_layers("0,2"), group_sizes=(8,), bits=(2,), samples=1),
        progress=lambda d, t, n: calls.append((d, t)),
    )
    assert {r.layer for r in res.records} == {0, 2}
    assert res.summary["capture"]["samples"] == 1 and calls[0] == (0, 2) and calls[-1] == (2, 2)
    # per-channel groups may exceed T (one partial group): allowed
    assert compare_axes(path, CompareConfig(group_sizes=(16,), bits=(4,), layers=(0,))).records


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": (9,)}, "Invalid bits 9"),
        ({"bits": ()}, "No bit widths"),
        ({"group_sizes": (0,)}, "Invalid group size 0"),
        ({"stages": ("mid",)}, "Unknown stage 'mid'; allowed: post, pre"),
        (
            {"variants": ("gear",)},
            "Unknown variant 'gear'; allowed: balancer, outliers, rotate",
        ),
        ({"rotation_seed": -1}, "Invalid rotation seed -1"),
        ({"outlier_fraction": 0.0}, "Invalid outlier fraction"),
        ({"samples": 0}, "Invalid samples"),
        ({"samples": True}, "Invalid samples"),  # a bool is not a count
        ({"samples": 2.0}, "Invalid samples"),
        ({"bits": (8, 9)}, "Invalid bits 9"),  # 8 is the upper edge, 9 past it
        ({"bits": (False,)}, "Invalid bits False"),
        ({"tensors": ("query",)}, "Unknown tensor"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CompareConfig(**kwargs)


def test_config_round_trip_and_parsers():
    cfg = CompareConfig(bits=(4, 2, 4), stages=("pre", "post"), layers=(3, 1), rotation_seed=3)
    assert cfg.bits == (4, 2) and cfg.layers == (1, 3)
    assert CompareConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="Unknown compare config keys"):
        CompareConfig.from_dict({"bitz": [2]})
    assert parse_int_list("2, 4", "bits") == (2, 4)
    with pytest.raises(InputError, match="Invalid bits"):
        parse_int_list("2,x", "bits")
    assert parse_layers("all") is None and parse_layers("0,4-5") == (0, 4, 5)


def test_streams_one_layer_at_a_time(tmp_path, monkeypatch):
    """Each layer is read (and finished) before the next one is touched."""
    from kvlens.capture.store import LayerData

    path = make_capture(tmp_path / "s.h5", *kivi_tensors(), layers=3)
    events = []
    real_read = LayerData.read

    def read(self, name, samples=None, heads=None):
        events.append(("read", self.index, name))
        return real_read(self, name, samples, heads)

    monkeypatch.setattr(LayerData, "read", read)
    compare_axes(
        path,
        CompareConfig(bits=(2,), group_sizes=(8,)),
        progress=lambda done, total, note: events.append(("done", done)),
    )
    layers_in_order = [e[1] for e in events if e[0] == "read"]
    assert layers_in_order == sorted(layers_in_order)
    assert [e for e in events if e[0] == "read" and e[1] == 1] == [
        ("read", 1, "q"),
        ("read", 1, "k"),
        ("read", 1, "v"),
    ]  # no k_pre for post only
    # progress reports layer i done before layer i+1 is read
    assert events.index(("done", 1)) < events.index(("read", 1, "q"))


def test_is_int_bounds_and_bools():
    from kvlens.errors import is_int

    assert is_int(0, 0) and is_int(8, 1, 8) and is_int(10**9, 1)
    assert not is_int(-1, 0) and not is_int(9, 1, 8) and not is_int(0, 1)
    assert not is_int(True, 0) and not is_int(1.0, 0) and not is_int("3", 0) and not is_int(None, 0)


# -- removed variants and the pre stage's RoPE ------------------------------------------------


@pytest.mark.parametrize("variant", ["center", "predict", "lowrank"])
def test_removed_variants_are_unknown(variant):
    """Key centring, cross-layer prediction and GEAR's low-rank residual were removed (issue
    #57, negative results): asking for them lists the variants that remain."""
    with pytest.raises(ConfigError, match=rf"Unknown variant '{variant}'; allowed: balancer, "
                                          "outliers, rotate"):
        CompareConfig(variants=(variant,))


def test_pre_stage_needs_a_capture_with_rope(tmp_path):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, h, T, D, generator=g) for h in (HQ, HKV, HKV))
    plain = make_capture(tmp_path / "n.h5", q, k, v)
    with pytest.raises(InputError, match="Stage 'pre' needs"):
        compare_axes(plain, CompareConfig(bits=(2,), group_sizes=(8,), stages=("post", "pre")))
