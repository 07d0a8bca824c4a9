"""``kvlens report``: the diagnosis of one run folder as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

import typer

from kvlens.cli import app
from kvlens.cli.common import console, err_console, run_library_call


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="Folder the kvlens commands wrote into (e.g. out/ "
                                             "after `make demo`); searched 3 folders deep."),
    output: Path = typer.Option(None, "--output", "-o",
                                help="HTML file to write (default: RUN_DIR/report.html)."),
) -> None:
    """The whole diagnosis of a run folder on one self-contained HTML page.

    Reads what capture, plot-outliers, compare-axes, recommend and generate recorded in RUN_DIR
    (figures embedded, nothing to download; nothing is re-run) and names the command to run for
    any part that is missing (docs/report.md)."""
    from kvlens.report.render import write_report

    target = output if output is not None else run_dir / "report.html"
    page = run_library_call(lambda: write_report(run_dir, target, _deploy_option()))
    for title, m in page.missing:
        how = f"run {m.command}" if m.command else m.advice
        err_console.print(f"[yellow]missing[/] {title}: {m.what}: {how}", highlight=False,
                          soft_wrap=True)
    console.print(str(target.resolve()), highlight=False, soft_wrap=True)


def _deploy_option() -> str | None:
    """The recommend option that writes deploy settings, if this kvlens has one (named in the
    report's hint when a run lacks them)."""
    import click

    cmd = typer.main.get_command(app)
    rec = cmd.commands.get("recommend") if isinstance(cmd, click.Group) else None
    for param in getattr(rec, "params", []):
        if param.name in ("target", "deploy"):
            return param.opts[0]
    return None
