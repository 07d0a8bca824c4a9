"""The JSON files each command leaves beside its outputs for ``kvlens report`` (the contract).

Every artifact is one JSON object whose top level names what wrote it,
``{"kvlens_report": KIND, "schema_version": 1, ...}``, with ``KIND`` one of ``ARTIFACT_KINDS``;
which command writes which file: docs/report.md. Figures are named relative to the artifact's
folder (``"figures": [...]``), so a run folder can be moved or copied whole. This module only
builds and finds documents; it imports nothing heavy.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvlens.errors import InputError

SCHEMA_VERSION = 1
ARTIFACT_KINDS = ("capture", "outliers", "compare-axes", "recommend", "deploy", "generate")
MAX_DEPTH = 3  # folders below RUN_DIR searched for artifacts
MAX_BYTES = 256 * 2**20  # larger JSON files are not read (no kvlens artifact is that big)


def write_artifact(kind: str, doc: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``doc`` as the ``kind`` artifact at ``path``, the artifact header in front (numpy
    values become lists)."""
    if kind not in ARTIFACT_KINDS:
        raise ValueError(f"unknown artifact kind {kind!r}")
    doc = {"kvlens_report": kind, "schema_version": SCHEMA_VERSION,
           **{k: v for k, v in doc.items() if k not in ("kvlens_report", "schema_version")}}
    path = Path(path)
    path.write_text(json.dumps(doc, indent=1, default=json_default) + "\n")
    return path


def json_default(o):
    """What ``json.dumps`` writes for a numpy value (a list) or a path (its text)."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__fspath__"):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def check_output_file(path: str | os.PathLike | None, flag: str, overwrite: bool = False,
                      example: str = "out/eval.generate.json") -> None:
    """Fail before the work when ``flag``'s output file could not be written afterwards: a
    folder in its place, a missing parent folder, or (the one ``--overwrite`` policy of every
    command) an existing file while ``overwrite`` is False."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file name such as {example}.")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: folder {parent} does not exist; create it first.")
    if p.exists() and not overwrite:
        raise InputError(f"{flag} {path} already exists; pass --overwrite to replace it, or "
                         "choose another name.")


def check_output_folder(folder: str | os.PathLike, flag: str, artifact: str,
                        overwrite: bool = False) -> None:
    """The same policy for a command that writes a folder (figures and ``artifact``, the JSON
    it leaves for ``kvlens report``): the folder may be missing (it is created) or hold other
    files, but one that already holds ``artifact`` is an earlier run's and is only replaced
    with ``overwrite``."""
    p = Path(folder)
    if p.exists() and not p.is_dir():
        raise InputError(f"{flag} {folder} exists and is not a directory.")
    if (p / artifact).exists() and not overwrite:
        raise InputError(f"{flag} {folder} already holds {artifact} from an earlier run; pass "
                         "--overwrite to replace it, or choose another folder.")


def relative_names(paths: Iterable[str | os.PathLike], folder: str | os.PathLike) -> list[str]:
    """Figure paths as names relative to the artifact's folder (absolute when outside it)."""
    folder = Path(folder).resolve()
    out = []
    for p in paths:
        p = Path(p).resolve()
        try:
            out.append(p.relative_to(folder).as_posix())
        except ValueError:
            out.append(str(p))
    return out


# -- what the commands write ---------------------------------------------------------------

def capture_doc(summary: Mapping[str, Any], meta) -> dict[str, Any]:
    """Capture artifact from ``CaptureSummary.to_dict()`` and the file's ``CaptureMeta``."""
    return {
        "capture_file": Path(summary["path"]).name,
        "model": meta.model, "model_source": meta.model_source,
        "architecture": meta.shape.architecture, "model_type": meta.shape.model_type,
        "num_layers": meta.shape.num_layers, "layers": list(meta.layers),
        "num_attention_heads": meta.shape.num_attention_heads,
        "num_key_value_heads": meta.shape.num_key_value_heads, "head_dim": meta.shape.head_dim,
        "has_rope": meta.shape.has_rope, "rope": meta.shape.rope, "rope_layout": meta.rope_layout,
        "rotary_dim": meta.rotary_dim, "compute_dtype": meta.compute_dtype,
        "storage_dtype": meta.storage_dtype, "samples": meta.num_samples,
        "tokens": meta.num_tokens, "text_source": meta.text_source, "created": meta.created,
        "versions": {"kvlens": meta.kvlens_version,
                     "transformers": str(meta.extra.get("transformers_version", "")),
                     "torch": str(meta.extra.get("torch_version", ""))},
        "file_bytes": summary.get("file_bytes"), "seconds": summary.get("seconds"),
        "notes": list(summary.get("notes") or []),
    }


def compare_doc(result, figures: Iterable[str | os.PathLike], folder) -> dict[str, Any]:
    """compare-axes artifact: the summary, per-layer means and the figures.

    ``layer_means`` holds, per configuration, axis, metric and layer, the mean relative error
    over that layer's heads (what ``layers_<config>.png`` draws); the report reads per-layer
    disagreements between the metrics from it."""
    names = ("tensor", "bits", "group_size", "stage", "variant", "axis", "metric", "layer")
    sums: dict[tuple, list[float]] = defaultdict(list)
    for r in result.records:
        if r.format is None:  # the engine formats have no axis
            sums[tuple(getattr(r, n) for n in names)].append(r.rel_error)
    layer_means = [{**dict(zip(names, key)), "mean": sum(v) / len(v)}
                   for key, v in sorted(sums.items(), key=lambda kv: tuple(map(str, kv[0])))]
    return {"summary": result.summary, "layer_means": layer_means,
            "figures": relative_names(figures, folder)}


def config_doc_path(config_path: str | os.PathLike, kind: str) -> Path:
    """Where ``recommend -o X.json`` records its results: ``X.recommend.json`` (target kvlens)
    or ``X.deploy.json`` (an engine target)."""
    path = Path(config_path)
    return path.with_name(f"{path.stem}.{kind}.json")


def capture_doc_path(capture_path: str | os.PathLike) -> Path:
    """Where ``capture -o RUN.h5`` leaves its artifact: ``RUN.capture.json``."""
    p = Path(capture_path)
    return p.with_name(p.stem + ".capture.json")


# -- what the report reads -------------------------------------------------------------------

def find_artifacts(run_dir: str | os.PathLike) -> dict[str, list[tuple[Path, dict]]]:
    """Every artifact under ``run_dir`` (``MAX_DEPTH`` folders deep), by kind, newest first.

    JSON files that are not kvlens artifacts (configs, other tools' files) are ignored; an
    artifact of a newer schema is an error naming the file. Raises ``InputError`` when
    ``run_dir`` is not a folder."""
    root = Path(run_dir)
    if not root.is_dir():
        raise InputError(f"{run_dir} is not a folder; give the folder the kvlens commands wrote "
                         "into (e.g. out/ after `make demo`).")
    found: dict[str, list[tuple[Path, dict]]] = defaultdict(list)
    for path in _json_files(root):
        doc = _read(path)
        kind = doc.get("kvlens_report") if isinstance(doc, dict) else None
        if kind not in ARTIFACT_KINDS:
            continue
        version = doc.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise InputError(f"{path} is a {kind} artifact of schema version {version!r}; this "
                             f"kvlens reads up to {SCHEMA_VERSION}. Upgrade kvlens or re-run "
                             "the command that wrote it.")
        found[kind].append((path, doc))
    for docs in found.values():
        docs.sort(key=lambda pd: pd[0].stat().st_mtime, reverse=True)
    return dict(found)


def _json_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= MAX_DEPTH:
            dirnames[:] = []
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".json"))
    return out


#: names a kvlens artifact is written under: the analysis commands' fixed names, and the others'
#: ``X.<kind>.json`` beside what they wrote (``config_doc_path``, ``capture_doc_path``)
ARTIFACT_NAMES = ("outliers.json", "compare-axes.json")
ARTIFACT_SUFFIXES = tuple(f".{kind}.json" for kind in ARTIFACT_KINDS
                          if f"{kind}.json" not in ARTIFACT_NAMES)


def _read(path: Path):
    try:
        if path.stat().st_size > MAX_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        # Other JSON files (configs, other tools' files) may be anything; a file named like an
        # artifact that does not parse is a broken run, not something to skip silently.
        if path.name in ARTIFACT_NAMES or path.name.endswith(ARTIFACT_SUFFIXES):
            raise InputError(f"{path} looks like a kvlens artifact but cannot be read ({exc}); "
                             "re-run the command that wrote it, or delete the file.") from None
        return None
