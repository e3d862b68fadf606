"""The `cache` scenario's limit row: MONAI's head alone on every item, in W worker processes, nothing written.

Any way of filling a cache with the head's outputs runs the head on every item; here W processes, each with
the torch threads `prep cache` gives a worker process, do only that: no dask, no writing, no pickling, no
results sent back. They come from `prep cache`'s forkserver (torch and MONAI imported, no OpenMP thread ever
started: a process forked from one whose OpenMP threads ran can hang in its first parallel region). They are
started and have each run the head on one item before the clock starts, so the row bounds what W workers
running one item at a time can do on this head and machine, start-up left out (`prep cache` below one worker
a core runs items side by side, and can pass it).
"""

from __future__ import annotations

import math
import multiprocessing
import time
from pathlib import Path
from typing import Any

from workflows.bench.core import Result, Unavailable

_HEAD: list[Any] = []  # the worker process's head Compose
_READY: list[Any] = []  # the Barrier of the workers
START_S = 300.0  # a worker that has not started by then fails the row (never a hang)


def _keep(ready: Any) -> None:
    """Pool initializer: keep the workers' Barrier (handed over at the start, as multiprocessing requires)."""
    _READY[:] = [ready]


def _start(args: tuple[str, int, dict[str, Any]]) -> int:
    """One a worker (each waits for all): load the head, set the torch threads, run one item (lazy imports)."""
    import os

    import torch

    from prep.pipeline import load_pipeline

    pipeline, threads, first = args
    torch.set_num_threads(threads)
    _HEAD[:] = [load_pipeline(Path(pipeline)).head_compose()]
    _HEAD[0](dict(first))
    _READY[0].wait(START_S)
    return os.getpid()


def _run(entries: list[dict[str, Any]]) -> int:
    for entry in entries:
        _HEAD[0](dict(entry))
    return len(entries)


def head_alone(data: str, entries: list[dict[str, Any]], pipeline: Path, workers: int, threads: int) -> Result:
    """items/s of the head alone on `workers` processes of `threads` torch threads (the limit row)."""
    from prep.processes import start_forkserver

    start_forkserver()  # a no-op where `prep cache` (or the benchmark's warm-up) started it
    ctx = multiprocessing.get_context("forkserver")
    ready = ctx.Barrier(workers)
    size = max(1, math.ceil(len(entries) / (workers * 8)))  # about 8 tasks a worker, as prep cache's
    tasks = [entries[i : i + size] for i in range(0, len(entries), size)]
    with ctx.Pool(workers, initializer=_keep, initargs=(ready,)) as pool:
        try:
            started = pool.map_async(_start, [(str(pipeline), threads, entries[0])] * workers, 1).get(START_S)
        except multiprocessing.TimeoutError:
            raise Unavailable(f"the worker processes did not start within {START_S:.0f} s") from None
        if len(set(started)) != workers:
            raise Unavailable(f"{len(set(started))} of {workers} worker processes started")
        t0 = time.perf_counter()
        done = sum(pool.imap_unordered(_run, tasks))
        seconds = time.perf_counter() - t0
    return Result(f"{data}: head alone, {workers} processes (limit)", data, done, seconds, 0, "ceiling",
                  "no writes, workers started and warm", {"torch threads": threads})  # fmt: skip
