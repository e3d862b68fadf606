"""prep.finish: a task's last commit after the task returns; the run's end waits for it; errors are raised."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from cacheutil import SPHERES

from loaders.cache.spec import JOURNAL_DIR
from prep import finish, worker
from prep.cache import load_datalist
from prep.journal import read_journals
from prep.pipeline import load_pipeline


def _spec(out: Path) -> worker.TaskSpec:
    pipe = load_pipeline(SPHERES)
    return worker.TaskSpec(str(out), str(pipe.path), None, pipe.fingerprint, 1 << 30, "test", torch_threads=1)


def test_wait_commits_waits_for_every_ending_and_raises_the_first_error() -> None:
    gate = threading.Event()
    done: list[int] = []

    def ending(n: int) -> None:
        gate.wait(10)
        done.append(n)

    def broken() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    finish.finish_later(ending, 1)
    finish.finish_later(ending, 2)
    assert done == []  # the caller went on while the endings wait
    gate.set()
    assert finish.wait_commits() == 2 and sorted(done) == [1, 2]
    finish.finish_later(broken)
    with pytest.raises(OSError, match="No space"):
        finish.wait_commits()
    finish.finish_later(broken)
    for _ in range(1000):  # a failed ending is raised by the process's next task (raise_failed) too
        try:
            finish.raise_failed()
        except OSError:
            break
        threading.Event().wait(0.01)
    else:
        pytest.fail("raise_failed never raised the failed ending's error")
    assert finish.wait_commits() == 0


def test_a_task_committing_later_is_durable_after_wait_commits(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    (out / JOURNAL_DIR).mkdir(parents=True)
    items = [(i, entry, section) for i, (section, entry) in enumerate(load_datalist(nifti_dataset)[:3])]
    fds = len(os.listdir("/proc/self/fd"))
    threads = torch.get_num_threads()
    try:
        statuses = worker.run_batch(_spec(out), 3, items, commit_later=True)
    finally:
        torch.set_num_threads(threads)
    assert [s["item"] for s in statuses] == [0, 1, 2]
    assert finish.wait_commits() == 1
    state = read_journals(out)
    assert sorted(state.done) == [0, 1, 2]
    assert len(os.listdir("/proc/self/fd")) <= fds  # the ending closed the task's shard and journal


def test_a_failed_last_commit_is_raised_and_never_journals(
    tmp_path: Path, nifti_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cache"
    (out / JOURNAL_DIR).mkdir(parents=True)
    items = [(i, entry, section) for i, (section, entry) in enumerate(load_datalist(nifti_dataset)[:2])]
    real = os.fsync

    def full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(worker, "COMMIT_INTERVAL_S", 3600.0)
    monkeypatch.setattr(os, "fsync", full)
    threads = torch.get_num_threads()
    try:
        worker.run_batch(_spec(out), 4, items, commit_later=True)
        with pytest.raises(OSError, match="No space"):
            finish.wait_commits()
    finally:
        torch.set_num_threads(threads)
    assert read_journals(out).done == {}  # the shard was never durable: no line vouches for it


def _fails_late(gate: threading.Event) -> None:
    gate.wait(10)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_run_that_fails_leaves_no_ending_to_fail_the_next_run_in_this_process() -> None:
    """A run stopped by a full disk may leave endings still running (a task that was going on beside the one
    that failed); closing its cluster waits for them. Left pending, an ending that failed late was raised by
    the next run's first task: a re-run after freeing space said "no space left" again (seen in CI)."""
    from prep.cluster import ClusterStarter

    gate = threading.Event()
    with ClusterStarter(1, None, processes=False) as starter:
        starter.client()
        finish.finish_later(_fails_late, gate)
        threading.Timer(0.2, gate.set).start()  # fails after the close has begun
    assert finish.wait_commits() == 0  # nothing pending: the next run starts clean
    finish.raise_failed()
