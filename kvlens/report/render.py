"""Assemble the sections and render them through the Jinja2 template into one HTML file.

The page is self-contained: styles inline, figures embedded (``kvlens.report.figures``), no
scripts, fonts or links to load. Light and dark colour schemes follow the reader's
``prefers-color-scheme``; figures sit on a white panel in both, as matplotlib drew them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvlens import __version__
from kvlens.errors import InputError
from kvlens.report import sections as S
from kvlens.report.answer import answer_section
from kvlens.report.artifacts import ARTIFACT_KINDS, MAX_DEPTH, check_output_file, find_artifacts

TEMPLATE = "report.html.j2"


@dataclass
class Report:
    run_dir: str
    title: str
    generated: str
    version: str
    sections: list[S.Section]
    found: list[str] = field(default_factory=list)  # "kind: file" of every artifact read

    @property
    def missing(self) -> list[tuple[str, S.Missing]]:
        return [(s.title, m) for s in self.sections for m in s.missing]


def build_report(run_dir: str | os.PathLike) -> Report:
    """The page's content from the artifacts under ``run_dir``.

    Raises ``InputError`` when ``run_dir`` is not a folder or holds no kvlens output at all."""
    root = Path(run_dir)
    artifacts = find_artifacts(root)
    if not artifacts:
        raise InputError(
            f"{run_dir} holds no kvlens results: none of its JSON files (searched "
            f"{MAX_DEPTH} folders deep) is one that capture, plot-outliers, compare-axes, "
            "recommend or generate writes. Run the pipeline into it first, e.g. `make demo "
            f"OUT={run_dir}` or `kvlens capture -o {root / 'run.h5'}` and the commands after it "
            "(docs/report.md).")
    hint = _capture_hint(artifacts, root)
    body = [answer_section(artifacts, root, hint),
            S.model_section(artifacts, root, hint), S.outliers_section(artifacts, root, hint),
            S.axes_section(artifacts, root, hint),
            S.recommend_section(artifacts, root, hint),
            S.validation_section(artifacts, root)]
    body.append(S.not_measured_section(body))
    _, doc = S.latest(artifacts, "capture")
    model = next((str(d["model"]) for d in [doc or {}, *S.capture_records(artifacts)]
                  if d.get("model")), "a run")
    found = [f"{kind}: {S._rel(path, root)}" for kind in ARTIFACT_KINDS
             for path, _ in artifacts.get(kind, [])[:1]]
    found += [f"{kind}: {S._rel(path, root)} (older, not shown)" for kind in ARTIFACT_KINDS
              for path, _ in artifacts.get(kind, [])[1:]]
    return Report(run_dir=str(root), title=f"kvlens report: {model}",
                  generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  version=__version__, sections=body, found=found)


def _capture_hint(artifacts: dict, root: Path) -> str:
    """The capture file to name in commands: the one the run used, else RUN_DIR/run.h5."""
    path, doc = S.latest(artifacts, "capture")
    if doc and doc.get("capture_file"):
        return str(path.parent / doc["capture_file"])
    return next((str(d["path"]) for d in S.capture_records(artifacts) if d.get("path")),
                str(root / "run.h5"))


def render_html(report: Report) -> str:
    from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

    env = Environment(loader=PackageLoader("kvlens.report", "templates"),
                      autoescape=select_autoescape(["html", "j2"]), undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE).render(report=report)


def write_report(run_dir: str | os.PathLike, output: str | os.PathLike) -> Report:
    """Build the report of ``run_dir`` and write it as one HTML file to ``output``."""
    report = build_report(run_dir)
    check_output_file(output, "{output}", overwrite=True, example=Path(output) / "report.html")
    Path(output).write_text(render_html(report), encoding="utf-8")
    return report
