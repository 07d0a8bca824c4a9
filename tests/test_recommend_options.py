"""One source of defaults and a research door: every ``RecommendOptions`` field is a main
option, a research lever or library-only; the command passes the library only what was given,
so ``RecommendOptions(budget_bits=B)`` is what ``kvlens recommend -b B`` runs; every parameter
of the command is read by some target (the ``--target`` refusals are derived from that)."""

from __future__ import annotations

from dataclasses import fields

import pytest
from helpers import make_capture, small_options
from test_compare import kivi_tensors
from typer.testing import CliRunner

import kvlens.recommend
import kvlens.recommend.answer
from kvlens.cli import app
from kvlens.cli.recommend import COMMAND_ONLY
from kvlens.cli.recommend import RESEARCH as RESEARCH_PANEL
from kvlens.deploy.answer import ENGINE, PER_LAYER, REQUEST_READERS, readers
from kvlens.errors import InputError, KvlensError
from kvlens.recommend import RecommendOptions
from kvlens.recommend.options import LIBRARY, MAIN, RESEARCH, option_name
from kvlens.research import RECOMMEND, TARGET, describe, levers, parse_settings
from kvlens.research.mikv import MikvSets

runner = CliRunner()


def _command_params() -> dict[str, object]:
    import typer.main

    command = typer.main.get_command(app).commands["recommend"]
    return {p.name: p for p in command.params}


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    path = tmp_path_factory.mktemp("opts") / "cap.h5"
    make_capture(path, *kivi_tensors(), layers=2)
    return path


def test_every_field_is_classified_and_reachable():
    params = _command_params()
    flags = {o for p in params.values() for o in getattr(p, "opts", ())}
    lever_fields = {lv.field for lv in levers().values() if RECOMMEND in lv.owners}
    for f in fields(RecommendOptions):
        door = f.metadata.get("door")
        assert door in (MAIN, RESEARCH, LIBRARY), f"{f.name} is not classified"
        if door == MAIN:
            assert f.metadata["flag"] in flags, f"{f.name}: {f.metadata['flag']} is no option"
            assert option_name(f.name) == f.metadata["flag"]
        elif door == RESEARCH:
            assert f.name in lever_fields and option_name(f.name).startswith("--set ")
        else:
            assert f.name not in params and f.name not in lever_fields


def test_every_parameter_is_read_by_a_target():
    params = _command_params()
    for name in set(params) - set(COMMAND_ONLY):
        assert readers(name) <= {PER_LAYER, ENGINE} and readers(name), name
    # the derivation: a per-layer field is kvlens-only, a target field both or engine-only
    assert readers("windows") == {PER_LAYER} and readers("anchors") == {ENGINE}
    assert readers("budget_bits") == {PER_LAYER, ENGINE} and not readers("nope")
    assert set(REQUEST_READERS) | set(COMMAND_ONLY) <= set(params)
    # a --set lever is named by its field beside the parameters: no name means both
    lever_fields = {lv.field for lv in levers().values()}
    assert not lever_fields & set(params)
    assert all(readers(f) for f in lever_fields)


def test_the_main_panels_hold_at_most_25_options():
    main = [p for p in _command_params().values()
            if getattr(p, "rich_help_panel", None) not in (None, RESEARCH_PANEL)
            and p.param_type_name == "option"]
    assert len(main) <= 25, [p.name for p in main]


def test_the_command_runs_the_library_defaults(cap, monkeypatch):
    seen = []

    def stop(path, opts, progress=None, **kw):
        seen.append(opts)
        raise KvlensError("stopped")

    monkeypatch.setattr(kvlens.recommend.answer, "measurement", stop)
    res = runner.invoke(app, ["recommend", str(cap), "-b", "8"])
    assert res.exit_code == 1 and "stopped" in res.output, res.output
    assert seen == [RecommendOptions(budget_bits=8)]
    assert seen[0].tokens == 512 and seen[0].sensitivity == "auto"  # the derived tokens
    res = runner.invoke(app, ["recommend", str(cap), "-b", "8", "--set", "mikv=on", "--set",
                              "balancer=off", "--set", "mikv-bits=4", "--windows", "128"])
    assert res.exit_code == 1, res.output
    assert seen[1] == RecommendOptions(budget_bits=8, extensions=(MikvSets(set_bits=(4,)),),
                                       balancer=False, windows=(128,))
    assert seen[1].tokens == 256  # derived from the one window
    # the switch off: no extension, whatever the order of the levers
    res = runner.invoke(app, ["recommend", str(cap), "-b", "8", "--set", "mikv=off"])
    assert res.exit_code == 1, res.output
    assert seen[2] == RecommendOptions(budget_bits=8)  # no extension switched on


def test_help_shows_the_library_defaults():
    res = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "[default: 32,64,128]" in res.output and "[default: 4096]" in res.output


def test_set_list_describes_every_lever():
    res = runner.invoke(app, ["recommend", "--set", "list"])
    assert res.exit_code == 0
    for name in levers():
        assert f"  {name}=" in res.output
    assert res.output.strip() == describe().strip()


def test_parse_settings_types_and_owners():
    got = parse_settings(["prefer-fast=on", "bits=2,3", "layout-layers=none", "rotation=off",
                          "kld-anchors=2", "mikv-fractions=0.1", "key-fits=minmax,mse"])
    assert got[RECOMMEND] == {"prefer_fast": True, "bits": (2, 3), "layout_layers": None,
                              "rotation": False, "mikv_fractions": (0.1,),
                              "key_fits": ("minmax", "mse")}
    assert got[TARGET] == {"rotation": False, "anchors": 2}
    for bad, said in (("nope=1", "unknown lever"), ("flush", "NAME=VALUE"),
                      ("flush=x", "expected int"), ("prefer-fast=2", "on|off"),
                      ("codebooks=on", "unknown lever 'codebooks'"),  # removed (issue #57)
                      ("centering=on", "unknown lever 'centering'")):
        with pytest.raises(InputError, match=said):
            parse_settings([bad])


def test_a_budget_below_the_cheapest_layout_is_refused_before_measuring(cap, monkeypatch):
    import kvlens.recommend.run as run

    def never(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(run, "measure", never)
    with pytest.raises(InputError, match="budget is too small"):
        kvlens.recommend.recommend(cap, small_options(budget_bits=1.0, retrieval="off"))
    with pytest.raises(InputError, match="holds 2 samples"):
        kvlens.recommend.recommend(cap, small_options(budget_bits=8, samples=3))


def test_the_library_call_keeps_and_reuses_its_measurement(cap):
    said = []
    # one worker: both layers in one run, the second predicted from the first
    small = dict(retrieval="off", group_sizes=(16,), bits=(2, 4), windows=(16,), tokens=64,
                 workers=1)
    opts = small_options(budget_bits=8, **small)
    first = kvlens.recommend.recommend(cap, opts, log=said.append)
    assert said[-1].startswith("predicted: candidate errors about")
    assert set(first.predicted) == {"candidate errors"}
    again = kvlens.recommend.recommend(cap, small_options(budget_bits=6, **small),
                                       log=said.append)
    assert "measurements reused" in said[-1] and again.predicted is None
    fresh = kvlens.recommend.recommend(cap, opts, remeasure=True, log=said.append)
    assert said[-1].startswith("predicted:")
    assert [c.candidate for c in fresh.choices] == [c.candidate for c in first.choices]


def test_set_list_keeps_the_knobs_of_the_default_run_apart_from_experiments():
    """``--set list``: every knob of the default run under the first heading, the experiments
    (no default uses them: MiKV) under the second."""
    text = describe()
    knobs, experiments = text.split("\n\nExperiments")
    assert knobs.startswith("Knobs of the default run")
    by_group = {lv.name: lv.experiment for lv in levers().values()}
    assert {n for n, e in by_group.items() if e} == {"mikv", "mikv-bits", "mikv-fractions"}
    for name, experiment in by_group.items():
        assert (f"  {name}=" in experiments) == experiment
        assert (f"  {name}=" in knobs) != experiment


def test_the_request_is_built_from_the_options_given(cap, tmp_path):
    """``kvlens.deploy.answer.request_for``: what the command passes the library. The per-layer
    target's options hold only what was given (the budget the measurement reads, the levers,
    the placement); several budgets name one output each; an engine target's
    --max-kld reaches its ``TargetOptions`` (it was dropped once: ``--target llama.cpp
    --max-kld X`` then said it needed --budget-bits or --max-kld)."""
    from kvlens.deploy.answer import request_for

    out = tmp_path / "kv.json"
    req = request_for(cap, "kvlens", {"budgets": "4,2.5", "output": out, "windows": "64,128",
                                      "device_map": "auto", "validate": True},
                      {"mikv": False})
    assert req.options == {"windows": (64, 128), "device_map": "auto", "budget_bits": 2.5,
                           "mikv": False}
    assert req.budgets == (2.5, 4.0) and req.validate and req.max_kld is None
    assert req.outputs == (tmp_path / "kv-2.5b.json", tmp_path / "kv-4b.json")
    assert req.place == {"device_map": "auto", "max_memory": None, "offload_folder": None}
    engine = request_for(cap, "llamacpp", {"max_kld": 0.01, "context": 1024, "dtype": "float16"})
    assert engine.target == "llama.cpp" and engine.max_kld == 0.01
    assert engine.options == {"context": 1024} and engine.place["dtype"] == "float16"
    with pytest.raises(TypeError, match="reads no"):
        request_for(cap, "vllm", {"budget_bits": 4.0, "windows": "64"})
    res = runner.invoke(app, ["recommend", str(cap), "--target", "llama.cpp", "--max-kld",
                              "0.01"])
    assert res.exit_code == 1 and "does not say which model it came from" in res.output, \
        res.output
