"""A task's last commit, after the task has returned: the worker goes on to its next task meanwhile.

A `prep cache` task ends by making its last items durable: fsync its shard, append and fsync its journal
lines, close both (`prep.worker._commit_group`). The worker waited for those fsyncs before its next task
(docs/benchmarks.md, Preparation). Here a task hands that ending to
this process's finishing threads and returns; the run's end (and a Ctrl-C) waits for every ending through
`wait_commits` before the journals are read, so a journal line is still never on disk before its bytes, and
the cache is committed only from what the journals say. A process that dies with endings pending loses
those items' lines, as a crash always could: the next run prepares them again. An ending's error (a full
disk) is raised by the process's next task and by `wait_commits`; a run stopped by an error drops the errors
of endings still pending once its cluster closed (`settle_commits`). Only local clusters' tasks end this way
(`prep.cluster.run_tasks`): a remote worker lost after its task returned would lose items dask counts as done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

MAX_PENDING = 16  # endings not done before a task waits for the oldest (each holds a shard and a journal open)
_lock = threading.Lock()
_pool: list[ThreadPoolExecutor] = []
_pending: list[Future[None]] = []


def finish_later(ending: Callable[..., None], *args: Any) -> None:
    """Run `ending(*args)` on this process's finishing threads; then wait while too many are pending (their
    errors are raised by `raise_failed` and `wait_commits`)."""
    with _lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(8, thread_name_prefix="blockprep-finish"))
        _pending.append(_pool[0].submit(ending, *args))
        running = [f for f in _pending if not f.done()]
    for future in running[: max(0, len(running) - MAX_PENDING)]:
        future.exception()  # waits; an error is raised by raise_failed or wait_commits


def raise_failed() -> None:
    """Re-raise the error of an ending that failed (and forget the ones that succeeded)."""
    with _lock:
        done = [f for f in _pending if f.done()]
        for f in done:
            _pending.remove(f)
    for f in done:
        f.result()


def wait_commits() -> int:
    """Wait for every pending ending of this process; re-raise the first error. Returns how many there were."""
    pending = _settle()
    for f in pending:
        f.result()
    return len(pending)


def settle_commits() -> None:
    """Wait for every pending ending of this process and forget their errors: how a run stopped by an error
    ends (after its cluster closed, so no task adds more). An ending that failed journaled nothing, so the next
    run prepares its items; left pending, its error would stop that run's first task (`raise_failed`)."""
    _settle()


def _settle() -> list[Future[None]]:
    """Take every pending ending of this process and wait for each (errors kept in their futures)."""
    with _lock:
        pending = _pending[:]
        _pending.clear()
    for f in pending:
        f.exception()
    return pending
