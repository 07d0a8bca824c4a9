"""The architecture matrix: every causal-LM family of ``tiny_models.MATRIX`` (tiny random models
built from transformers' own config classes, head_dim 64) through the commands, in process
through the Typer runner; the families kvlens refuses (``kvlens.model.families.REFUSED``) are
refused from their ``config.json`` alone, before any weight loads.
docs/reference/architectures.md is generated from the same tables (docs/gen_architectures.py)
and checked here.

A command passes when it exits 0; an ``error:`` line fails the family, and a traceback (an
exception the CLI did not turn into an ``error:`` line) fails it louder.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest
from tiny_models import MATRIX, matrix_config, save_model_dir
from typer.testing import CliRunner

from kvlens.cli import app

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

runner = CliRunner()

#: families that also run plot-outliers, an engine setting beside the kivi preset, and report
#: (the issue's "all five commands": capture, plot-outliers, compare-axes, recommend, generate)
FULL = ("qwen3_next", "gemma2", "gpt_oss", "deepseek_v3")
#: one tiny config per refused family: its config.json alone (no weights) must be refused
REFUSED_CONFIGS = {
    "mamba": lambda tf: tf.MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2),
    "gemma3n_text": lambda tf: tf.Gemma3nTextConfig(vocab_size=256, hidden_size=64,
                                                    num_hidden_layers=2),
}


def _run(args: list[str]) -> str:
    """Run one command; fail with its output or traceback unless it exits 0."""
    result = runner.invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        tb = "".join(traceback.format_exception(result.exception))
        pytest.fail(f"`kvlens {' '.join(args)}` raised (a traceback, not an error line):\n{tb}")
    assert result.exit_code == 0, f"`kvlens {' '.join(args)}`:\n{result.output}"
    return result.stdout


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("matrix")

    def get(family: str) -> Path:
        path = root / family
        if not path.exists():
            save_model_dir(path, matrix_config(family), tiny_tokenizer)
        return path

    return get


@pytest.mark.parametrize("family", list(MATRIX))
def test_family_runs_every_command(family, model_dirs, tmp_path):
    model = str(model_dirs(family))
    run, cfg = str(tmp_path / "run.h5"), str(tmp_path / "kv.json")
    _run(["capture", "-m", model, "-o", run, "--samples", "1", "--tokens", "128"])
    if family in FULL:
        _run(["plot-outliers", run, "--out", str(tmp_path / "outliers")])
    _run(["compare-axes", run, "--bits", "2", "--json"])
    _run(["recommend", run, "-b", "8", "--windows", "32", "--set", "group-sizes=32",
          "--set", "bits=2,4", "--set", "retrieval=off", "--set", "sensitivity=model",
          "-o", cfg, "--model", model])
    configs = f"{cfg},kivi-4,llamacpp:q8_0" if family in FULL else cfg
    out = _run(["generate", "-m", model, "--compare", configs, "--eval", "kld",
                "--eval-tokens", "160", "--chunk", "40", "--json"])
    doc = json.loads(out)
    scored = [r for r in doc["results"] if r["name"] != "exact"]
    assert scored and all(r["kv_bytes"] > 0 and r["kld"]["scored"] > 0 for r in scored), doc
    if family in FULL:
        _run(["report", str(tmp_path), "-o", str(tmp_path / "report.html")])
        assert (tmp_path / "report.html").stat().st_size > 0


@pytest.mark.parametrize("family", list(REFUSED_CONFIGS))
def test_refused_family_is_refused_before_any_weight_loads(family, tmp_path):
    """Only config.json is written: a command that tried to load weights would fail on the
    missing files instead of naming why the family is refused."""
    import transformers as tf

    from kvlens.model.families import REFUSED

    REFUSED_CONFIGS[family](tf).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    result = runner.invoke(app, ["capture", "-m", str(tmp_path), "-o",
                                 str(tmp_path / "run.h5")])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "Unsupported model type" in text and REFUSED[family][:40] in text
    assert not (tmp_path / "run.h5").exists()


def test_architecture_doc_is_generated_from_the_matrix():
    from gen_architectures import render

    path = ROOT / "docs" / "reference" / "architectures.md"
    assert path.read_text(encoding="utf-8") == render(), \
        "docs/reference/architectures.md is stale: run `python docs/gen_architectures.py`"


@pytest.mark.parametrize("family,message", [
    ("diffllama", "attention ran twice over one cache update"),
    ("doge", "masks each attention head differently"),
])
def test_what_the_cache_cannot_model_is_one_error_not_wrong_numbers(family, message):
    """Past the refusal by name (a model loaded by hand): a model attending twice per cache
    update (DiffLlama: each call passes other values, which the cache would ignore) or with
    per-head masks (Doge) stops with one ConfigError instead of computing something else."""
    import torch
    import transformers as tf

    from kvlens.cache import compressed_attention
    from kvlens.config import preset
    from kvlens.errors import ConfigError
    from kvlens.model.hooks import cache_argument_name

    config = tf.AutoConfig.for_model(family, vocab_size=256, hidden_size=128,
                                     intermediate_size=192, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), compressed_attention(model, preset("kivi-4")) as session:
        with pytest.raises(ConfigError, match=message):
            model(ids, use_cache=True, **{cache_argument_name(model): session.new_cache()})
