"""--device-map, --max-memory and --offload-folder through the Typer runner on capture,
generate and recommend: placed runs report weights and held cache bytes per device, and bad
placements fail with one clear line naming devices and sizes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlens.cli import app

runner = CliRunner()

# tiny_model_dir (conftest): a 3-layer Llama; this map sends two of its layers to disk
DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
            "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "cpu"}


@pytest.fixture()
def disk_map(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(DISK_MAP))
    return path


def _capture(*args):
    return runner.invoke(app, ["capture", *map(str, args)])


def test_capture_with_disk_offload_reports_devices(tiny_model_dir, text_file, disk_map,
                                                   tmp_path):
    base = ["--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 16]
    res = _capture(*base, "-o", tmp_path / "a.h5", "--json")
    assert res.exit_code == 0, res.output
    whole = json.loads(res.stdout)
    res = _capture(*base, "-o", tmp_path / "b.h5", "--json", "--device-map", disk_map,
                   "--offload-folder", tmp_path / "off")
    assert res.exit_code == 0, res.output
    placed = json.loads(res.stdout)
    assert placed["layer_devices"] == ["cpu"] * 3
    by_dev = placed["weights_by_device"]
    assert by_dev["disk"] > 0 and sum(by_dev.values()) == whole["weights_by_device"]["cpu"]
    assert (tmp_path / "a.h5").stat().st_size > 0
    res = _capture(*base, "-o", tmp_path / "c.h5", "--device-map", "sequential",
                   "--max-memory", "cpu=1GiB")
    assert res.exit_code == 0, res.output
    assert "layers ran on" in res.stdout and "cpu: 0-2" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--device-map", "auto", "--max-memory", "cpu=20XB"], "Invalid --max-memory size for cpu"),
    (["--device-map", "auto", "--max-memory", "cpu:2GiB"], "expected DEVICE=SIZE"),
    (["--max-memory", "cpu=2GiB"], "only applies with --device-map"),
    (["--device-map", "auto", "--max-memory", "cpu=1MB"],
     "would go to disk, and disk offload needs --offload-folder"),
    (["--device-map", "everywhere"], "allowed: auto, balanced"),
    (["--device-map", "auto", "--device", "cuda"], "give one of them"),
])
def test_capture_bad_placement(args, message, tiny_model_dir, text_file, tmp_path):
    res = _capture("--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 8,
                   "-o", tmp_path / "r.h5", *args)
    assert res.exit_code == 1
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "r.h5").exists()


def test_capture_unwritable_offload_folder(tiny_model_dir, text_file, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = _capture("--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 8,
                   "-o", tmp_path / "r.h5", "--device-map", "auto", "--offload-folder",
                   blocker / "off")
    assert res.exit_code == 1
    assert "is not a writable directory" in " ".join(res.output.split())


def test_generate_with_disk_offload(tiny_model_dir, disk_map, tmp_path):
    from kvlens.config import KVConfig, LayerKV, save_config
    from kvlens.quant import QuantSpec

    cfg = tmp_path / "tiny-kivi.json"
    save_config(KVConfig("tiny-kivi", LayerKV(QuantSpec(2, "per-channel", 8),
                                              QuantSpec(2, "per-token", 8), 16)), cfg)
    base = ["generate", "--model", str(tiny_model_dir), "--config", str(cfg), "--prompt",
            "The quick brown fox jumps over the lazy dog. " * 6, "--max-new-tokens", "6",
            "--json"]
    res = runner.invoke(app, base)
    assert res.exit_code == 0, res.output
    whole = json.loads(res.stdout)
    res = runner.invoke(app, [*base, "--device-map", str(disk_map), "--offload-folder",
                              str(tmp_path / "off")])
    assert res.exit_code == 0, res.output
    placed = json.loads(res.stdout)
    assert placed["placement"]["weights_by_device"]["disk"] > 0
    assert whole["placement"]["device_map"] is None
    assert placed["placement"]["device_map"] == DISK_MAP
    assert placed["placement"]["layer_devices"] == ["cpu"] * 3
    (r,) = placed["results"]
    assert r["text"] == whole["results"][0]["text"]
    assert r["kv_bytes_by_device"] == {"cpu": r["kv_bytes"]} and r["bits_per_element"] < 16
    res = runner.invoke(app, base[:-1] + ["--device-map", str(disk_map)])
    assert res.exit_code == 1 and "--offload-folder" in res.output
    res = runner.invoke(app, base[:-1] + ["--device-map", str(disk_map), "--offload-folder",
                                          str(tmp_path / "off")])
    assert res.exit_code == 0 and "KV cache held by device: cpu" in res.stdout


def test_recommend_placement_errors_are_not_swallowed(tiny_model_dir, text_file, tmp_path):
    """--sensitivity auto falls back to uniform weights when the model cannot load, but a
    placement the user asked for must work or fail loudly."""
    cap = tmp_path / "run.h5"
    res = _capture("--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 32,
                   "-o", cap)
    assert res.exit_code == 0, res.output
    args = ["recommend", str(cap), "-b", "6", "--context", "512", "--windows", "16",
            "--set", "group-sizes=16", "--model", str(tiny_model_dir), "--set", "retrieval=off",
            "--device-map", "auto"]
    res = runner.invoke(app, [*args, "--max-memory", "cpu=1MB"])
    assert res.exit_code == 1
    assert "would go to disk" in " ".join(res.output.split())
    res = runner.invoke(app, [*args, "--max-memory", "cpu=1GiB", "--json"])
    assert res.exit_code == 0, res.output
    notes = json.loads(res.stdout)["notes"]
    assert any("per-layout factors from measured KL" in n for n in notes)  # auto: layout
    # --target ENGINE loads its model (--max-kld, --validate) with the same placement
    target = ["recommend", str(cap), "--target", "vllm", "-b", "9", "--validate",
              "--model", str(tiny_model_dir), "--device-map", "auto"]
    res = runner.invoke(app, [*target, "--max-memory", "cpu=1MB"])
    assert res.exit_code == 1
    assert "would go to disk" in " ".join(res.output.split())
    assert "measuring" not in res.output  # the model loads (and fails) before any measurement


def test_every_model_stage_under_disk_offload_equals_the_plain_run(tiny_model_dir, text_file,
                                                                   disk_map, tmp_path):
    """recommend's layout sensitivity, retrieval probe, --max-kld search and --validate, and
    generate --eval kld, with two of the three layers offloaded to disk: the same layer
    weights, config and KLDs as the plain run (the same arithmetic, only where the weights
    wait between layers)."""
    cap = tmp_path / "run.h5"
    res = _capture("--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 64, "-o", cap)
    assert res.exit_code == 0, res.output
    base = ["recommend", str(cap), "--context", "512", "--windows", "16", "--set",
            "group-sizes=16", "--model", str(tiny_model_dir), "--set", "retrieval=on",
            "--eval-tokens", "96", "--max-kld", "0.05", "--validate", "--remeasure", "--json"]
    docs = []
    for extra, out in (([], "a.json"), (["--device-map", str(disk_map), "--offload-folder",
                                         str(tmp_path / "off")], "b.json")):
        res = runner.invoke(app, [*base, *extra, "-o", str(tmp_path / out)])
        assert res.exit_code == 0, res.output
        docs.append(json.loads(res.stdout))
    plain, placed = docs
    assert placed["layer_weights"] == pytest.approx(plain["layer_weights"], rel=1e-4)
    assert placed["config"] == plain["config"]
    assert placed["search"]["chosen_budget_bits"] == plain["search"]["chosen_budget_bits"]
    for a, b in zip(plain["validation"], placed["validation"]):
        assert b["kld"]["mean_kld"]["value"] == pytest.approx(a["kld"]["mean_kld"]["value"],
                                                              rel=1e-4, abs=1e-7)
    gen = ["generate", "--model", str(tiny_model_dir), "--config", str(tmp_path / "a.json"),
           "--eval", "kld", "--eval-tokens", "96", "--json"]
    runs = []
    for extra in ([], ["--device-map", str(disk_map), "--offload-folder",
                       str(tmp_path / "off2")]):
        res = runner.invoke(app, [*gen, *extra])
        assert res.exit_code == 0, res.output
        runs.append(json.loads(res.stdout)["results"][0]["kld"]["mean_kld"]["value"])
    assert runs[1] == pytest.approx(runs[0], rel=1e-4, abs=1e-7)
