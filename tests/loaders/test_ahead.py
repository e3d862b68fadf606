"""loaders.reading.ahead.InOrder: results in the order the jobs were started, errors raised where they are
taken, and a stage closed from one of its own threads (the garbage collector finalizing an abandoned loader
there) that drops its jobs instead of waiting for itself."""

from __future__ import annotations

import threading
import time

import pytest

from loaders.reading.ahead import InOrder


def test_results_come_in_order_and_errors_where_taken() -> None:
    with InOrder(3, "t") as ahead:
        for k in range(6):
            ahead.submit(lambda k=k: time.sleep(0.01 * (6 - k)) or k)
        assert [ahead.take() for _ in range(6)] == list(range(6))
        ahead.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            ahead.take()


def test_closed_from_its_own_thread_it_does_not_wait_for_itself() -> None:
    ahead = InOrder(1, "t")
    go, done = threading.Event(), threading.Event()

    def job() -> int:
        go.wait(10)
        ahead.close()  # what a finalizer of the stage's owner does when a collection runs on this thread
        done.set()
        return 1

    ahead.submit(job)
    ahead.submit(time.sleep, 30)  # not started: cancelled, never run
    go.set()
    assert done.wait(10), "the stage waited for the job that closed it"
    assert len(ahead) == 0


def test_clear_waits_for_running_jobs_from_another_thread() -> None:
    ahead = InOrder(1, "t")
    ran: list[int] = []
    ahead.submit(lambda: time.sleep(0.2) or ran.append(1))
    time.sleep(0.05)
    ahead.clear()
    assert ran == [1]
    ahead.close()


def test_closed_from_the_thread_its_running_job_waits_for_it_does_not_wait() -> None:
    """The loader's two stages: the tail's job takes its batch's read; a collection on the read thread that
    finalizes the abandoned loader closes the tail stage, whose running job waits for that very thread."""
    reads, tails = InOrder(1, "read"), InOrder(1, "tail")
    started, done = threading.Event(), threading.Event()

    def read() -> int:
        started.wait(10)
        tails.close()  # the loader's finalizer, run by a collection on the read thread
        done.set()
        return 1

    reads.submit(read)
    tails.submit(lambda: started.set() or reads.take())  # the tail job waits for the read
    assert done.wait(10), "the tail stage waited for its job, which waited for the thread closing it"
    reads.close()
