"""Shared CLI helpers: consoles, progress bars, JSON output, help panels and the command class
that renders --help, the output-file policy (atomic writes) and the one place library errors
become exit codes (docs/reference/README.md: 0 done; 1 one ``error:`` line for any
``KvlensError``, before any progress output; 2 a command line the parser refuses, every static
range declared on its option with ``min=``/``max=`` or ``open_range``; 130 interrupted).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from kvlens.errors import InputError, KvlensError
from kvlens.units import format_seconds

# -- --help ---------------------------------------------------------------------------------

class _FlagsWithoutType:
    """Flags shown without a value type: typer prints a flag's Python type as its value
    (``--overwrite <bool>``), yet a flag takes none."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class KvlensCommand(_FlagsWithoutType, TyperCommand):
    """Every kvlens command (``kvlens.cli.app`` gives it to each)."""


class KvlensGroup(_FlagsWithoutType, TyperGroup):
    """``kvlens`` itself: its flags (--version, --help) shown without a value type."""


class LibraryDefaults(KvlensCommand):
    """A command whose --help shows each option's default from the library's option dataclasses
    (``library_options``, the one source; imported when help is asked for, so that ``kvlens
    --help`` loads no torch): an option shows none where they give no single default for its
    name, or it is a flag or in ``not_shown``. The command passes the library only what the
    user gave."""

    not_shown: tuple[str, ...] = ()

    def library_options(self) -> tuple[type, ...]:
        return ()

    def format_help(self, ctx, formatter) -> None:
        from dataclasses import MISSING, fields

        defaults: dict[str, set[str]] = {}
        for f in (f for cls in self.library_options() for f in fields(cls)
                  if f.default is not MISSING):
            d = f.default
            defaults.setdefault(f.name, set()).add(",".join(map(str, d))
                                                   if isinstance(d, tuple) else str(d))
        for p in self.params:
            shown = defaults.get(p.name, set())
            if len(shown) == 1 and not shown & {"None", ""} and not isinstance(p.default, bool) \
                    and p.name not in self.not_shown:
                p.default, p.show_default = shown.pop(), True
        super().format_help(ctx, formatter)


#: Width of tables written to a file or pipe (a log, CI): wide enough that no number is cut.
LOG_WIDTH = 200


def _console(stderr: bool = False) -> Console:
    """A console that keeps a terminal's width, and ``LOG_WIDTH`` columns (unless ``COLUMNS``
    says otherwise) where the output is not a terminal, where rich would otherwise wrap tables
    at 80 columns and cut numbers."""
    out = Console(stderr=stderr)
    if out.is_terminal or os.environ.get("COLUMNS"):
        return out
    return Console(stderr=stderr, width=LOG_WIDTH)


console = _console()  # results (stdout)
err_console = _console(stderr=True)  # progress, logs, errors

# --help panels (``rich_help_panel=``), shared so that every command groups its options alike.
INPUT = "Input"
BUDGET = "Budget & candidates"
MEASUREMENT = "Measurement"
ANALYSIS = "Analysis"
ENGINE = "Engine targets (--target)"
EVALUATION = "Evaluation"
CACHES = "KV caches"
MODEL = "Model & placement"
VALIDATION = "Validation"
OUTPUT = "Output"


class OutputWriteError(KvlensError):
    """An output file could not be written (disk full, no permission...)."""


def write_output(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Write one output file atomically: ``write(tmp)`` fills a hidden partial file beside
    ``path``, then renamed over it; a failure or Ctrl-C removes it and leaves ``path`` as it
    was (an ``OSError`` becomes ``OutputWriteError``, naming the file and the reason)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputWriteError(f"Cannot write {path}: {exc.strerror or exc}. Nothing was written "
                               "there; free some space or choose a writable location.") from None
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path


def write_text_output(path: str | os.PathLike, text: str) -> Path:
    """``write_output`` of a UTF-8 text."""
    return write_output(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_artifact_output(kind: str, doc: Any, path: str | os.PathLike) -> Path:
    """``kvlens.report.artifacts.write_artifact``, atomically (``write_output``)."""
    from kvlens.report.artifacts import write_artifact

    return write_output(path, lambda tmp: write_artifact(kind, doc, tmp))


def write_config_doc(kind: str, doc: Any, config_path: Path) -> None:
    """recommend's ``kind`` artifact beside the config it wrote, naming the config
    (``kvlens.report.artifacts.config_doc_path``, atomically), and a line on stderr saying so."""
    from kvlens.report.artifacts import config_doc_path

    path = run_library_call(lambda: write_artifact_output(
        kind, {**doc, "config_file": Path(config_path).name}, config_doc_path(config_path, kind)))
    err_console.print(f"results for `kvlens report` written: {escape(str(path))}")


@contextmanager
def output_errors(what: str):
    """Turn an ``OSError`` while writing ``what`` (figures a plotting library saves itself)
    into ``OutputWriteError``."""
    try:
        yield
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        raise OutputWriteError(f"Cannot write {what}{where}: {exc.strerror or exc}; free some "
                               "space or choose a writable location.") from None


def given_options(ctx: typer.Context, names: Iterable[str]) -> dict[str, str]:
    """Of the parameters ``names``, those the user gave (not left at their default): parameter
    name -> the flag as spelled in --help (``"budget_bits" -> "--budget-bits"``)."""
    def given(name: str) -> bool:
        source = ctx.get_parameter_source(name)  # typer may carry its own copy of click's enum
        return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")

    wanted = set(names)
    return {p.name: p.opts[0] for p in ctx.command.params if p.name in wanted and given(p.name)}


@dataclass(frozen=True, eq=False)
class ReadOnly:
    """An option that only some modes of a command read: ``reads(run)`` says whether ``run``
    (the command's own record of what this command line asks for) is one of them. ``by``
    names the modes that read it and ``mode`` the one asked for (each a text, or a function
    of ``run`` giving one), as the user spells them; ``fix`` what to do instead of dropping
    it (``{them}``: it or them)."""

    by: str | Callable[[Any], str]
    reads: Callable[[Any], bool]
    mode: str | Callable[[Any], str]
    fix: str = ""

    def message(self, flags: list[str], run: Any) -> str:
        them = "them" if len(flags) > 1 else "it"
        by, mode = (t(run) if callable(t) else t for t in (self.by, self.mode))
        fix = f"{self.fix.format(them=them)}, or " if self.fix else ""
        return f"{', '.join(flags)}: read by {by}, not by {mode}; {fix}drop {them}."


def read_with(option: str, *modes: str) -> ReadOnly:
    """Read when the command line's ``option`` (``--eval``, ``--variants``) asks for one of
    ``modes``; its ``run`` is the modes asked for."""
    return ReadOnly(by=f"{option} {' or '.join(modes)}",
                    reads=lambda asked: bool(set(modes) & set(asked)),
                    mode=lambda asked: f"{option} {','.join(asked)}" if asked
                    else f"a run without {option}",
                    fix=f"add {'one' if len(modes) > 1 else 'it'} to {option}")


def refuse_unread(table: Mapping[str, ReadOnly | tuple[ReadOnly, ...]],
                  given: Mapping[str, str], run: Any) -> None:
    """Refuse the options the user gave (``given``: name -> flag) that ``run`` does not read:
    one ``InputError`` naming those the first failing ``ReadOnly`` refuses. ``table``: the
    command's one table, option name -> its ``ReadOnly`` (or several, each of which must read
    it); an option not in it is read by every mode."""
    refused: dict[int, tuple[ReadOnly, list[str]]] = {}
    for name, flag in given.items():
        rules = table.get(name, ())
        for rule in rules if isinstance(rules, tuple) else (rules,):
            if not rule.reads(run):
                refused.setdefault(id(rule), (rule, []))[1].append(flag)
                break
    for rule, flags in refused.values():
        raise InputError(rule.message(flags, run))


def new_table(title: str, columns: Iterable[str], left: tuple[int, ...] = (0,),
              no_wrap: bool = False, **table):
    """A rich table titled ``title`` (``table``: its other arguments) with ``columns``: those
    at the indices in ``left`` left-justified (text), the others right-justified (numbers)."""
    from rich.table import Table

    t = Table(title=title, **table)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i in left else "right", no_wrap=no_wrap)
    return t


def print_json(obj: Any) -> None:
    from kvlens.report.artifacts import json_default

    sys.stdout.write(json.dumps(obj, indent=2, default=json_default) + "\n")
    sys.stdout.flush()


PLAIN_EVERY_S = 30.0  # progress lines where stderr is not a terminal


@contextmanager
def progress_bar(description: str):
    """Yield ``update(done, total, note="")`` that draws a rich progress bar on stderr.

    The bar appears at the first update, so errors raised before any work starts (bad options,
    a missing model) are not interleaved with an empty bar. Where stderr is not a terminal (a
    log file, CI) a bar cannot redraw: a plain line is printed instead at each stage's end and
    at most every ``PLAIN_EVERY_S`` seconds in between."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    state: dict = {"last": time.monotonic()}

    def plain(done: int, total: int, note: str) -> None:
        # a stage is a run of updates with one total and one note apart from its numbers; it
        # began when the update before it came (or the bar opened)
        now = time.monotonic()
        key = (total, "".join(ch for ch in note if not ch.isdigit()))
        if state.get("key") != key:
            state.update(key=key, start=state["last"], printed=-PLAIN_EVERY_S)
        state["last"] = now
        if done < total and now - state["printed"] < PLAIN_EVERY_S:
            return
        state["printed"] = now
        elapsed = now - state["start"]
        timing = f"elapsed {format_seconds(elapsed)}"
        if 0 < done < total:
            timing += f", ETA {format_seconds(elapsed * (total - done) / done)}"
        err_console.print(f"  {description}: {done}/{total} {note}".rstrip() + f"  ({timing})",
                          highlight=False, markup=False)

    def update(done: int, total: int, note: str = "") -> None:
        if not err_console.is_terminal:
            plain(done, total, note)
            return
        if "prog" not in state:
            prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[note]}"), console=err_console)
            prog.start()
            state["prog"], state["task"] = prog, prog.add_task(description, total=total, note="")
        state["prog"].update(state["task"], completed=done, total=total, note=note)

    try:
        yield update
    finally:
        if "prog" in state:
            state["prog"].stop()


#: Options several commands share, one spelling and help each (``shared_option``): parameter
#: name -> (default, flags, --help panel, help).
SHARED_OPTIONS: dict[str, tuple[Any, tuple[str, ...], str, str]] = {
    "model": (None, ("--model", "-m"), MODEL, "Model: omit for the embedded SmolLM2-135M-Instruct, "
              "or a local HF directory, a .gguf file, or a hub id."),
    "dtype": ("float32", ("--dtype",), MODEL, "Compute dtype of the model: float32, float16 or "
              "bfloat16."),
    "device": ("auto", ("--device",), MODEL, "auto, cpu or cuda."),
    "device_map": (None, ("--device-map",), MODEL, "Place the model with accelerate: auto, "
                   "balanced, sequential (spread over GPUs, then CPU, then disk), or a JSON map of "
                   "module -> GPU index/cpu/disk (inline or a file). docs/large-models.md."),
    "max_memory": (None, ("--max-memory",), MODEL, "With --device-map: per-device limits, e.g. "
                   "0=20GiB,1=20GiB,cpu=60GiB,disk=200GiB (GPU index, cpu, disk)."),
    "offload_folder": (None, ("--offload-folder",), MODEL, "With --device-map: a writable "
                       "directory for weights offloaded to disk (without it nothing may go to "
                       "disk)."),
    "overwrite": (False, ("--overwrite",), OUTPUT, "Replace existing output files (without it an "
                  "existing output is refused before any work)."),
    "as_json": (False, ("--json",), OUTPUT, "Print {} as JSON on stdout."),
}


def shared_option(name: str, what: str = "", **override):
    """The ``typer.Option`` of ``SHARED_OPTIONS[name]``; ``what`` fills the help's ``{}``
    (``--json``: what it prints), ``override`` replaces its default or help (or adds an
    argument of ``typer.Option``)."""
    default, flags, panel, text = SHARED_OPTIONS[name]
    options = {"help": text.format(what)} | override
    return typer.Option(options.pop("default", default), *flags, rich_help_panel=panel, **options)


def open_range(low: float, high: float):
    """An option callback refusing values outside the open interval ``(low, high)`` as the
    parser refuses a number outside a declared ``min=``/``max=`` (exit code 2): click's own
    ranges are closed in typer."""
    def check(value):
        if value is not None and not low < value < high:
            bounds = f"x>{low:g}" if high == float("inf") else f"{low:g}<x<{high:g}"
            raise typer.BadParameter(f"{value:g} is not in the range {bounds}.")
        return value

    return check


def flag_of(field: str) -> str:
    """The flag a library field is given as: ``max_memory`` -> ``--max-memory``."""
    return "--" + field.replace("_", "-")


def run_library_call(fn: Callable[[], Any], name: Callable[[str], str] = flag_of) -> Any:
    """Call library code, turning ``KvlensError`` into one error line (options named by
    ``name(field)``, printed literally) and exit code 1. ``kvlens.research`` is imported first:
    its presets and config keys are the CLI's."""
    import kvlens.research  # noqa: F401  (registers research presets, config keys, twins)

    try:
        return fn()
    except KvlensError as exc:
        text = exc.render(name)
        err_console.print(f"[bold red]error:[/] {escape(text)}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1) from None
