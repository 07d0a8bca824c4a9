"""``recommend --max-kld`` for the per-layer target (``kvlens.recommend.search``) and
``--budgets``: the smallest budget whose config's measured KLD meets a target, found from one
measurement; several budgets from one measurement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import small_options, tiny_capture
from test_recommend import _planted_capture
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.errors import InputError
from kvlens.recommend import choose, measure, search_budget
from kvlens.recommend.search import RESOLUTION, budget_grid

runner = CliRunner()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = _planted_capture(tmp_path_factory.mktemp("search") / "p.h5")
    opts = small_options(budget_bits=16.0, group_sizes=(32,), bits=(2, 4, 8), retrieval="off")
    return measure(path, opts), opts


def _known_kld(m):
    """A stand-in for the model: KLD = 2^-(bits the config holds), which falls as the budget
    grows, so the answer is known."""
    from kvlens.cache.layout import config_bits

    return lambda config: 1.0 / 2 ** config_bits(config, m.meta.shape, 4096)


def test_the_search_finds_the_smallest_budget_that_meets_the_target(measured):
    m, opts = measured
    kld_of, calls = _known_kld(m), []

    def score(config):
        calls.append(config)
        return {"mean_kld": {"value": kld_of(config), "ci95": [0.0, 1.0]},
                "top1_agreement": {"value": 0.9}, "ppl_change": {"value": 0.01}}

    grid = budget_grid(m, opts)
    assert grid == sorted(grid) and len(grid) > 2
    assert all(abs(b / RESOLUTION - round(b / RESOLUTION)) < 1e-9 for b in grid)
    truth = {b: kld_of(choose(m, replace(opts, budget_bits=b)).config) for b in grid}
    target = truth[grid[len(grid) // 2]]
    result = search_budget(m, opts, target, score)
    best = min(b for b, k in truth.items() if k <= target)
    assert result.chosen.budget_bits == best
    assert next(s for s in result.steps if s.budget_bits == best).mean_kld <= target
    assert result.steps[0].budget_bits == grid[-1]  # the largest first
    assert len(calls) <= len(result.steps) <= 2 + len(grid).bit_length()  # a bisection
    doc = result.to_dict()
    assert doc["chosen_budget_bits"] == best and len(doc["steps"]) == len(result.steps)
    with pytest.raises(InputError, match="Even the largest useful budget"):
        search_budget(m, opts, truth[grid[-1]] / 2, score)


def test_recommend_max_kld_and_budgets_on_a_tiny_model(tiny_model_dir, tmp_path):
    cap = tiny_capture(tiny_model_dir, tmp_path)
    common = ["recommend", str(cap), "--context", "512", "--windows", "16", "--set",
              "group-sizes=16", "--model", str(tiny_model_dir), "--eval-tokens", "96"]
    res = runner.invoke(app, [*common, "--max-kld", "0.05", "--json", "-o",
                              str(tmp_path / "kv.json")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    steps = doc["search"]["steps"]
    chosen = [s for s in steps if s["budget_bits"] == doc["search"]["chosen_budget_bits"]]
    assert chosen and chosen[0]["mean_kld"] <= 0.05
    assert doc["budget_bits"] == doc["search"]["chosen_budget_bits"]
    # every budget below the chosen one that was tried missed the target
    assert all(s["mean_kld"] > 0.05 for s in steps if s["budget_bits"] < doc["budget_bits"])
    assert (tmp_path / "kv.json").is_file() and "reused" not in res.stderr
    # several budgets from the (kept) measurement, validated side by side in one run
    res = runner.invoke(app, [*common, "--budgets", "4,6", "-o", str(tmp_path / "b.json"),
                              "--validate", "--json"])
    assert res.exit_code == 0, res.output
    docs = json.loads(res.stdout)["recommendations"]
    assert [d["budget_bits"] for d in docs] == [4.0, 6.0]
    assert (tmp_path / "b-4b.json").is_file() and (tmp_path / "b-6b.json").is_file()
    names = [r["name"] for r in docs[0]["validation"]]
    assert names[:2] == ["recommended-4b", "recommended-6b"]
    assert "measurements reused" in res.stderr


def test_recommend_runs_its_model_stages_in_the_dtype_asked(tiny_model_dir, tmp_path):
    """--dtype bfloat16: sensitivity, the probe and --validate load the model in bfloat16, and
    the validation says its exact reference ran in bfloat16; the dtype is a measuring option
    (another dtype is another measurement)."""
    cap = tiny_capture(tiny_model_dir, tmp_path)
    common = ["recommend", str(cap), "-b", "6", "--context", "512", "--windows", "16", "--set",
              "group-sizes=16", "--model", str(tiny_model_dir), "--validate", "--eval-tokens",
              "96", "--json"]
    docs = {}
    for dtype in ("float32", "bfloat16"):
        res = runner.invoke(app, [*common, "--dtype", dtype])
        assert res.exit_code == 0, res.output
        assert "measurements reused" not in res.stderr
        docs[dtype] = json.loads(res.stdout)
        assert docs[dtype]["validation_evaluation"]["kld"]["model_dtype"] == dtype
    assert all(w > 0 for w in docs["bfloat16"]["layer_weights"])
    assert docs["bfloat16"]["layer_weights"] != docs["float32"]["layer_weights"]
    res = runner.invoke(app, ["recommend", str(cap), "-b", "6", "--dtype", "float8"])
    assert res.exit_code == 1 and "Unknown dtype 'float8'" in res.output


def test_the_library_call_behind_the_command_answers_both_targets(tmp_path):
    """``kvlens.deploy.answer.recommend_run`` as docs/recommend.md shows it: several budgets
    from one measurement (each config saved as soon as it is chosen), and an engine target."""
    from kvlens.deploy.answer import EngineAnswer, RecommendRequest, recommend_run
    from kvlens.recommend.answer import LayerAnswer

    path = _planted_capture(tmp_path / "p.h5")
    levers = {"group_sizes": (32,), "bits": (2, 4), "windows": (32,), "retrieval": "off",
              "sensitivity": "uniform"}
    outputs = (tmp_path / "kv-4b.json", tmp_path / "kv-8b.json")
    saved = []
    answer = recommend_run(
        RecommendRequest(path, options={"budget_bits": 8.0, **levers}, budgets=(4.0, 8.0),
                         outputs=outputs),
        save=lambda rec, out: saved.append((rec.config.name, out)))
    assert isinstance(answer, LayerAnswer) and len(answer.recommendations) == 2
    assert saved == [("recommended-4b", outputs[0]), ("recommended-8b", outputs[1])]
    low, high = answer.recommendations
    assert low.mean_bits <= 4.0 < high.mean_bits <= 8.0
    assert [d["deploy"]["config"] for d in answer.documents] == [str(o) for o in outputs]
    engine = recommend_run(RecommendRequest(path, "llama.cpp", options={"budget_bits": 16.0}))
    assert isinstance(engine, EngineAnswer)
    assert engine.document["deploy"]["command"].startswith("llama-server")
