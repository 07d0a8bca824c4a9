"""Per-layer measurement on several processes (``RecommendOptions.workers``): each capture layer
is measured on its own, so layers are spread over worker processes of one torch thread each,
with the same arithmetic in the same order (a model forward's sums may round differently on one
thread). On Linux workers are forked (a script needs no ``__main__`` guard) and each opens the
capture itself (no capture may be open here while they start: HDF5 would share its handle);
elsewhere they are spawned. ``map_layers`` is the one entry; its ``fn`` is a module-level
function (pickled by name).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from kvlens.analysis.compare import torch_threads
from kvlens.capture.store import open_capture
from kvlens.recommend.profile import expect, extrapolate
from kvlens.units import format_seconds

#: A candidate stage predicted to take less than this (seconds: its first layer's time times
#: the layers) runs in this process: starting a worker (a fresh interpreter) costs seconds.
PARALLEL_FROM_SECONDS = 20.0

_worker: dict[str, Any] = {}


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | None, predicted_seconds: float, layers: int) -> int:
    """``workers`` as asked, or (None) every available core when the stage is predicted to
    take ``PARALLEL_FROM_SECONDS`` or more, else 1; never more than ``layers``."""
    n = workers if workers is not None else (
        available_cores() if predicted_seconds >= PARALLEL_FROM_SECONDS else 1)
    return max(1, min(n, layers))


def _start(path: str) -> None:
    torch.set_num_threads(1)
    _worker["cap"] = open_capture(path)


def _one(fn: Callable, index: int, args: tuple) -> tuple[int, Any]:
    cap = _worker["cap"]
    return index, fn(cap.layer(index), cap.meta, *args)


def can_fork() -> bool:
    """Whether workers are forked here (Linux): they then start with this process's memory,
    a loaded model included; elsewhere they are spawned and start bare."""
    return sys.platform.startswith("linux")


def map_layers(fn: Callable, path: str | Path, layers: Sequence[int], args: tuple,
               workers: int, progress: Callable[[int, int, str], None] | None = None,
               label: str = "layer", threads: int = 1,
               work: Sequence[float] | None = None) -> list:
    """``[fn(layer_data, meta, *args) for each of layers]`` on ``workers`` processes (one:
    here, on ``threads`` torch threads), calling ``progress(done, total, f"{label} {index}")``
    as layers finish; once one layer per worker has, predicts the rest at their rate, each
    layer counted by its ``work`` (None: equal)."""
    total = len(layers)
    shares = dict(zip(layers, work if work is not None else [1.0] * total))
    start, done = time.perf_counter(), []

    def finished(n: int, index: int) -> None:
        done.append(index)
        if n == min(workers, total) < total:
            took = time.perf_counter() - start
            whole = extrapolate(took, sum(shares[i] for i in done), sum(shares.values()))
            expect(whole - took, f"its first {n} of {total} layers took {format_seconds(took)}")
        if progress:
            progress(n, total, f"{label} {index}")

    if workers <= 1 or total <= 1:
        out = []
        with open_capture(path) as cap, torch_threads(threads):
            for n, index in enumerate(layers, 1):
                out.append(fn(cap.layer(index), cap.meta, *args))
                finished(n, index)
        return out
    results: dict[int, Any] = {}
    context = multiprocessing.get_context("fork" if can_fork() else "spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                             initargs=(str(path),)) as pool:
        jobs = [pool.submit(_one, fn, index, args) for index in layers]
        try:
            for n, job in enumerate(as_completed(jobs), 1):
                index, value = job.result()
                results[index] = value
                finished(n, index)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
    return [results[index] for index in layers]
