"""The pure rules of prep.cluster: the auto choice of threads or processes, how processes start, items per task."""

from __future__ import annotations

from typing import Any

import pytest

from prep import processes
from prep.cluster import PROCESS_START_S, TASK_S, batch_size_for, choose_processes, task_batches, worker_mode


def test_auto_mode_threads_for_one_worker_few_items_or_no_probe() -> None:
    assert not choose_processes(1, 10_000, 0.5, cores=1)
    assert not choose_processes(1, 10_000, 0.5, cores=16)  # one process of 4 items does what 4 threads do
    assert not choose_processes(8, 8, 0.5, cores=8)
    assert not choose_processes(8, 10_000, None, cores=8)


def test_auto_mode_processes_once_they_repay_their_start() -> None:
    # volumes (GIL released): threads scale to ~4, so 8 processes win once the work outweighs their start
    assert not choose_processes(2, 1_000, 0.1, cores=2)  # 2 threads scale as 2 processes do, without the start
    assert not choose_processes(8, 10, 0.1, cores=8)  # 1 s of work: the start would not pay
    assert choose_processes(8, 1_000, 0.1, cores=8)
    # small Python-bound items: threads gain nothing, so 2 processes win on a long enough run
    assert choose_processes(2, 24_000, 0.002, cores=2)
    assert not choose_processes(2, 100, 0.002, cores=2)  # 0.2 s of work
    assert choose_processes(2, int(4 * PROCESS_START_S / 0.002), 0.002, cores=2)


def test_auto_mode_fills_the_cores_with_items_side_by_side() -> None:
    """Fewer workers than cores: each worker runs cores / workers items at once (at most 4); one process's
    threads stop gaining past ~4 items, so 4 workers on 16 cores are processes of 4 items each."""
    from prep.cluster import items_per_worker

    assert [items_per_worker(w, cores=16) for w in (1, 2, 4, 8, 16, 32)] == [4, 4, 4, 2, 1, 1]
    assert items_per_worker(1, cores=2) == 2 and items_per_worker(2, cores=2) == 1
    assert choose_processes(4, 1_000, 0.1, cores=16)  # 16 items at once against 4
    assert not choose_processes(4, 1_000, 0.1, cores=4)  # one core a worker: threads do as well


def test_items_per_task() -> None:
    assert batch_size_for(6, 1) == 1 and batch_size_for(6, 1, batch_size=4) == 4
    assert batch_size_for(10_000, 2) == 32  # volumes: at most 32 per task
    small = batch_size_for(24_000, 16, item_s=0.001)  # 2D images: ~8 tasks per worker, not 750 of 32
    assert small == 24_000 // (16 * 8) + 1 and small * 0.001 <= 2 * TASK_S
    assert batch_size_for(24_000, 2, item_s=0.001) == int(TASK_S / 0.001)  # capped at TASK_S of work


def test_the_last_items_go_one_a_task() -> None:
    todo = list(range(3, 20))
    batches = task_batches(todo, 3, singles=4)
    assert [i for b in batches for i in b] == todo  # every item once, in order
    assert batches[-4:] == [[16], [17], [18], [19]] and all(len(b) == 3 for b in batches[:-5])
    assert task_batches(todo, 3) == [todo[i : i + 3] for i in range(0, len(todo), 3)]
    assert task_batches(todo, 1, singles=4) == [[i] for i in todo]
    assert task_batches([1, 2], 5, singles=8) == [[1], [2]]


def _head(device: str) -> list[Any]:
    """Seed 000's head (MONAI's GDS notebook) with its EnsureTypeD on `device`."""
    import monai.transforms as mt

    keys = ("image", "label")
    return [
        mt.LoadImageD(keys=keys, image_only=True, ensure_channel_first=True),
        mt.EnsureTypeD(keys=keys, device=device),
        mt.SpacingD(keys=keys, pixdim=1.5),
    ]


def test_a_cuda_head_runs_on_threads_unless_processes_are_asked_for() -> None:
    """Seed 000's head initialises CUDA: threads (one CUDA context); processes only when asked."""
    head = _head("cuda:0")
    assert not worker_mode(8, 10_000, 0.1, head, cuda_initialized=False, forkserver_s=0)
    assert not worker_mode(8, 10_000, 0.1, head, cuda_initialized=True, forkserver_s=0)
    assert worker_mode(8, 10_000, 0.1, head, False, processes=True)


def test_cuda_initialised_here_means_threads_even_for_a_cpu_head() -> None:
    head = _head("cpu")
    assert worker_mode(8, 10_000, 0.1, head, cuda_initialized=False, forkserver_s=0)
    assert not worker_mode(8, 10_000, 0.1, head, cuda_initialized=True, forkserver_s=0)
    assert worker_mode(8, 10_000, 0.1, head, True, processes=True)
    assert not worker_mode(8, 10_000, 0.1, head, False, processes=False)


def test_the_start_counts_what_the_forkserver_has_left_to_import() -> None:
    """Processes start from a forkserver that imports torch and MONAI first (prep.processes): on a short run
    the auto rule weighs what is left of those imports."""
    head = _head("cpu")
    assert worker_mode(8, 100, 0.1, head, False, forkserver_s=0)  # 1 s of start against 2.5 s of threads
    assert not worker_mode(8, 100, 0.1, head, False, forkserver_s=processes.PRELOAD_S)
    assert choose_processes(8, 100, 0.1, start_s=PROCESS_START_S)
    assert not choose_processes(8, 100, 0.1, start_s=PROCESS_START_S + processes.PRELOAD_S)


def test_seconds_to_ready_counts_down_from_the_forkserver_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_started_at", None)
    assert processes.seconds_to_ready() == processes.PRELOAD_S
    monkeypatch.setattr(processes, "_started_at", 100.0)
    assert processes.seconds_to_ready(now=101.0) == processes.PRELOAD_S - 1.0
    assert processes.seconds_to_ready(now=100.0 + processes.PRELOAD_S + 5) == 0.0


def test_heads_side_by_side_stay_within_memory() -> None:
    """Items side by side only as far as memory allows (4x an item's decoded input bytes each), never fewer
    heads than workers; not measured: one a worker."""
    from prep.cluster import HEAD_PEAK_FACTOR, heads_at_once

    gib = 1 << 30
    assert heads_at_once(4, True, 100 << 20, 64 * gib, cores=16) == 4  # 4 processes x 4 items, room for all
    assert heads_at_once(1, False, 100 << 20, 64 * gib, cores=16) == 4  # one thread worker, 4 items
    assert heads_at_once(4, False, 100 << 20, 64 * gib, cores=16) == 16
    big = 2 * gib  # 8 GiB at its peak
    assert heads_at_once(1, False, big, 20 * gib, cores=16) == 20 // (HEAD_PEAK_FACTOR * 2)  # 2 fit, not 4
    assert heads_at_once(4, True, big, 20 * gib, cores=16) == 1  # each process keeps one
    assert heads_at_once(4, False, big, 4 * gib, cores=16) == 4  # one per worker even short of memory, as before
    assert heads_at_once(2, False, None, 64 * gib, cores=16) == 2 and heads_at_once(2, True, None, 64 * gib) == 1
