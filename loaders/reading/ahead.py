"""The one prefetch stage: jobs started ahead on a few threads and their results taken in the order they were
started. The loader's batches (one thread: its random draws stay in batch order), `PreparedBatches`' reads
(`prefetch` threads) and the tail's draws made ahead all run through it.

    ahead = InOrder(threads=1, name="blockprep-feed")
    ahead.submit(make, 0); ahead.submit(make, 1)
    first = ahead.take()         # make(0)'s result, or its exception raised here
    ahead.close()                # jobs not started are dropped; the running one is waited for
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["InOrder"]

# every thread that has run a job of any stage: a stage's job may wait for another stage's (the loader's tail
# thread takes its batch's read), so a wait from any of them, for any stage, may wait for itself
_WORKERS: set[int] = set()


class InOrder:
    """Jobs on `threads` threads (named `name`), taken in the order they were submitted. With one thread they
    also run in that order. A job's exception is raised by the `take` that reaches it. `executor`: a pool to
    share (not closed here) instead of one of its own."""

    def __init__(self, threads: int = 1, name: str = "blockprep-ahead", executor: ThreadPoolExecutor | None = None):
        self._own = executor is None
        self._pool = executor if executor is not None else ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)
        self._pending: deque[Future[Any]] = deque()

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        """Start `job(*args)` after the jobs submitted before it."""
        self._pending.append(self._pool.submit(self._run, job, args))

    def _run(self, job: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        _WORKERS.add(threading.get_ident())
        return job(*args)

    def _on_worker(self) -> bool:
        """Whether this thread runs jobs of a stage, this one's or another's (a job, or a collection a job's
        allocation ran, that ends an owner: the garbage collector may finalize an abandoned loader on any thread,
        and its read stage's thread may be the one the tail stage's running job waits for)."""
        return threading.get_ident() in _WORKERS

    def take(self) -> Any:
        """The oldest job's result, waited for (its exception raised here)."""
        return self._pending.popleft().result()

    def __len__(self) -> int:
        """Jobs submitted and not taken."""
        return len(self._pending)

    def forget(self) -> None:
        """Drop every job not taken without waiting: those not started are cancelled, the running ones finish
        on their own (jobs whose results nothing else shares)."""
        while self._pending:
            self._pending.pop().cancel()

    def clear(self) -> None:
        """Drop every job not taken: those not started are cancelled, the running ones waited for (not from
        a thread of any stage, which may be what they wait for: `forget` there)."""
        if self._on_worker():
            self.forget()
            return
        while self._pending:
            future = self._pending.pop()
            if not future.cancel():
                future.exception()  # waited for; a dropped job's error is nobody's (its result is unused)

    def close(self, wait: bool = True) -> None:
        """`clear`, then the threads stopped (a shared executor stays); without `wait`, `forget` and the threads
        left to end after their running job (from a finalizer, which may run on any thread)."""
        if not wait:
            self.forget()
        else:
            self.clear()
        if self._own:
            self._pool.shutdown(wait=wait and not self._on_worker())

    def __enter__(self) -> InOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
