"""Every command-line flag a message names exists: an error that tells the user to pass
``--prefer-fast`` after that option became ``--set prefer-fast=on`` sends them nowhere.

The messages are the string parts of every ``raise`` in kvlens/ (f-strings included); a flag
is ``--word`` (``-b``-style short flags are not checked). Flags of the engines kvlens tells
users to run (llama.cpp, vLLM, SGLang, pip) are listed in ``ENGINE_FLAGS``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import typer

from kvlens.cli import app

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
#: flags of other programs that kvlens' messages tell users to run
ENGINE_FLAGS = frozenset({
    "--kv-cache-dtype", "--kv-cache-dtype-skip-layers", "--quantization-param-path",
    "--model-path", "--no-deps", "--index-url",
})


def _cli_flags() -> set[str]:
    """Every long option of every command (and the group's own)."""
    group = typer.main.get_command(app)
    flags = {"--help", "--version"}
    commands = [group, *getattr(group, "commands", {}).values()]
    for command in commands:
        for param in command.params:
            flags.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return flags


def _message_parts(node: ast.Raise) -> list[str]:
    """The string constants of a raise statement (f-string literal parts included)."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _named_flags() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((ROOT / "kvlens").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise):
                for text in _message_parts(node):
                    out += [(str(path.relative_to(ROOT)), node.lineno, f)
                            for f in FLAG.findall(text)]
    return out


def test_every_flag_named_in_a_message_exists():
    known = _cli_flags() | ENGINE_FLAGS
    assert {"--budget-bits", "--eval-tokens", "--prompt-file"} <= known
    named = _named_flags()
    assert len(named) > 30  # the scan finds the messages (it would pass vacuously otherwise)
    unknown = [f"{path}:{line}: {flag}" for path, line, flag in named if flag not in known]
    assert not unknown, "messages name flags no command has:\n" + "\n".join(unknown)


KVLENS_ERRORS = {"KvlensError", "InputError", "OptionError", "PlacementError", "ConfigError",
                 "ModelLoadError", "CaptureFileError", "BackendError", "NumericalError"}


def test_every_field_an_option_error_names_is_a_flag():
    """Library errors name options by field (``{max_memory}``, ``kvlens.errors.KvlensError``)
    and the CLI writes each as its flag (``flag_of``: ``--max-memory``; recommend's options and
    levers as ``option_name``, ``--set NAME``): every field such a message names must be one."""
    from kvlens.cli.common import flag_of
    from kvlens.errors import OptionError

    assert OptionError("Invalid {max_memory} entry 'x'").render(flag_of) == \
        "Invalid --max-memory entry 'x'"
    assert str(OptionError("Invalid {max_memory} entry 'x'")) == "Invalid max_memory entry 'x'"
    known = _cli_flags()
    named = []
    for path in sorted((ROOT / "kvlens").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", "") in KVLENS_ERRORS:
                for text in _message_parts(node):
                    named += [(f"{path.relative_to(ROOT)}:{node.lineno}", f)
                              for f in re.findall(r"\{([a-z][a-z0-9_]*)\}", text)]
    assert len(named) > 10  # the scan finds them
    from kvlens.recommend.options import RecommendOptions, option_name
    from kvlens.research import levers

    def exists(field: str) -> bool:  # recommend's fields are named as its options or levers
        if field in RecommendOptions.__dataclass_fields__:
            name = option_name(field)
            return name in known or name.removeprefix("--set ") in levers()
        return flag_of(field) in known or any(lv.field == field for lv in levers().values())

    unknown = [f"{where}: {{{f}}}" for where, f in named if not exists(f)]
    assert not unknown, "option errors name fields that are no flag:\n" + "\n".join(unknown)
