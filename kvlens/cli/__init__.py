"""The ``kvlens`` command line, a thin layer over the library: each command lives in its own
module here and registers itself on ``app`` (``kvlens.cli.app``); library errors become exit
codes in one place (``kvlens.cli.common.run_library_call``).
"""

from __future__ import annotations

import importlib

from typer.core import TyperCommand

from kvlens.cli.app import app
from kvlens.cli.common import KvlensCommand

__all__ = ["app", "main"]


def _register_commands() -> None:
    # Imported for their side effect of adding commands to ``app``, in --help's order; each
    # module keeps heavy imports (torch, transformers, h5py, matplotlib) inside its command.
    for name in ("capture", "compare", "outliers", "generate", "recommend", "report"):
        importlib.import_module(f"kvlens.cli.{name}")
    # One way of showing --help for every command: KvlensCommand or a subclass
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = KvlensCommand


_register_commands()


def main() -> None:
    """Console-script entry point. Commands map library errors to exit code 1 themselves
    (``kvlens.cli.common.run_library_call``), so that Typer's test runner sees the same."""
    app()
