"""transformers' QuantizedCache as a --compare baseline."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.errors import ConfigError
from kvlens.evaluation.baselines import baseline


def _has_fp8_backend() -> bool:
    import inspect

    from transformers.cache_utils import QuantizedCache

    return "backend" in inspect.signature(QuantizedCache.__init__).parameters


def test_unknown_and_missing_baselines_are_clear():
    with pytest.raises(ConfigError, match="allowed: hf-quanto-2"):
        baseline("hf-nope")


@pytest.mark.skipif(not _has_fp8_backend(), reason="QuantizedCache(backend=...) needs transformers >= 5")
def test_fp8_baseline_runs_side_by_side(tiny_model_dir):
    res = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--compare",
                                   "exact,hf-fp8", "--eval", "ppl", "--ppl-tokens", "200",
                                   "--json"])
    assert res.exit_code == 0, res.output
    exact, fp8 = json.loads(res.stdout)["results"]
    assert fp8["name"] == "hf-fp8" and fp8["backend"].startswith("transformers QuantizedCache")
    # fp8 codes + per-tensor scales + a bf/fp32 residual: fewer bytes than fp16, measured.
    assert 0 < fp8["kv_bytes"] < fp8["kv_bytes_fp16"]
    assert fp8["ppl"] > 0 and fp8["ppl_fp16"] == exact["ppl"]
