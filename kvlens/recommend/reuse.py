"""Measurements kept between runs (``kept_file``, ``read_kept``, ``keep``): ``measure`` does not
read the budget, so ``kvlens recommend`` again on the same capture with the same measuring
options reads what the first run measured (docs/recommend.md, time). A measurement is kept
under ``$KVLENS_MEASUREMENT_CACHE`` (``off``: none), named by a hash of everything it depends
on (``kept_file``), written to a temporary name and renamed, at most ``KEEP_AT_MOST`` of them.
A kept file holds data only (``CODEC``), so a file planted in a shared directory cannot run
code; one that fails any check is measured again and replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import time
import warnings
from pathlib import Path

import torch
import transformers

from kvlens.capture.source import model_spec_from_capture
from kvlens.capture.store import open_capture
from kvlens.model.load import cache_root
from kvlens.recommend.codec import CodecError, DataclassCodec
from kvlens.recommend.options import Candidate, RecommendOptions, Stream
from kvlens.recommend.pipeline import Measurements
from kvlens.recommend.profile import Profile

#: ``RecommendOptions`` fields that only the allocation reads (``choose``): a measurement made
#: with other values of these is the same measurement
ALLOCATION_ONLY = ("budget_bits", "context", "name", "fp_dtype")
#: a measurement read back: the one stage of its profile
REUSED_STAGE = "measurement read"
#: measurements kept at most (sizes: docs/lab-notes/benchmark-history.md); the least recently used go first
KEEP_AT_MOST = 64
#: the kept files' suffix (earlier versions' ``.pkl`` are never read)
KEPT_SUFFIX = ".npz"
# its version is raised whenever a field of Measurements (or what it holds) changes; older
# files are measured again; this line's git history says what each version changed
CODEC = DataclassCodec(Measurements, "kvlens.measurements", 9,
                       shared={"candidates": Candidate, "streams": Stream})


def cache_dir() -> Path | None:
    """Where measurements are kept (None: ``$KVLENS_MEASUREMENT_CACHE`` is ``off``)."""
    where = os.environ.get("KVLENS_MEASUREMENT_CACHE", "")
    if where.lower() == "off":
        return None
    return Path(where) if where else cache_root() / "measurements"


@functools.cache
def _source_digest() -> str:
    """A hash of kvlens' own Python sources (this installation's code)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _path_state(spec: str | None) -> str:
    """``spec`` and, where it names a file or directory here, every file's size and time."""
    if not spec or not Path(spec).exists():
        return repr(spec)
    p = Path(spec).resolve()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])


def kept_file(path: str | Path, opts: RecommendOptions) -> Path | None:
    """The file ``measure(path, opts)`` is kept in (None: no measurement is kept), named by a
    hash of the capture's bytes, every ``RecommendOptions`` field but ``ALLOCATION_ONLY``, the
    model's files (path, sizes, times), kvlens' own source and the torch and transformers
    versions."""
    where = cache_dir()
    if where is None:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(hashlib.file_digest(f, "sha256").digest())
    with open_capture(path) as cap:
        spec = opts.model or model_spec_from_capture(cap.meta)
    fields = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ALLOCATION_ONLY}
    for part in (repr(sorted(fields.items())), _path_state(spec), _source_digest(),
                 torch.__version__, transformers.__version__):
        h.update(part.encode())
    return where / f"{h.hexdigest()}{KEPT_SUFFIX}"


def read_kept(kept: Path | None) -> Measurements | None:
    """The measurement kept in ``kept`` (None: none there, or one that does not read back:
    ``CODEC.decode`` refuses it). Its profile has one stage, ``REUSED_STAGE``, and a note
    says where it came from."""
    if kept is None or not kept.is_file():
        return None
    start = time.perf_counter()
    try:
        m = CODEC.decode(kept.read_bytes())
    except (OSError, CodecError):  # measured again and replaced (keep)
        return None
    with contextlib.suppress(OSError):
        kept.touch()  # recently used: kept longest (keep)
    return dataclasses.replace(m, notes=[*m.notes, reused_note(kept)],
                               profile=Profile({REUSED_STAGE: time.perf_counter() - start}))


def reused_note(kept: Path) -> str:
    """What a run that read the measurement kept in ``kept`` says about it."""
    return (f"measurements reused from an earlier run with the same capture and measuring "
            f"options ({kept}; --remeasure measures again)")


def keep(m: Measurements, kept: Path | None) -> None:
    """Write ``m`` to ``kept`` (a temporary file renamed; a cache that cannot be written costs
    only the next run's time)."""
    if kept is None:
        return
    tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
    try:
        data = CODEC.encode(m)
    except CodecError as e:  # a value this format does not know: said, not kept
        warnings.warn(f"measurement not kept: {e}", stacklevel=2)
        return
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, kept)
        # a read touches its file (read_kept): the oldest by modification time went unused
        older = sorted(kept.parent.glob(f"*{KEPT_SUFFIX}"), key=lambda f: f.stat().st_mtime_ns)
        for f in older[:-KEEP_AT_MOST]:
            f.unlink(missing_ok=True)
    except OSError:
        tmp.unlink(missing_ok=True)
