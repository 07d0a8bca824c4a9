"""Bad input to every command, as a table: each row is a command line, a fragment of the one
error line it must print, and the exit code (docs/reference/README.md, "Exit codes": 1 for what
kvlens refuses, 2 for what the command-line parser refuses, a number outside its declared range
included). Every row must end without a traceback and before any model is loaded or any
measurement starts: loading a model here fails the test.

No row loads a model (the ``MODEL`` directory only has to exist), so this file runs in seconds.
"""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
import pytest
from helpers import make_capture
from test_compare import kivi_tensors
from typer.testing import CliRunner

from kvlens.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The paths the rows name: ``{NAME}`` in a row is replaced by ``files[NAME]``."""
    d = tmp_path_factory.mktemp("bad-input")
    make_capture(d / "cap.h5", *kivi_tensors(), layers=2)  # head_dim 16
    with h5py.File(d / "foreign.h5", "w") as f:  # HDF5, but not a kvlens capture
        f["data"] = np.zeros(3)
    (d / "corrupt.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    model = d / "model"  # resolves as a HF model directory; loading it would fail the test
    model.mkdir()
    (model / "config.json").write_text("{}")
    # a model directory whose config.json declares its shape (2 layers, 256 positions): the
    # options that depend on the model are checked against it, still without loading it
    shaped = d / "shaped"
    shaped.mkdir()
    (shaped / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "max_position_embeddings": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256}))
    from dataclasses import replace

    from kvlens.config import preset, save_config

    kivi = preset("kivi-2")
    save_config(replace(kivi, name="layer99", layers={99: kivi.default}), d / "layer99.json")
    (d / "text.txt").write_text("Some text to read. " * 20, encoding="utf-8")
    (d / "exists.json").write_text("{}")
    (d / "exists.h5").write_bytes(b"keep me")
    (d / "bad.json").write_text("{not json")
    (d / "oops.json").write_text(json.dumps({"version": 1, "layers": "oops"}))
    (d / "v99.json").write_text(json.dumps({"version": 99}))
    for folder, artifact in (("outliers", "outliers.json"), ("compare", "compare-axes.json")):
        (d / folder).mkdir()
        (d / folder / artifact).write_text("{}")
    (d / "scales").mkdir()
    (d / "scales" / "kv_scales.json").write_text("{}")
    (d / "empty").mkdir()
    (d / "withreport").mkdir()
    (d / "withreport" / "report.html").write_text("<html></html>")
    names = {p.name.split(".")[0] if p.suffix else p.name: p for p in d.iterdir()}
    names |= {"dir": d, "missing": d / "missing.h5", "nofolder": d / "no" / "out.h5",
              "exists_json": d / "exists.json", "exists_h5": d / "exists.h5",
              "new_json": d / "scales" / "new.json"}
    return names


@pytest.fixture
def loads(monkeypatch):
    """Every way a command loads a model, replaced by one that records the call and fails."""
    import kvlens.capture.run
    import kvlens.capture.source
    import kvlens.model.load as load

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a model was loaded before the bad input was refused")

    original = load.load_model
    for module in list(sys.modules.values()):
        if getattr(module, "load_model", None) is original:
            monkeypatch.setattr(module, "load_model", refuse)
    monkeypatch.setattr(load, "_load_pretrained", refuse)
    monkeypatch.setattr(load, "_load_gguf", refuse)
    assert kvlens.capture.run.load_model is refuse and kvlens.capture.source.load_model is refuse
    return calls


ROWS = [
    # capture: options, paths, outputs
    ("capture --model {model} --device foo -o {dir}/a.h5", "Unknown device 'foo'", 1),
    ("capture --model {model} --dtype float8 -o {dir}/a.h5", "Unknown dtype 'float8'", 1),
    ("capture --model {model} --text {missing} -o {dir}/a.h5", "Text file not found", 1),
    ("capture --model {dir}/nope -o {dir}/a.h5", "Model not found", 1),
    ("capture --model {model} --storage-dtype int8 -o {dir}/a.h5", "Unknown storage dtype", 1),
    ("capture --model {model} --device-map auto --max-memory cpu=lots -o {dir}/a.h5",
     "Invalid --max-memory", 1),
    ("capture --model {model} --max-memory cpu=1GiB -o {dir}/a.h5",
     "only applies with --device-map", 1),
    ("capture --model {model} --device-map sideways -o {dir}/a.h5", "Unknown --device-map", 1),
    ("capture --model {model} -o {exists_h5}", "already exists; pass --overwrite", 1),
    ("capture --model {model} -o {nofolder}", "does not exist", 1),
    # capture --layers: the syntax always, the range against the layer count the model's files
    # declare (config.json, or the embedded SmolLM2 GGUF's metadata: 30 layers)
    ("capture --model {model} --layers abc -o {dir}/a.h5", "'abc' is not an index", 1),
    ("capture --model {shaped} --layers 0,99 -o {dir}/a.h5", "[99] outside 0-1", 1),
    ("capture --layers 99 -o {dir}/a.h5", "[99] outside 0-29 (the model has 30 layers)", 1),
    # capture files that are missing, foreign or corrupt
    ("compare-axes {missing}", "not found", 1),
    ("compare-axes {foreign}", "not a kvlens capture", 1),
    ("compare-axes {corrupt}", "not a readable HDF5 file", 1),
    ("plot-outliers {foreign} --out {dir}/o", "not a kvlens capture", 1),
    ("recommend {corrupt} -b 3", "not a readable HDF5 file", 1),
    # compare-axes and plot-outliers options and outputs
    ("compare-axes {cap} --group-sizes 48", "does not divide head_dim 16", 1),
    ("compare-axes {cap} --bits 9", "Invalid bits 9", 1),
    ("compare-axes {cap} --group-sizes 8 --variants center", "Unknown variant 'center'", 1),
    ("compare-axes {cap} --plots {compare}", "already holds compare-axes.json", 1),
    ("compare-axes {cap} --plots {exists_json}", "is not a directory", 1),
    ("plot-outliers {cap} --out {outliers}", "already holds outliers.json", 1),
    ("plot-outliers {cap} --out {dir}/o --format bmp", "Unknown --format 'bmp'", 1),
    # compare-axes: an option no requested variant reads, more samples than the capture holds
    ("compare-axes {cap} --rotation-seed 3 --variants outliers", "--rotation-seed: read by "
     "--variants rotate, not by --variants outliers", 1),
    ("compare-axes {cap} --outlier-fraction 0.1", "--outlier-fraction: read by --variants "
     "outliers", 1),
    ("compare-axes {cap} --samples 10", "--samples 10: ", 1),
    # recommend: placement, model, option combinations, outputs -- all before measuring
    ("recommend {cap} -b 3 --device-map auto --max-memory 0=abc", "Invalid --max-memory", 1),
    ("recommend {cap} -b 3 --model {dir}/nope", "Model not found", 1),
    ("recommend {cap} -b 3 --set group-sizes=48", "do not divide", 1),
    ("recommend {cap} -b 3 --max-kld 0.1", "takes one of --budget-bits B", 1),
    ("recommend {cap} --budgets 2.5,3 --max-kld 0.1", "got --budgets and --max-kld", 1),
    ("recommend {cap}", "--target kvlens takes one of --budget-bits", 1),
    ("recommend {cap} --budgets 2.5,3", "give --output", 1),
    ("recommend {cap} --budgets 2.5,x -o {dir}/kv.json", "Invalid --budgets", 1),
    ("recommend {cap} --budgets 0,3 -o {dir}/kv.json", "each budget must be in (0, 16]", 1),
    ("recommend {cap} --budgets 1,3 -o {dir}/kv.json", "The budget is too small", 1),
    ("recommend {cap} --target vllm --budgets 2.5,3", "--budgets: read by --target kvlens", 1),
    ("recommend {cap} -b 3 --eval-tokens 128", "--eval-tokens: read by --validate or --max-kld",
     1),
    ("recommend {cap} -b 3 --set kld-anchors=2", "--set kld-anchors: read by an engine "
     "target (--target llama.cpp, vllm, sglang, trtllm or transformers), not by --target kvlens", 1),
    ("recommend {cap} --target vllm -b 9 --set flush=16 --name x",
     "--name, --set flush: read by --target kvlens (options of the per-layer kvlens "
     "recommendation), not by --target vllm; use --target kvlens, or drop them.", 1),
    ("recommend {cap} --target vllm -b 9 --windows 64", "--windows: read by --target kvlens", 1),
    ("recommend {cap} --target vllm -b 9 --eval-tokens 128", "--eval-tokens: read by "
     "--validate or --max-kld", 1),
    ("recommend {cap} --target vllm -b 9 --set kld-anchors=2", "give --max-kld too", 1),
    ("recommend {cap} --target vllm -b 9 --device-map auto", "no model is loaded here", 1),
    ("recommend {cap} --target tgi -b 9", "Unknown --target 'tgi'", 1),
    ("recommend {cap} -b 3 --set sensitivity=uniform --set retrieval=off --model {model}",
     "no model is loaded here", 1),
    ("recommend {cap} -b 3 --set mikv-bits=4", "--set mikv-bits: read by --set mikv=on, not by "
     "a run without it; add --set mikv=on, or drop it.", 1),
    ("recommend {cap} -b 3 --set mikv=off --set mikv-fractions=0.1",
     "--set mikv-fractions: read by --set mikv=on, not by --set mikv=off", 1),
    ("recommend {cap} -b 3 --thorough", "No such option: --thorough", 2),
    ("recommend {cap} -b 3 --set balancer=off --set balancer-exponent=0.3",
     "not by --set balancer=off, which removes them", 1),
    ("recommend {cap} -b 3 --set prefer-fast=on --set mikv=on", "--set mikv: read by the torch "
     "decode path (research twins are not read by the fused kernel), not by --set "
     "prefer-fast=on", 1),
    ("recommend {cap} -b 3 --set gear=on", "--set: unknown lever 'gear'; allowed: mikv", 1),
    ("recommend {cap} -b 3 --retrieval-prompts 2", "--retrieval-prompts: read by --validate", 1),
    ("recommend {cap} -b 3 --set sensitivity=model --set layout-tokens=256",
     "--set layout-tokens: read by the layout sensitivity (--set sensitivity=auto or layout), "
     "not by --set sensitivity=model", 1),
    ("recommend {cap} -b 3 --set sensitivity=uniform --set layout-layers=2 "
     "--set layout-tokens=256", "--set layout-layers, --set layout-tokens: read by the layout", 1),
    ("recommend {cap} -b 3 --set layout-tokens=64", "above the largest window (128)", 1),
    ("recommend {cap} -b 3 --set retrieval=off --set retrieval-weight=2",
     "--set retrieval-weight: read by the retrieval probe, not by --set retrieval=off", 1),
    ("recommend {cap} -b 3 -o {exists_json}", "already exists; pass --overwrite", 1),
    ("recommend {cap} --target vllm -b 9 -o {new_json}", "kv_scales.json already exists", 1),
    # recommend: what the capture's shape settles before any measurement
    ("recommend {cap} -b 1.0", "The budget is too small", 1),
    ("recommend {cap} -b 3 --samples 99", "holds 2 samples", 1),
    ("recommend {cap} -b 3 --tokens 99999", "tokens per sample", 1),
    ("recommend {cap} -b 3 --windows 0", "Window sizes [0] are not allowed", 1),
    # recommend: the research door (--set)
    ("recommend {cap} -b 3 --set bogus=1", "unknown lever 'bogus'", 1),
    ("recommend {cap} -b 3 --set codebooks=on", "unknown lever 'codebooks'", 1),  # removed
    ("recommend {cap} -b 3 --set gear=on", "unknown lever 'gear'", 1),  # removed
    ("recommend {cap} -b 3 --set mkiv=on", "did you mean mikv", 1),
    ("recommend {cap} -b 3 --set mikv", "expected NAME=VALUE", 1),
    ("recommend {cap} -b 3 --set mikv=maybe", "expected on|off", 1),
    ("recommend {cap} -b 3 --set bits=2,x", "expected int,...", 1),
    ("recommend {cap} -b 3 --set flush=8 --set flush=16", "given twice", 1),
    ("recommend {cap} --target vllm -b 9 --set mikv=on",
     "--set mikv: read by --target kvlens", 1),
    # generate: presets, configs, texts, outputs, the model's options
    ("generate --preset kivi-9 --prompt x", "Unknown preset 'kivi-9'", 1),
    # an engine-setting error lists the grammar with brackets: printed, not eaten as markup
    ("generate --compare vllm:fp8@[head] --prompt x", "vllm:D[@head][:pP|:sS]", 1),
    ("generate --config {bad} --prompt x", "not valid JSON", 1),
    ("generate --config {v99} --prompt x", "Unsupported KV config version 99", 1),
    ("generate --config {oops} --prompt x", "'layers' must be an object", 1),
    ("generate --preset kivi-2 --eval kld --text {missing}", "Text file not found", 1),
    ("generate --preset kivi-2 --prompt x --text {text}", "read by --eval kld or ppl", 1),
    ("generate --preset kivi-2 --prompt x --calibration {cap}", "no engine setting", 1),
    ("generate --preset kivi-2 --prompt x --device foo", "Unknown device 'foo'", 1),
    ("generate --preset kivi-2 --prompt x --model {dir}/nope", "Model not found", 1),
    ("generate --preset kivi-2 --prompt x --report-json {exists_json}",
     "already exists; pass --overwrite", 1),
    ("generate --preset kivi-2 --prompt x --backend cuda", "Unknown --backend 'cuda'", 1),
    ("generate --compare kivi-2,kivi-4 --eval ppl --frontier {dir}/f.png",
     "--frontier: read by --eval kld, not by --eval ppl; add it to --eval", 1),
    # generate: what depends on the model, against the shape its files declare
    ("generate --preset kivi-2 --eval retrieval --retrieval-lengths 100000",
     "Retrieval lengths 100000 do not fit", 1),
    ("generate --model {shaped} --preset kivi-2 --eval retrieval --retrieval-lengths 1000",
     "allowed 64-", 1),
    ("generate --model {shaped} --preset kivi-2 --eval kld --eval-tokens 300",
     "beyond the model's context", 1),
    ("generate --config {layer99} --prompt x", "overrides layers [99], but the model has 30", 1),
    ("generate --model {shaped} --config {layer99} --prompt x", "allowed indices: 0-1", 1),
    # report
    ("report {empty}", "holds no kvlens results", 1),
    ("report {dir}/nope", "is not a folder", 1),
    ("report {withreport}", "already exists; pass --overwrite", 1),
    # what the command-line parser refuses: exit code 2
    ("capture --bogus", "No such option", 2),
    ("capture -s many", "valid integer", 2),
    ("capture --model {model} -s 0 -o {dir}/a.h5", "Invalid value for '--samples'", 2),
    ("capture --model {model} -t 1 -o {dir}/a.h5", "Invalid value for '--tokens'", 2),
    ("compare-axes {cap} --samples 0", "Invalid value for '--samples'", 2),
    ("compare-axes {cap} --outlier-fraction 1", "Invalid value for '--outlier-fraction'", 2),
    ("compare-axes {cap} --threads 0", "Invalid value for '--threads'", 2),
    ("plot-outliers {cap} --out {dir}/o --top 0", "Invalid value for '--top'", 2),
    ("plot-outliers {cap} --out {dir}/o --threshold 1", "Invalid value for '--threshold'", 2),
    ("generate --preset kivi-2 --prompt x --max-new-tokens 0",
     "Invalid value for '--max-new-tokens'", 2),
    ("generate --preset kivi-2 --eval kld --chunk 0", "Invalid value for '--chunk'", 2),
    ("recommend {cap} -b 3 --samples 0", "Invalid value for '--samples'", 2),
    ("recommend {cap} -b 0", "Invalid value for '--budget-bits'", 2),
    ("recommend {cap} -b 17", "Invalid value for '--budget-bits'", 2),
    ("recommend {cap} -b 3 --retrieval-prompts -1", "Invalid value for '--retrieval-prompts'",
     2),
    ("recommend {cap} --target llama.cpp --max-kld 0", "Invalid value for '--max-kld'", 2),
    ("recommend -b 3", "Missing argument 'CAPTURE'", 2),
]


@pytest.mark.parametrize("line, message, code", ROWS)
def test_bad_input_is_one_clear_line_before_any_work(line, message, code, files, loads):
    args = [a.format(**files) if "{" in a and "@[" not in a else a for a in line.split()]
    res = runner.invoke(app, args)
    out = " ".join(res.output.split())
    assert res.exit_code == code, res.output
    assert message in out, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # no other exception
    assert "Traceback" not in res.output
    assert loads == []  # refused before any model was loaded
    if code == 1:
        assert res.output.lstrip().startswith("error:") and res.output.count("error:") == 1


def test_existing_outputs_are_kept(files, loads):
    """A refused output is left as it was (the policy is checked before anything is written)."""
    before = files["exists_h5"].read_bytes()
    res = runner.invoke(app, ["capture", "--model", str(files["model"]), "-o",
                              str(files["exists_h5"])])
    assert res.exit_code == 1 and files["exists_h5"].read_bytes() == before


def test_an_explicit_model_that_cannot_load_is_an_error_not_a_fallback(files, tmp_path):
    """--sensitivity auto falls back to uniform weights when the capture's own model is not
    available; a --model the user named must load (the fallback would hide a typo)."""
    from test_recommend import _planted_capture

    cap = _planted_capture(tmp_path / "p.h5")
    res = runner.invoke(app, ["recommend", str(cap), "-b", "3.5", "--windows", "128",
                              "--set", "group-sizes=32", "--set", "retrieval=off", "--model",
                              str(files["model"])])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "error:" in res.output and "uniform layer weights" not in res.output


# -- output write errors --------------------------------------------------------------------

def _full_disk(path, *args, **kwargs):
    import errno
    import os

    with open(path, "w") as f:
        f.write('{"kvlens_report": "compare-axes", "half')  # a partial file, then the disk is full
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_failed_write_is_one_line_and_leaves_nothing_that_looks_complete(files, tmp_path,
                                                                           monkeypatch):
    import kvlens.report.artifacts

    monkeypatch.setattr(kvlens.report.artifacts, "write_artifact",
                        lambda kind, doc, path: _full_disk(path))
    plots = tmp_path / "plots"
    res = runner.invoke(app, ["compare-axes", str(files["cap"]), "--bits", "2",
                              "--group-sizes", "8", "--plots", str(plots)])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "Cannot write" in out and "compare-axes.json" in out and "No space left" in out
    assert not (plots / "compare-axes.json").exists()
    assert not [p for p in plots.iterdir() if ".partial-" in p.name]  # the partial file is gone


def test_write_output_keeps_the_old_file_when_the_new_one_fails(tmp_path):
    from kvlens.cli.common import OutputWriteError, write_output, write_text_output

    path = tmp_path / "r.json"
    write_text_output(path, "old\n")
    with pytest.raises(OutputWriteError, match="No space left on device"):
        write_output(path, _full_disk)
    assert path.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [path]
    write_text_output(path, "new\n")
    assert path.read_text() == "new\n"


def test_an_unwritable_gguf_conversion_cache_warns(tmp_path, monkeypatch, capsys):
    """The conversion cache only saves time, so its failure does not stop the load, but it is
    said on stderr (where and why) instead of silently costing the conversion on every run."""
    import safetensors.torch

    from kvlens.model.load import _write_conversion_cache

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    _write_conversion_cache(None, None, blocker / "converted" / "model-abc")
    err = capsys.readouterr().err
    assert "could not write the GGUF conversion cache" in err
    assert str(blocker / "converted" / "model-abc") in err and "KVLENS_CACHE" in err

    class Model:
        class config:  # noqa: N801
            tie_word_embeddings = False

            @staticmethod
            def to_dict():
                return {}

        @staticmethod
        def state_dict():
            return {}

    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda state, path, **kwargs: _full_disk(path))
    target = tmp_path / "cache" / "model-abc"
    _write_conversion_cache(Model, None, target)
    err = capsys.readouterr().err
    assert "could not write the GGUF conversion cache" in err and "No space left" in err
    assert not target.exists() and list((tmp_path / "cache").iterdir()) == []


def test_refuse_unread_names_the_option_the_modes_that_read_it_and_the_one_asked():
    """The one helper every command's refusal table goes through
    (``kvlens.cli.common.refuse_unread``): an option read by the run passes, one that is not is
    refused naming it, the modes that read it and the mode asked for; options one rule refuses
    are named together; of several rules on one option the first that refuses is named; an
    option outside the table is read by every mode."""
    from kvlens.cli.common import ReadOnly, read_with, refuse_unread
    from kvlens.errors import InputError

    table = {"rank": read_with("--variants", "lowrank"),
             "seed": read_with("--variants", "rotate", "lowrank")}
    refuse_unread(table, {"rank": "--rank", "seed": "--seed", "other": "--other"}, ("lowrank",))
    with pytest.raises(InputError) as got:
        refuse_unread(table, {"other": "--other", "rank": "--rank", "seed": "--seed"},
                      ("balancer",))
    assert str(got.value) == ("--rank: read by --variants lowrank, not by --variants balancer; "
                              "add it to --variants, or drop it.")
    with pytest.raises(InputError, match="not by a run without --variants; add one to"):
        refuse_unread(table, {"seed": "--seed"}, ())
    wide = ReadOnly("wide runs", lambda run: run["wide"], "a narrow run")
    deep = ReadOnly(lambda run: f"depth > {run['depth']}", lambda run: run["depth"] > 1,
                    lambda run: f"--depth {run['depth']}", "raise --depth")
    rules = {"a": (wide, deep), "b": (wide, deep), "c": deep}
    with pytest.raises(InputError) as got:
        refuse_unread(rules, {"a": "--a", "b": "--b", "c": "--c"}, {"wide": True, "depth": 1})
    assert str(got.value) == ("--a, --b, --c: read by depth > 1, not by --depth 1; raise "
                              "--depth, or drop them.")
    with pytest.raises(InputError, match=r"^--a: read by wide runs, not by a narrow run; drop "
                                         r"it\.$"):
        refuse_unread(rules, {"a": "--a", "c": "--c"}, {"wide": False, "depth": 2})
    with pytest.raises(InputError) as got:  # --a is refused by its first rule only
        refuse_unread(rules, {"c": "--c", "a": "--a"}, {"wide": False, "depth": 1})
    assert str(got.value).startswith("--c: read by depth > 1")
