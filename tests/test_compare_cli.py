"""`kvlens compare-axes` through Typer's runner: table, JSON, plots and bad input."""

from __future__ import annotations

import json

import pytest
from helpers import make_capture
from test_compare import kivi_tensors, rope_tensors
from typer.testing import CliRunner

from kvlens.cli import app

runner = CliRunner()
SMALL = ["--bits", "2", "--group-sizes", "8"]


def _run(*args):
    return runner.invoke(app, ["compare-axes", *map(str, args)])


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    return make_capture(tmp_path_factory.mktemp("cli") / "run.h5", *kivi_tensors(), layers=2)


def test_table_shows_winners_disagreement_and_kivi_verdict(capture):
    res = _run(capture, *SMALL)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "compare-axes: synthetic, 2 layers" in out
    assert "per-token" in out and "per-channel" in out and "output" in out
    assert "0.0254*" in out  # per-channel value reconstruction, starred as the winner
    assert (
        "disagreement values 2-bit G8 plain: reconstruction favours per-channel, "
        "attention output favours per-token." in " ".join(out.split())
    )
    assert "KIVI pattern at 2-bit G8: holds" in out


def test_json_records_and_summary(capture):
    res = _run(
        capture, *SMALL, "--layers", "1", "--samples", "1", "--variants", "outliers", "--json"
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    recs = data["records"]
    assert {r["layer"] for r in recs} == {1}
    assert {r["variant"] for r in recs} == {"plain", "outliers"}
    assert set(recs[0]) >= {
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
    summary = data["summary"]
    assert summary["capture"]["samples"] == 1 and summary["config"]["bits"] == [2]
    assert summary["kivi_pattern"][0]["holds"] is True
    assert {w["metric"] for w in summary["winners"] if w["tensor"] == "value"} == {
        "reconstruction",
        "attention_output",
    }


def test_plots_written(capture, tmp_path):
    out = tmp_path / "figs"
    res = _run(capture, *SMALL, "--plots", out, "--json")
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in out.iterdir())
    figures = [
        "heatmap_key_2b_G8_post_plain.png",
        "heatmap_value_2b_G8_plain.png",
        "layers_key_2b_G8_post_plain.png",
        "layers_value_2b_G8_plain.png",
    ]
    assert names == ["compare-axes.json", *figures]
    # the artifact `kvlens report` reads: the same summary, the figures, per-layer means
    doc = json.loads((out / "compare-axes.json").read_text())
    assert doc["kvlens_report"] == "compare-axes" and sorted(doc["figures"]) == figures
    assert doc["summary"]["means"] == json.loads(res.stdout)["summary"]["means"]
    assert {m["layer"] for m in doc["layer_means"]} == set(doc["summary"]["capture"]["layers"])
    assert all((out / n).read_bytes()[:4] == b"\x89PNG" for n in figures)


def test_rotate_variant_in_table_json_and_plots(capture, tmp_path):
    res = _run(capture, *SMALL, "--variants", "rotate", "--rotation-seed", "3")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "K 2b G8 post rotate" in out and "V 2b G8 rotate" in out
    assert "disagreement values 2-bit G8 rotate" in " ".join(out.split())
    figs = tmp_path / "figs"
    res = _run(capture, *SMALL, "--variants", "rotate", "--json", "--plots", figs)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {r["variant"] for r in data["records"]} == {"plain", "rotate"}
    summary = data["summary"]
    assert summary["config"]["variants"] == ["rotate"]
    assert summary["config"]["rotation_seed"] is None
    rotated = [m for m in summary["means"] if m["variant"] == "rotate"]
    assert {(m["tensor"], m["metric"]) for m in rotated} == {
        ("key", "reconstruction"),
        ("key", "score"),
        ("key", "attention_weights"),
        ("key", "attention_output"),
        ("value", "reconstruction"),
        ("value", "attention_output"),
    }
    assert {r["variant"] for r in summary["rankings"]} == {"plain", "rotate"}
    names = {p.name for p in figs.iterdir()}
    assert {"heatmap_key_2b_G8_post_rotate.png", "layers_value_2b_G8_rotate.png"} <= names


def test_rotate_on_odd_head_dim_is_one_clear_error(tmp_path):
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 9, generator=g) for h in (2, 1, 1))
    path = make_capture(tmp_path / "odd.h5", q, k, v)
    res = _run(path, "--bits", "2", "--group-sizes", "3", "--variants", "rotate")
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "No Hadamard rotation for head_dim 9" in text and "Supported: even head_dim" in text
    assert "Traceback" not in res.output


def test_pre_stage_on_rope_capture(tmp_path):
    q, k, v, q_pre, k_pre = rope_tensors()
    path = make_capture(tmp_path / "r.h5", q, k, v, q_pre=q_pre, k_pre=k_pre, rope_theta=10000.0)
    res = _run(path, *SMALL, "--stages", "post,pre", "--json")
    assert res.exit_code == 0, res.output
    stages = {r["stage"] for r in json.loads(res.stdout)["records"]}
    assert stages == {"post", "pre", None}


def test_foreign_hdf5_is_refused(tmp_path):
    import h5py

    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["x"] = [1, 2, 3]
    res = _run(path)
    assert res.exit_code == 1
    assert "not a kvlens capture" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-sizes", "5"], "group size 5 does not divide head_dim 16"),
        (["--bits", "9"], "Invalid bits 9; allowed: integers 1-8"),
        (["--bits", "two"], "Invalid bits 'two'"),
        (["--group-sizes", "0"], "Invalid group size 0"),
        (["--stages", "pre"], "needs a capture of a model with RoPE"),
        (["--stages", "middle"], "Unknown stage 'middle'; allowed: post, pre"),
        (["--variants", "gear"], "Unknown variant 'gear'"),
        (["--layers", "7"], "Layer 7 is not in"),
        (["--layers", "x"], "Invalid layer spec"),
    ],
)
def test_bad_options(capture, args, message):
    res = _run(capture, *SMALL, *args)
    assert res.exit_code == 1, res.output
    assert message in " ".join(res.output.split())
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args", [["--samples", "0"], ["--threads", "0"],
                                  ["--outlier-fraction", "2"], ["--rotation-seed", "-1"],
                                  ["--sinks", "-1"]])
def test_numbers_outside_their_declared_range_are_refused_by_the_parser(capture, args):
    """Exit code 2, as for every command: the range is declared on the option."""
    res = _run(capture, *SMALL, *args)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{args[0]}'" in " ".join(res.output.split())


def test_an_option_of_a_variant_is_read_with_it(capture):
    """--outlier-fraction, --rotation-seed are accepted with the variant that reads them (and
    refused without it: tests/test_bad_input.py)."""
    res = _run(capture, *SMALL, "--bits", "2", "--variants", "outliers,rotate",
               "--outlier-fraction", "0.05", "--rotation-seed", "3", "--samples", "1")
    assert res.exit_code == 0, res.output


def test_missing_file_and_plots_on_a_file(capture, tmp_path):
    res = _run(tmp_path / "nope.h5")
    assert res.exit_code == 1 and "Capture file not found" in res.output
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    res = _run(capture, *SMALL, "--plots", blocker)
    assert res.exit_code == 1 and "is not a directory" in res.output


def test_removed_options_are_refused(capture):
    """--codebooks, --predict-calibration, the center / predict variants and GEAR's lowrank
    variant with its --rank were removed (issue #57, negative results): asking for them is a
    usage error, not a silent no-op."""
    for args, message in ((("--codebooks", "lloyd-max"), "No such option: --codebooks"),
                          (("--predict-calibration", "x.h5"), "No such option"),
                          (("--variants", "center"), "Unknown variant 'center'"),
                          (("--variants", "predict"), "Unknown variant 'predict'"),
                          (("--variants", "lowrank"), "Unknown variant 'lowrank'"),
                          (("--rank", "2"), "No such option: --rank")):
        bad = _run(capture, *SMALL, *args)
        assert bad.exit_code != 0 and message in " ".join(bad.output.split()), bad.output
