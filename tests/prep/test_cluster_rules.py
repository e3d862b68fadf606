"""The pure rules of prep.cluster: the auto choice of threads or processes, and items per task."""

from __future__ import annotations

from prep.cluster import PROCESS_START_S, TASK_S, batch_size_for, choose_processes


def test_auto_mode_threads_for_one_worker_few_items_or_no_probe() -> None:
    assert not choose_processes(1, 10_000, 0.5)
    assert not choose_processes(8, 8, 0.5)
    assert not choose_processes(8, 10_000, None)


def test_auto_mode_processes_once_they_repay_their_start() -> None:
    # volumes (GIL released): threads scale to ~4, so 8 processes win once the work outweighs their start
    assert not choose_processes(2, 1_000, 0.1)  # 2 threads scale as 2 processes do, without the start
    assert not choose_processes(8, 10, 0.1)  # 1 s of work: the start would not pay
    assert choose_processes(8, 1_000, 0.1)
    # small Python-bound items: threads gain nothing, so 2 processes win on a long enough run
    assert choose_processes(2, 24_000, 0.002)
    assert not choose_processes(2, 100, 0.002)  # 0.2 s of work
    assert choose_processes(2, int(4 * PROCESS_START_S / 0.002), 0.002)


def test_items_per_task() -> None:
    assert batch_size_for(6, 1) == 1 and batch_size_for(6, 1, batch_size=4) == 4
    assert batch_size_for(10_000, 2) == 32  # volumes: at most 32 per task
    small = batch_size_for(24_000, 16, item_s=0.001)  # 2D images: ~8 tasks per worker, not 750 of 32
    assert small == 24_000 // (16 * 8) + 1 and small * 0.001 <= 2 * TASK_S
    assert batch_size_for(24_000, 2, item_s=0.001) == int(TASK_S / 0.001)  # capped at TASK_S of work
