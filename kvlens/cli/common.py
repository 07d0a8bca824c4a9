"""Shared CLI helpers: consoles, progress bars, JSON output, error mapping for the runner."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

console = Console()  # results (stdout)
err_console = Console(stderr=True)  # progress, logs, errors


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__fspath__"):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


PLAIN_EVERY_S = 30.0  # progress lines where stderr is not a terminal


@contextmanager
def progress_bar(description: str, enabled: bool = True):
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

    state: dict = {}

    def update(done: int, total: int, note: str = "") -> None:
        if not enabled:
            return
        if not err_console.is_terminal:
            now = time.monotonic()
            if done >= total or now - state.get("printed", -PLAIN_EVERY_S) >= PLAIN_EVERY_S:
                state["printed"] = now
                err_console.print(f"  {description}: {done}/{total} {note}".rstrip(),
                                  highlight=False)
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


def device_map_option():
    return typer.Option(None, "--device-map",
                        help="Place the model with accelerate: auto, balanced, sequential "
                             "(spread over GPUs, then CPU, then disk), or a JSON map of module "
                             "-> GPU index/cpu/disk (inline or a file). docs/large-models.md.")


def max_memory_option():
    return typer.Option(None, "--max-memory",
                        help="With --device-map: per-device limits, e.g. "
                             "0=20GiB,1=20GiB,cpu=60GiB,disk=200GiB (GPU index, cpu, disk).")


def offload_folder_option():
    return typer.Option(None, "--offload-folder",
                        help="With --device-map: a writable directory for weights offloaded "
                             "to disk (without it nothing may go to disk).")


def format_bytes_by_device(by_device: dict[str, int]) -> str:
    """``cpu 270.1 MiB, disk 243.1 MiB`` (KiB below 1 MiB)."""
    def size(n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    return ", ".join(f"{dev} {size(n)}" for dev, n in by_device.items()) or "-"


def run_library_call(fn: Callable[[], Any]) -> Any:
    """Call library code, turning ``KvlensError`` into a clean exit(1) (also under CliRunner)."""
    import typer

    from kvlens.errors import KvlensError

    try:
        return fn()
    except KvlensError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
