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


class InOrder:
    """Jobs on `threads` threads (named `name`), taken in the order they were submitted. With one thread they
    also run in that order. A job's exception is raised by the `take` that reaches it. `executor`: a pool to
    share (not closed here) instead of one of its own."""

    def __init__(self, threads: int = 1, name: str = "blockprep-ahead", executor: ThreadPoolExecutor | None = None):
        self._own = executor is None
        self._pool = executor if executor is not None else ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)
        self._pending: deque[Future[Any]] = deque()
        self._workers: set[int] = set()  # the threads that ran this stage's jobs

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        """Start `job(*args)` after the jobs submitted before it."""
        self._pending.append(self._pool.submit(self._run, job, args))

    def _run(self, job: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._workers.add(threading.get_ident())
        return job(*args)

    def _on_worker(self) -> bool:
        """Whether this thread is one of the stage's own (a job, or a collection a job's allocation ran, that
        ends its owner: the garbage collector may finalize an abandoned loader on any thread)."""
        return threading.get_ident() in self._workers

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
        one of the stage's own threads, which would wait for itself: `forget` there)."""
        if self._on_worker():
            self.forget()
            return
        while self._pending:
            future = self._pending.pop()
            if not future.cancel():
                future.exception()  # waited for; a dropped job's error is nobody's (its result is unused)

    def close(self) -> None:
        """`clear`, then the threads stopped (a shared executor stays)."""
        self.clear()
        if self._own:
            self._pool.shutdown(wait=not self._on_worker())

    def __enter__(self) -> InOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
