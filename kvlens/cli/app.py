"""The ``kvlens`` Typer application every command registers on (``app``), and its root
callback (``--version``). Command modules import ``app`` from here, never from the package
``kvlens.cli``, whose ``__init__`` imports them."""

from __future__ import annotations

import typer

from kvlens.cli.common import KvlensGroup

app = typer.Typer(
    cls=KvlensGroup,
    name="kvlens",
    help="Diagnose, choose and prove KV-cache quantization for LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")):
    # without a command or --version, no_args_is_help has printed the help already
    if version:
        from kvlens import __version__

        typer.echo(__version__)
        raise typer.Exit()
