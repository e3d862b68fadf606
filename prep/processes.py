"""How `prep cache`'s local worker processes start: forked by multiprocessing's forkserver, never by `prep cache`.

distributed starts every local worker process on a thread of its own, so forking them from `prep cache` means
several forks at once from a multi-threaded process: from Python 3.12 filelock's fork audit hook raises
"os.fork is unsafe while filelock is changing descriptor ownership" (seen with 16 workers), CPython
warns of deadlocks in the children on every version, and a process where CUDA is initialised cannot be forked
at all. The forkserver is a fresh single-threaded interpreter that never touches CUDA and forks each worker
from its own main thread, one at a time.

It preloads torch, MONAI's transforms and `prep.worker` (PRELOAD), then freezes those objects (`prep.frozen`:
the workers' garbage collector leaves their shared pages alone: less CPU and fewer page faults at each
worker's start), and `prep cache` starts it while it plans and times the head on one item, so its imports
overlap that work. Started ahead so, the workers are ready sooner than forked from `prep cache` and several
times sooner than from a forkserver started with the cluster or one with distributed's preload, where each
worker imports torch and MONAI itself (docs/benchmarks.md, Preparation).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

PRELOAD = ("prep.nosigint", "distributed", "torch", "monai.transforms", "prep.worker", "prep.frozen")
PRELOAD_S = 4.0  # the forkserver's imports of PRELOAD (a few seconds on a small shared machine: docs/benchmarks.md)
_lock = threading.Lock()
_started_at: float | None = None  # time.monotonic() when this process started its forkserver


def worker_environ(threads: int) -> dict[str, str | None]:
    """Environment of local worker processes (None: unset), fit for torch heads.

    dask's default MALLOC_TRIM_THRESHOLD_ pins glibc's mmap threshold at 128 KiB, so every volume-sized tensor
    is a fresh mmap whose pages fault in zeroed: measured 18x the page faults and 2 -> 37 ms of system time
    per 64^3 item. OMP threads otherwise spin-wait between torch ops, burning cores the other workers need.
    """
    return {"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "OMP_WAIT_POLICY": "PASSIVE"}  # fmt: skip


@contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `values` set where the environment does not set them already (the user's own win)."""
    added = [key for key, value in values.items() if value is not None and key not in os.environ]
    for key in added:
        os.environ[key] = str(values[key])
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def start_forkserver(threads: int = 1) -> None:
    """Start this process's forkserver now, preloading PRELOAD in the background; a no-op once it runs.

    It is started with `worker_environ(threads)`: the C libraries of the workers it forks read their settings
    in the forkserver (libgomp when torch loads it, glibc's malloc at start), not per worker.
    """
    global _started_at
    from multiprocessing import forkserver

    import dask
    from distributed.utils import get_mp_context

    with _lock:
        with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
            context = get_mp_context()  # distributed sets its own preload list once; ours replaces it
        context.set_forkserver_preload(list(PRELOAD))
        server = forkserver._forkserver
        if _started_at is None and getattr(server, "_forkserver_pid", None) is not None:
            # a forkserver this process started for something else (a DataLoader's forkserver workers): without
            # the preload and the workers' environment; stopped, the next user of it starts this one
            with suppress(Exception):
                server._stop()  # type: ignore[attr-defined]  # CPython's own method
        with _environ(worker_environ(threads)):
            forkserver.ensure_running()  # returns once the server runs; it imports PRELOAD meanwhile
        if _started_at is None:
            _started_at = time.monotonic()


def seconds_to_ready(now: float | None = None) -> float:
    """Expected seconds until the forkserver has its imports done: PRELOAD_S less the time since its start."""
    if _started_at is None:
        return PRELOAD_S
    return max(0.0, PRELOAD_S - ((time.monotonic() if now is None else now) - _started_at))


def cpu_seconds() -> float:
    """CPU seconds this process has used (run on a worker process: its share of a run)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
