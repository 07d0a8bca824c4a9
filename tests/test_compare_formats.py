"""compare-axes with engine KV-cache formats (``--formats``): planted answers, records,
summary, calibration, refusal of bad names, and the CLI table / JSON / plots."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_capture
from typer.testing import CliRunner

from kvlens.analysis.attention import rel_error
from kvlens.analysis.compare import CompareConfig, compare_axes
from kvlens.cli import app
from kvlens.errors import ConfigError
from kvlens.quant import fake_quantize_format, parse_format

S, HQ, HKV, T, D = 2, 4, 2, 48, 64


def offset_tensors(seed=0):
    """Keys and values sit on a large offset (100 + U[0, 1)): a zero-centred 4-bit grid
    (q4_0) spends its 16 levels on [-101, 101], q4_1's stored minimum puts them on [100, 101].
    Head 1 of the values is 1000x quieter than head 0, for the fp8 scale scope test."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, HQ, T, D, generator=g)
    k = 100 + torch.rand(S, HKV, T, D, generator=g)
    v = torch.randn(S, HKV, T, D, generator=g)
    v[:, 0] *= 1000.0
    v[:, 1] *= 1e-3
    return q, k, v


@pytest.fixture(scope="module")
def offset_run(tmp_path_factory):
    path = make_capture(tmp_path_factory.mktemp("fmt") / "run.h5", *offset_tensors(), layers=2)
    cfg = CompareConfig(
        bits=(4,),
        group_sizes=(32,),
        formats=("q4_0+norot", "q4_1+norot", "q4_0", "fp8_e4m3", "fp8_e4m3@head", "int8"),
    )
    return path, compare_axes(path, cfg)


def fmean(records, **match):
    vals = [r.rel_error for r in records if all(getattr(r, k) == v for k, v in match.items())]
    assert vals, match
    return sum(vals) / len(vals)


def test_q4_1_min_wins_on_offset_keys(offset_run):
    _, res = offset_run
    for metric in ("reconstruction", "score", "attention_output"):
        e0 = fmean(res.records, tensor="key", format="q4_0+norot", metric=metric)
        e1 = fmean(res.records, tensor="key", format="q4_1+norot", metric=metric)
        assert e1 < e0 / 5, (metric, e0, e1)


def test_format_records_are_errors_of_fake_quantize_format(offset_run):
    path, res = offset_run
    q, k, v = offset_tensors()
    for name in ("q4_0", "fp8_e4m3@head"):
        setting = parse_format(name)
        for tensor, x in (("key", k), ("value", v)):
            hat = fake_quantize_format(x, setting, tensor)
            for h in range(HKV):
                want = rel_error(x[:, h], hat[:, h])
                got = [
                    r.rel_error
                    for r in res.records
                    if r.format == setting.name
                    and r.tensor == tensor
                    and r.metric == "reconstruction"
                    and r.head == h
                ]
                assert got == pytest.approx([want, want], rel=1e-5)  # two identical layers


def test_format_records_fields_and_summary(offset_run):
    _, res = offset_run
    recs = [r for r in res.records if r.format == "q4_0"]
    assert {(r.axis, r.bits, r.group_size) for r in recs} == {("per-token", 4, 32)}
    assert {r.stage for r in recs if r.tensor == "key"} == {"post"}
    assert {r.stage for r in recs if r.tensor == "value"} == {None}
    # per layer: keys 2 KV heads x 1 + 4 query heads x 3 metrics, values 2 + 4
    assert len(recs) == 2 * ((HKV + 3 * HQ) + (HKV + HQ))
    fp8 = {(r.axis, r.group_size) for r in res.records if r.format == "fp8_e4m3@head"}
    assert fp8 == {("per-head", 0)}
    assert {r.axis for r in res.records if r.format == "fp8_e4m3"} == {"per-layer"}
    s = res.summary
    # the axis comparison only sees the integer specs
    assert all("format" not in m for m in s["means"])
    assert {(w["bits"], w["group_size"]) for w in s["winners"]} == {(4, 32)}
    names = [f["format"] for f in s["formats"]]
    assert names == [
        "q4_0+norot",
        "q4_1+norot",
        "q4_0",
        "fp8_e4m3",
        "fp8_e4m3@head",
        "int8@token-head",
    ]
    info = {f["format"]: f for f in s["formats"]}
    assert info["q4_0"]["rotated"] is True and info["q4_0+norot"]["rotated"] is False
    assert info["q4_1+norot"]["bits_per_element"] == 5.0
    assert info["int8@token-head"]["bits_per_element"] == 8.5
    assert info["fp8_e4m3"]["bits_per_element"] == pytest.approx(8 + 32 / (HKV * T * D))
    assert "in-sample" in info["fp8_e4m3"]["calibration"]
    assert "in-sample" in s["format_calibration"]
    fm = {(m["tensor"], m["format"], m["metric"]): m for m in s["format_means"]}
    assert fm[("key", "q4_0", "score")]["count"] == 2 * HQ
    assert ("value", "q4_0", "score") not in fm
    json.dumps(res.to_dict())  # JSON-ready


def test_per_head_fp8_scale_saves_the_quiet_head(offset_run):
    _, res = offset_run
    kw = dict(tensor="value", metric="reconstruction", head=1)
    tensor = fmean(res.records, format="fp8_e4m3", **kw)
    head = fmean(res.records, format="fp8_e4m3@head", **kw)
    # one scale for both heads puts head 1 (1e-6 of head 0) below e4m3's smallest subnormal
    assert tensor > 0.5 and head < 0.05, (tensor, head)


def test_formats_config_validation_and_round_trip():
    cfg = CompareConfig(formats=("FP8", "q8_0", "q8_0", "int4"))
    assert cfg.formats == ("fp8_e4m3", "q8_0", "int4@token-head")
    assert CompareConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match=r"Unknown KV-cache format 'q3_k'.*allowed: q8_0, q4_0"):
        CompareConfig(formats=("q3_k",))


def test_ggml_format_refused_on_head_dim_not_multiple_of_32(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    path = make_capture(tmp_path / "d16.h5", q, k, v)
    with pytest.raises(ConfigError, match=r"Format 'q8_0' does not fit.*multiples of 32"):
        compare_axes(path, CompareConfig(group_sizes=(8,), formats=("q8_0",)))
    # fp8 fits any head_dim
    res = compare_axes(path, CompareConfig(bits=(4,), group_sizes=(8,), formats=("fp8_e5m2",)))
    assert any(r.format == "fp8_e5m2" for r in res.records)


# -- CLI ---------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_formats_table_json_and_plots(offset_run, tmp_path):
    path, _ = offset_run
    args = ["compare-axes", str(path), "--bits", "4", "--layers", "0"]
    res = runner.invoke(app, [*args, "--formats",
                              "llamacpp:q4_0:norot,llamacpp:q4_1:norot,vllm:fp8_e4m3"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.replace("│", " ").split())
    assert "engine KV-cache formats" in out
    assert "q4_1+norot 5.00 no" in out and "q4_0+norot 4.50 no" in out
    assert "in-sample" in out
    res = runner.invoke(
        app, [*args, "--formats", "llama.cpp:q8_0/q8_0,vllm:int8-pth", "--json", "--plots",
              str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {r["format"] for r in data["records"]} == {None, "q8_0", "int8@token-head"}
    assert data["summary"]["config"]["formats"] == ["q8_0", "int8@token-head"]
    assert (tmp_path / "formats_key.png").stat().st_size > 0
    assert (tmp_path / "formats_value.png").stat().st_size > 0


def test_cli_unknown_format_is_one_clear_error(offset_run):
    path, _ = offset_run
    for formats, name in (("llamacpp:q4_0,llamacpp:nf4", "llamacpp:nf4"), ("nf4", "nf4")):
        res = runner.invoke(app, ["compare-axes", str(path), "--formats", formats])
        assert res.exit_code == 1
        out = " ".join(res.output.split())
        assert f"Unknown engine setting '{name}'" in out and "iq4_nl" in out
        assert "Traceback" not in res.output


@pytest.mark.parametrize("old,new", [
    ("q4_0", "llamacpp:q4_0"),
    ("q4_0+norot", "llamacpp:q4_0:norot"),
    ("iq4_nl+rot", "llamacpp:iq4_nl:rot"),
    ("fp8", "vllm:fp8_e4m3"),
    ("fp8_e5m2@head:p99.9", "vllm:fp8_e5m2@head:p99.9"),
    ("fp8_e4m3:s1", "vllm:fp8_e4m3:s1"),
    ("int4@token-head", "vllm:int4-pth"),
    ("fp8_per_token_head", "vllm:fp8-pth"),
])
def test_cli_old_format_spelling_is_refused_with_the_engine_setting(offset_run, old, new):
    """The bare cache-type names compare-axes took before are refused, naming the engine setting
    that measures the same format (which compare-axes then accepts)."""
    from kvlens.config.engine import measured_cache_types

    path, _ = offset_run
    res = runner.invoke(app, ["compare-axes", str(path), "--formats", old])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"write {new} for {old}" in " ".join(res.output.split())
    assert measured_cache_types(new) == (parse_format(old).name,)


def test_cli_settings_compare_axes_cannot_measure_say_why(offset_run):
    path, _ = offset_run
    for setting, why in (("llamacpp:q4_0/q8_0", "one type on keys and values"),
                         ("llamacpp:f16", "nothing to measure"),
                         ("sglang:fp8_e4m3", "vllm:fp8_e4m3 instead"),
                         ("vllm:fp8_e4m3:skip=1", "drop :skip="),
                         ("transformers:quanto-4", "--bits and --group-sizes"),
                         ("fp8_e4m3+rot", "no engine rotates")):
        res = runner.invoke(app, ["compare-axes", str(path), "--formats", setting])
        assert res.exit_code == 1 and "Traceback" not in res.output
        assert why in " ".join(res.output.split()), (setting, res.output)
