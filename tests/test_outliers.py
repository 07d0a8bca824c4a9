"""kvlens.analysis.outliers / plot-outliers on synthetic captures with planted outlier channels.

Layer 0 (head_dim 16, 2 KV heads, 4 query heads, 3 samples x 64 tokens, N(0,1) background):
- k_pre kv head 0: channel 3 at |x|=20 on every token; channel 10 at 20 on the first half of
  the tokens of every sample and 0 elsewhere (token stability 0.5); channel 5 at 20 on every token, whose RoPE
  pair (5, 13) rotates fast, so after RoPE half its energy sits in channel 13.
- k_pre kv head 1: channel 12 at 20 in sample 0 only, zero elsewhere (stability 1/3 both ways).
- q_pre query head 2: channel 7 at 20 on every token.
Layer 1: k/q background only; v kv head 0 channel 2 at 20 on every token.
"""

import json

import h5py
import pytest
import torch
from helpers import write_capture
from typer.testing import CliRunner

from kvlens.analysis.outliers import analyze_capture
from kvlens.capture.store import CaptureMeta
from kvlens.errors import CaptureFileError, InputError
from kvlens.model.shape import ModelShape
from kvlens.rope import apply_rope

S, HQ, HKV, T, D = 3, 4, 2, 64, 16
BIG = 20.0


def _rope_tables():
    # Slow rotation everywhere except the pair (5, 13), which turns 0.9 rad per token.
    inv_freq = torch.full((D // 2,), 1e-4)
    inv_freq[5] = 0.9
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos()[None].expand(S, T, D), emb.sin()[None].expand(S, T, D)


def _planted_tensors():
    g = torch.Generator().manual_seed(0)

    def noise(h):
        return torch.randn(S, h, T, D, generator=g)

    cos, sin = _rope_tables()
    tensors = {}
    for layer in (0, 1):
        k_pre, q_pre, v = noise(HKV), noise(HQ), noise(HKV)
        if layer == 0:
            k_pre[:, 0, :, 3] = BIG
            k_pre[:, 0, :, 10] = 0.0  # zero, not noise, off its tokens: stability exactly 0.5
            k_pre[:, 0, : T // 2, 10] = BIG
            k_pre[:, 0, :, 5] = BIG
            k_pre[:, 1, :, 12] = 0.0
            k_pre[0, 1, :, 12] = BIG
            q_pre[:, 2, :, 7] = BIG
        else:
            v[:, 0, :, 2] = BIG
        tensors[layer] = {"k_pre": k_pre, "q_pre": q_pre, "v": v,
                          "k": apply_rope(k_pre, cos, sin), "q": apply_rope(q_pre, cos, sin)}
    return tensors


def _meta(**kw):
    base = dict(model="planted", shape=ModelShape(2, HQ, HKV, D, rope={"rope_theta": 1.0}),
                rope_layout="half", rotary_dim=D,
                compute_dtype="float32", storage_dtype="float32", num_samples=S, num_tokens=T,
                layers=(0, 1))
    base.update(kw)
    return CaptureMeta(**base)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "planted.h5"
    write_capture(path, _meta(), _planted_tensors())
    return path


@pytest.fixture(scope="module")
def report(planted):
    return analyze_capture(planted)


def _head(report, layer, tensor, head):
    (h,) = [h for h in report.heads if (h.layer, h.tensor, h.head) == (layer, tensor, head)]
    return h


def test_detector_finds_exactly_the_planted_channels(report):
    found = {(h.layer, h.tensor, h.head): h.outlier_channels for h in report.heads
             if h.outliers and h.tensor in ("k_pre", "q_pre", "v")}
    assert found == {(0, "k_pre", 0): (3, 5, 10), (0, "k_pre", 1): (12,),
                     (0, "q_pre", 2): (7,), (1, "v", 0): (2,)}


def test_token_and_sample_stability(report):
    by = {o.channel: o for o in _head(report, 0, "k_pre", 0).outliers}
    assert by[3].token_stability == 1.0 and by[5].token_stability == 1.0
    assert by[10].token_stability == 0.5
    assert all(o.sample_stability == 1.0 for o in by.values())
    (o12,) = _head(report, 0, "k_pre", 1).outliers
    assert o12.token_stability == pytest.approx(1 / 3, abs=1e-4)
    assert o12.sample_stability == pytest.approx(1 / 3, abs=1e-4)
    assert o12.absmax == BIG and o12.ratio > 4.0


def test_rope_pair_energy_moves_into_partner(report):
    shifts = {r.channel: r for r in _head(report, 0, "k_pre", 0).rope}
    fast = shifts[5]
    assert fast.partner == 13
    assert fast.partner_share_pre < 0.01
    assert 0.35 < fast.partner_share_post < 0.65
    assert fast.partner_outlier_post and fast.outlier_post
    assert fast.token_stability_post < 0.9  # smeared: not in the top set on every token
    slow = shifts[3]  # the pair (3, 11) barely rotates in 64 tokens
    assert slow.partner == 11 and slow.partner_share_post < 0.01 and slow.outlier_post
    assert slow.token_stability_post == 1.0
    post = _head(report, 0, "k", 0).outlier_channels
    assert 13 in post and 3 in post


def test_no_false_positives_and_severity(report):
    for h in report.heads:
        if h.layer == 1 and h.tensor != "v":
            assert h.outliers == () and h.max_ratio < 4.0
    planted_head = _head(report, 0, "k_pre", 0)
    assert planted_head.max_ratio == pytest.approx(BIG / planted_head.median_absmax, rel=1e-3)
    assert planted_head.kurtosis > _head(report, 1, "k_pre", 0).kurtosis
    assert 2.5 < _head(report, 1, "k_pre", 0).kurtosis < 3.5  # Gaussian background
    assert _head(report, 0, "q", 2).kv_head == 1


def test_report_is_json_and_profiles_optional(report):
    full = json.loads(json.dumps(report.to_dict()))
    assert full["rule"]["threshold"] == 4.0 and len(full["heads"]) == len(report.heads)
    assert len(full["heads"][0]["channel_absmax"]) == D
    slim = report.to_dict(profiles=False)
    assert "channel_p99" not in slim["heads"][0]
    h = _head(report, 0, "k_pre", 0)
    assert all(p50 <= p99 <= m for p50, p99, m in
               zip(h.channel_p50, h.channel_p99, h.channel_absmax, strict=True))


def test_selection_and_threshold(planted):
    r = analyze_capture(planted, layers="0", heads="1", tensors="q,k", threshold=3.0)
    assert r.layers == (0,) and r.tensors == ("q", "k")
    assert {h.head for h in r.heads if h.tensor == "q_pre"} == {2, 3}
    assert {h.head for h in r.heads if h.tensor == "k"} == {1}
    assert not any(h.tensor == "v" for h in r.heads)


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold": 1.0}, "must be a number > 1"),
    ({"tensors": "q,x"}, "allowed: q, k, v"),
    ({"layers": "0-5"}, "outside 0-1"),
    ({"heads": "2"}, "outside 0-1"),
])
def test_bad_arguments(planted, kwargs, match):
    with pytest.raises(InputError, match=match):
        analyze_capture(planted, **kwargs)


def test_foreign_file_rejected(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["x"] = [1, 2, 3]
    with pytest.raises(CaptureFileError, match="not a kvlens capture"):
        analyze_capture(path)


# -- CLI ------------------------------------------------------------------------------------------

def _cli(*args):
    from kvlens.cli import app

    return CliRunner().invoke(app, ["plot-outliers", *map(str, args)])


def test_cli_writes_figures_and_json(planted, tmp_path):
    out = tmp_path / "figs"
    res = _cli(planted, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    names = {p.split("/")[-1] for p in data["figures"]}
    assert {"overview.png", "layer00_k.png", "layer00_q.png", "layer00_v.png"} <= names
    assert any(n.startswith("heatmap_layer00_kv") for n in names)  # most severe k_pre head
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored = json.loads((out / "outliers.json").read_text())
    assert "channel_absmax" in stored["heads"][0]
    k0 = [h for h in data["heads"] if (h["layer"], h["tensor"], h["head"]) == (0, "k_pre", 0)]
    assert [o["channel"] for o in k0[0]["outliers"]] == [3, 5, 10]


def test_cli_table_svg_and_selection(planted, tmp_path):
    out = tmp_path / "svg"
    res = _cli(planted, "--out", out, "--format", "svg", "--tensors", "k",
               "--profile-layers", "1", "--heatmap", "0:1")
    assert res.exit_code == 0, res.output
    assert "Strongest outlier channels" in res.stdout and "L0 k_pre h0" in res.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["heatmap_layer00_kv1.svg", "layer01_k.svg", "outliers.json",
                     "overview.svg"]
    assert (out / "overview.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("args, match", [
    (["missing.h5"], "not found"),
    (["{foreign}"], "not a kvlens capture"),
    (["{planted}", "--layers", "zero"], "Invalid layer spec"),
    (["{planted}", "--layers", "7"], "outside 0-1"),
    (["{planted}", "--format", "gif"], "allowed: png, svg, pdf"),
    (["{planted}", "--tensors", "kv"], "allowed: q, k, v"),
    (["{planted}", "--heatmap", "0-1"], "expected LAYER:KVHEAD"),
    (["{planted}", "--heatmap", "0:5"], "KV head outside"),
])
def test_cli_bad_input_exit_1(planted, tmp_path, args, match):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1]
    args = [a.format(planted=planted, foreign=foreign) if a.startswith("{") else
            (str(tmp_path / a) if a == "missing.h5" else a) for a in args]
    res = _cli(*args, "--out", tmp_path / "o")
    assert res.exit_code == 1
    assert match in " ".join(res.stderr.split())
    assert "Traceback" not in res.output
