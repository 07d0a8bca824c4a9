"""`kvlens capture` through Typer's runner: success, JSON summary and every bad-input path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlens.capture.store import open_capture
from kvlens.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["capture", *map(str, args)])


def test_capture_json_summary(tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "run.h5"
    res = _run("--model", tiny_model_dir, "--text", text_file, "-s", 2, "-t", 16,
               "--layers", "0,2", "-o", out, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["layers"] == [0, 2] and summary["samples"] == 2 and summary["tokens"] == 16
    assert summary["file_bytes"] == out.stat().st_size
    with open_capture(out) as cap:
        assert cap.meta.text_source == str(text_file)
        assert cap.tokens().shape == (2, 16)


def test_capture_table_output(tiny_model_dir, text_file, tmp_path):
    res = _run("--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 8,
               "-o", tmp_path / "r.h5")
    assert res.exit_code == 0, res.output
    assert "Capture written" in res.stdout and "3 layers" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "Model not found"),
    (["--model", "/nonexistent/model"], "or omit --model to use"),  # the field, as its flag
    (["--layers", "0,7"], "outside 0-2"),
    (["--layers", "a-b"], "Invalid layer spec"),
    (["--storage-dtype", "int8"], "Unknown storage dtype"),
    (["--tokens", "5000"], "tokens but"),
    (["--device", "tpu"], "Unknown device"),
])
def test_capture_bad_input(args, message, tiny_model_dir, text_file, tmp_path):
    base = ["--model", tiny_model_dir, "--text", text_file, "-s", 1, "-t", 8,
            "-o", tmp_path / "r.h5"]
    # later options override earlier ones in click, so the bad value wins
    res = _run(*base, *args)
    assert res.exit_code == 1
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "r.h5").exists()


def test_capture_refuses_empty_text_and_unwritable_dir(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    res = _run("--model", tiny_model_dir, "--text", empty, "-o", tmp_path / "r.h5")
    assert res.exit_code == 1 and "is empty" in res.output
    res = _run("--model", tiny_model_dir, "-o", tmp_path / "missing" / "r.h5")
    assert res.exit_code == 1 and "does not exist" in res.output


def test_capture_refuses_existing_output(tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "r.h5"
    out.write_bytes(b"keep me")
    res = _run("--model", tiny_model_dir, "--text", text_file, "-o", out)
    assert res.exit_code == 1 and "--overwrite" in res.output
    assert out.read_bytes() == b"keep me"


def test_unsupported_model_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32)).save_pretrained(tmp_path)
    res = _run("--model", tmp_path, "-o", tmp_path / "r.h5")
    assert res.exit_code == 1
    assert "Could not load model" in res.output or "Unsupported model" in res.output


def test_version_and_help():
    from kvlens import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == __version__
    res = runner.invoke(app, ["--help"])
    for command in ("capture", "plot-outliers", "compare-axes", "recommend", "generate"):
        assert command in res.stdout


def test_progress_is_plain_lines_where_stderr_is_not_a_terminal(monkeypatch):
    """A log file cannot redraw a bar: each stage's start and end is a line, lines in between
    come at most every PLAIN_EVERY_S seconds, each with the stage's elapsed time and, before
    its end, an ETA."""
    import io

    from rich.console import Console

    from kvlens.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, force_terminal=False))
    clock = iter([0.0, 1.0, 2.0, 3.0, 40.0, 41.0, 42.0])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    with common.progress_bar("measuring") as update:
        for i in range(1, 4):
            update(i, 3, f"layer {i - 1}")
        for i in range(1, 4):
            update(i, 3, f"probe layer {i - 1}")
    lines = buf.getvalue().splitlines()
    assert lines == ["  measuring: 1/3 layer 0  (elapsed 1 s, ETA 2 s)",
                     "  measuring: 3/3 layer 2  (elapsed 3 s)",
                     "  measuring: 1/3 probe layer 0  (elapsed 37 s, ETA 74 s)",
                     "  measuring: 3/3 probe layer 2  (elapsed 39 s)"]


def test_every_option_sits_in_a_help_panel_and_help_text_is_literal():
    """--help groups each command's options in named panels (Input, Model & placement,
    Output...), and brackets in help text are shown, not eaten as rich markup."""
    import typer

    commands = typer.main.get_command(app).commands  # typer may carry its own click
    assert {"capture", "plot-outliers", "compare-axes", "recommend", "generate",
            "report"} <= set(commands)
    for name, command in commands.items():
        loose = [p.opts[0] for p in command.params
                 if p.param_type_name == "option" and not getattr(p, "rich_help_panel", None)]
        assert loose == [], f"{name}: options outside a help panel: {loose}"
        overwrite = [p for p in command.params if p.name == "overwrite"]
        writes = any(p.name in ("output", "out", "plots", "report_json") for p in command.params)
        assert bool(overwrite) == writes, f"{name}: every command that writes takes --overwrite"
    res = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "vllm:D[@head][:pP|:sS]" in " ".join(res.stdout.split())
    res = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "120"})
    for panel in ("Input", "Budget & candidates", "Measurement", "Engine targets",
                  "Model & placement", "Validation", "Output"):
        assert f"─ {panel}" in res.stdout


def test_tables_use_a_log_width_where_stdout_is_not_a_terminal(monkeypatch):
    """Written to a file or pipe, tables are laid out LOG_WIDTH wide so that no number is cut
    (rich would wrap them at 80 columns); COLUMNS still wins where it is set."""
    from rich.console import Console
    from rich.table import Table

    from kvlens.cli import common

    monkeypatch.delenv("COLUMNS", raising=False)
    console = common._console()
    assert not console.is_terminal and console.width == common.LOG_WIDTH
    table = Table("config", *[f"column {i}" for i in range(6)])
    table.add_row("recommend -b 3.0", *[f"0.{i:04d} [0.{i:04d}, 0.{i + 1:04d}]" for i in range(6)])
    with console.capture() as cap:
        console.print(table)
    assert "…" not in cap.get() and "0.0005 [0.0005, 0.0006]" in cap.get()
    narrow = Console(width=80, force_terminal=False)  # what rich does by default in a log
    with narrow.capture() as cap:
        narrow.print(table)
    assert "0.0005 [0.0005, 0.0006]" not in cap.get()
    monkeypatch.setenv("COLUMNS", "90")
    assert common._console().width == 90


# -- --help: whole, true, with examples -----------------------------------------------------

def _commands() -> dict:
    import typer

    return typer.main.get_command(app).commands


def _help(args: list[str], columns: int = 80) -> str:
    res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.stdout


def _flat(text: str) -> str:
    """Help text as one line: panel borders dropped, wrapped lines joined."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("command", ["capture", "compare-axes", "plot-outliers", "generate",
                                     "recommend", "report"])
def test_help_is_whole_at_80_columns(command):
    """Rich cuts a word too long for its cell with an ellipsis: no help text may be cut."""
    assert command in _commands()
    text = _help([command])
    assert "…" not in text, text
    assert not re.search(r"\w\.\.\.\s*│", text), text


def test_every_command_is_covered_by_the_help_tests():
    assert set(_commands()) == {"capture", "compare-axes", "plot-outliers", "generate",
                                "recommend", "report"}


def test_flags_show_no_value_type():
    """A flag takes no value: --help shows none (typer would print ``--overwrite <bool>``)."""
    for args in ([], *([c] for c in _commands())):
        text = _help(args, 120)
        assert "<bool>" not in text, args
    assert re.search(r"--overwrite +Replace existing", _help(["capture"], 120))


@pytest.mark.parametrize("command", ["capture", "compare-axes", "plot-outliers", "generate",
                                     "recommend", "report"])
def test_help_opens_with_examples_that_parse(command):
    """2-3 example command lines above the options, each one the CLI accepts (checked as
    tests/test_docs.py checks the docs' command lines)."""
    from test_docs import CommandLine, problems

    text = _help([command], 120)
    before_options = text.split("╭─", 1)[0]
    examples = [line.strip() for line in before_options.splitlines()
                if line.strip().startswith(f"kvlens {command}")]
    assert 2 <= len(examples) <= 3, before_options
    for example in examples:
        line = CommandLine(page=Path(__file__), line=0, text=example, complete=True)
        assert problems(line) == [], example


def test_engine_setting_grammar_is_one_text_in_help_and_errors():
    """--help and the error for a bad engine setting print the same grammar, from one
    definition (kvlens.config.engine.setting_forms)."""
    from kvlens.config.engine import SETTING_OPTIONS, setting_forms

    help_text = _flat(_help(["generate"], 80))
    res = runner.invoke(app, ["generate", "--compare", "vllm:nope", "--prompt", "x"])
    assert res.exit_code == 1 and res.output.startswith("error:")
    error = _flat(res.output)
    for form in setting_forms():
        assert form in help_text, form
        assert form in error, form
    assert " ".join(SETTING_OPTIONS.split()) in help_text


def test_help_names_no_measured_number():
    """Help texts describe; measured numbers (seconds, KLDs, speed-ups) belong in docs/."""
    for command in _commands():
        text = _flat(_help([command], 200))
        assert not re.search(r"\d+(\.\d+)? ?(s|min|seconds|minutes)\b|\d+(\.\d+)?x faster|"
                             r"KLD (of |= ?)?\d", text), (command, text)
