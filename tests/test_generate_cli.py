"""``kvlens generate`` through the Typer runner: options, --json shape, bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlens.cli import app

runner = CliRunner()


@pytest.fixture
def patched_model(monkeypatch, smollm2):
    import kvlens.models

    monkeypatch.setattr(kvlens.models, "load_model", lambda *a, **k: (*smollm2, None))
    return smollm2


def test_generate_json_compare(patched_model, tmp_path):
    from kvlens.kvconfig import preset, save_config

    path = tmp_path / "cfg.json"
    save_config(preset("kivi-4"), path)
    result = runner.invoke(app, ["generate", "--config", str(path), "--compare", "fp16,kivi-2",
                                 "--prompt", "Hello, my name is", "--max-new-tokens", "4",
                                 "--eval", "agreement,passkey", "--passkey-prompts", "1",
                                 "--passkey-context", "150", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    names = [r["name"] for r in doc["results"]]
    assert names == ["kivi-4", "fp16", "kivi-2"]
    for r in doc["results"]:
        assert isinstance(r["text"], str) and r["kv_bytes"] > 0 and r["kv_bytes_fp16"] > 0
        assert r["agreement"]["total"] == 4
        assert set(r["passkey"]) == {"correct", "total", "context_tokens"}
    fp16, kivi2 = doc["results"][1], doc["results"][2]
    assert fp16["agreement"]["matching"] == 4 and fp16["agreement"]["first_divergence"] is None
    assert kivi2["bits_per_element"] < fp16["bits_per_element"]


def test_generate_table_with_ppl(patched_model):
    result = runner.invoke(app, ["generate", "--preset", "kivi-4", "--eval", "ppl",
                                 "--ppl-tokens", "48"])
    assert result.exit_code == 0, result.output
    assert "kivi-4" in result.stdout and "ppl change" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--preset", "kivi-3", "--prompt", "x"], "Unknown preset 'kivi-3'"),
    (["--prompt", "x"], "Choose a cache"),
    (["--preset", "kivi-2"], "Nothing to do"),
    (["--preset", "kivi-2", "--eval", "bleu"], "allowed: ppl, passkey, agreement"),
    (["--preset", "kivi-2", "--config", "x.json", "--prompt", "x"], "not both"),
    (["--compare", "fp16,nope", "--prompt", "x"], "allowed presets"),
])
def test_generate_bad_options(args, message):
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code == 1
    assert message in result.output


def test_generate_malformed_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = runner.invoke(app, ["generate", "--config", str(bad), "--prompt", "x"])
    assert result.exit_code == 1 and "not valid JSON" in result.output


def test_generate_config_for_another_model(patched_model, tmp_path):
    from dataclasses import replace

    from kvlens.kvconfig import preset, save_config

    path = tmp_path / "other.json"
    save_config(replace(preset("kivi-2"), model={"num_layers": 12, "head_dim": 64}), path)
    result = runner.invoke(app, ["generate", "--config", str(path), "--prompt", "x"])
    assert result.exit_code == 1
    assert "num_layers=12" in result.output and "num_layers=30" in result.output
