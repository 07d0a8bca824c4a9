"""``kvlens report``: the diagnosis of one run folder as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli.app import app
from kvlens.cli.common import (
    OUTPUT,
    console,
    err_console,
    escape,
    run_library_call,
    shared_option,
    write_output,
)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", show_default=False, help="Folder the kvlens commands wrote into (e.g. out/ "
                                             "after `make demo`); searched 3 folders deep."),
    output: Path = typer.Option(None, "--output", "-o", rich_help_panel=OUTPUT,
                                help="HTML file to write (default: RUN_DIR/report.html)."),
    overwrite: bool = shared_option("overwrite"),
) -> None:
    """The whole diagnosis of a run folder on one self-contained HTML page.

    Examples:

      kvlens report out
      kvlens report out -o out/diagnosis.html --overwrite

    Reads what capture, plot-outliers, compare-axes, recommend and generate recorded in \
RUN_DIR (figures embedded, nothing to download; nothing is re-run) and names the command to \
run for any part that is missing (docs/report.md)."""
    from kvlens.report.artifacts import check_output_file
    from kvlens.report.render import write_report

    target = output if output is not None else run_dir / "report.html"
    pages: list = []

    def write():
        if run_dir.is_dir():  # otherwise write_report says what RUN_DIR must be
            check_output_file(target, "--output", overwrite, example="report.html")
        write_output(target, lambda tmp: pages.append(write_report(run_dir, tmp)))

    run_library_call(write)
    for title, m in pages[0].missing:
        err_console.print(f"[yellow]missing[/] {escape(f'{title}: {m.what}: run {m.command}')}",
                          highlight=False, soft_wrap=True)
    console.print(str(target.resolve()), highlight=False, soft_wrap=True, markup=False)

