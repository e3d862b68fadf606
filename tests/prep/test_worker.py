"""prep.worker: group commit order (shard fsync before journal lines), per-thread heads, torch threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cacheutil import REPO, SPHERES

from loaders.cache.format import PreparedCache
from loaders.cache.spec import JOURNAL_DIR
from prep import worker
from prep.cache import load_datalist, prepare_cache
from prep.journal import read_journals
from prep.pipeline import load_pipeline


def _spec(out: Path) -> worker.TaskSpec:
    pipe = load_pipeline(SPHERES)
    return worker.TaskSpec(str(out), str(pipe.path), None, pipe.fingerprint, 1 << 30, "test", torch_threads=1)


def _fsync_log(monkeypatch: pytest.MonkeyPatch, journal: Path) -> list[tuple[str, int]]:
    """Record every fsync of a shard or of `journal`: (kind, journal lines on disk at that moment)."""
    log: list[tuple[str, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        lines = journal.read_bytes().count(b"\n") if journal.exists() else 0
        if target.endswith(".bin"):
            log.append(("shard", lines))
        elif target == str(journal):
            log.append(("journal", lines))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return log


@pytest.mark.parametrize("interval, groups", [(3600.0, {1}), (0.0, {2, 3})])
def test_group_commit_fsyncs_shard_before_journal_lines(
    tmp_path: Path, nifti_dataset: Path, monkeypatch: pytest.MonkeyPatch, interval: float, groups: set[int]
) -> None:
    out = tmp_path / "cache"
    (out / JOURNAL_DIR).mkdir(parents=True)
    items = [(i, entry, section) for i, (section, entry) in enumerate(load_datalist(nifti_dataset)[:3])]
    monkeypatch.setattr(worker, "COMMIT_INTERVAL_S", interval)
    monkeypatch.setattr(worker.uuid, "uuid4", lambda: type("U", (), {"hex": "0" * 32})())
    journal = out / JOURNAL_DIR / "000007-test-00000000.jsonl"
    log = _fsync_log(monkeypatch, journal)
    import torch

    threads = torch.get_num_threads()
    try:
        statuses = worker.run_batch(_spec(out), 7, items)
    finally:  # a worker sets its process's torch threads; this test runs it in pytest's own process
        torch.set_num_threads(threads)
    assert [s["item"] for s in statuses] == [0, 1, 2] and not any(s["quarantined"] for s in statuses)
    commits = [n for n, (kind, lines) in enumerate(log) if kind == "journal" and lines > 0]
    # one journal fsync per group of items, not per item (interval 0: a group per item, unless items finish
    # while the commit thread is still busy with the previous group; they then join the next group)
    assert len(commits) in groups
    done = 0
    for n in commits:  # before each group's lines reach the journal, the shard holding them was fsynced
        lines = log[n][1]
        assert ("shard", done) in log[:n], log
        done = lines
    assert done == 3


def test_heads_are_per_thread(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    heads: list[Any] = []
    threads = [threading.Thread(target=lambda: heads.extend([worker._head(spec), worker._head(spec)])) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert heads[0] is heads[1] and heads[2] is heads[3]  # cached within a thread
    assert heads[0] is not heads[2]  # never shared between threads (MONAI transforms may keep state)


def test_worker_threads_bit_exact_and_torch_threads_restored(tmp_path: Path, nifti_dataset: Path) -> None:
    before = torch.get_num_threads()
    summary = prepare_cache(nifti_dataset, SPHERES, tmp_path / "cache", workers=2, batch_size=1)
    assert summary.n_items == 6 and torch.get_num_threads() == before
    assert summary.item_cpu_s > 0  # every item's own CPU came back with its status, the probe's items' too
    cache = PreparedCache(tmp_path / "cache")
    head = load_pipeline(SPHERES).head_compose()  # this thread, torch's default threads
    for item, (_, entry) in enumerate(load_datalist(nifti_dataset)):
        expected = head(dict(entry))
        for e in cache.entries(item):
            with open(e.shard, "rb") as f:
                f.seek(e.offset)
                got = np.frombuffer(f.read(e.nbytes), dtype=e.dtype).reshape(e.shape)
            assert np.array_equal(got, expected[e.key].as_tensor().numpy())


def test_local_cluster_is_one_in_process_worker_of_n_threads_without_memory_pause() -> None:
    from prep.cluster import ClusterStarter, items_per_worker, local_cores, torch_threads_for

    with ClusterStarter(3, None, processes=False) as starter:
        workers = starter.client().scheduler_info()["workers"].values()
        assert [(w["nthreads"], w["memory_limit"]) for w in workers] == [(3 * items_per_worker(3), 0)]
    # threads and processes alike: cores / workers torch threads (the caller's own at one worker) ...
    assert torch_threads_for(3, None) == max(1, local_cores() // 3) and torch_threads_for(3, "tcp://x:1") == 0
    # ... and cores / workers items side by side, at most 4 (idle cores at W < cores otherwise)
    per = items_per_worker(3)
    assert per == max(1, min(4, local_cores() // 3))
    assert torch_threads_for(3, None, processes=True) == max(1, local_cores() // 3)
    assert items_per_worker(1) == min(4, local_cores()) and items_per_worker(64 * local_cores()) == 1
    assert torch_threads_for(10 * local_cores(), None, processes=True) == 1


def _malloc_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("MALLOC_TRIM_THRESHOLD_", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}


def test_worker_processes_spawn_without_dask_malloc_trim_and_with_passive_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    """dask's default MALLOC_TRIM_THRESHOLD_ makes every tensor a fresh mmap (page faults, system time)."""
    from prep.cluster import ClusterStarter, local_cores

    for key in ("MALLOC_TRIM_THRESHOLD_", "OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)  # set by a worker restarted earlier in this session
    with ClusterStarter(1, None, processes=True) as starter:
        env = next(iter(starter.client().run(_malloc_env).values()))
        assert _malloc_env() == dict.fromkeys(env)  # the nanny's writes into this process's environment undone
    # one worker process: all the cores as its OMP threads
    assert env == {"MALLOC_TRIM_THRESHOLD_": None, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(local_cores())}


def _worker_origin() -> tuple[bool, bool, int]:
    import sys

    return "torch" in sys.modules, "monai.transforms" in sys.modules, os.getppid()


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_worker_processes_come_from_a_forkserver_with_torch_and_monai_imported() -> None:
    """Workers are forked by one forkserver (prep.processes), never by this multi-threaded process; it has
    imported torch and MONAI, so a worker imports neither (spawned workers: ~4.7 CPU s each on the 2-core
    box), and it runs in the workers' environment (libgomp reads OMP_* where torch is loaded: there).
    Workers ignore SIGINT (a terminal's Ctrl-C reaches the process group: prep cache stops them itself)."""
    import signal

    from prep.cluster import ClusterStarter

    with ClusterStarter(2, None, processes=True) as starter:  # no pipeline: nothing warms the workers
        origins = list(starter.client().run(_worker_origin).values())
        handlers = set(starter.client().run(signal.getsignal, signal.SIGINT).values())
    assert len(origins) == 2 and all(torch and monai for torch, monai, _ in origins), origins
    parents = {ppid for _, _, ppid in origins}
    assert len(parents) == 1 and os.getpid() not in parents and len(starter.pids) == 2
    server = _environ_of(parents.pop())
    assert "OMP_WAIT_POLICY" in server and "OMP_NUM_THREADS" in server, sorted(server)
    assert server.get("MALLOC_TRIM_THRESHOLD_") == os.environ.get("MALLOC_TRIM_THRESHOLD_")  # not dask's default
    assert handlers == {signal.SIG_IGN} and starter.worker_cpu_s > 0


def _profiling(dask_worker: Any) -> bool:
    return "profile" in dask_worker.periodic_callbacks


@pytest.mark.parametrize("processes", [False, True])
def test_local_workers_run_without_dask_profiler(processes: bool) -> None:
    """dask's profiler samples every worker thread's stack each 10 ms (CPU taken from the head)."""
    import dask

    from prep.cluster import ClusterStarter

    with ClusterStarter(2, None, processes=processes) as starter:
        assert set(starter.client().run(_profiling).values()) == {False}
    assert dask.config.get("distributed.worker.profile.enabled")  # the caller's dask config is left as it was


def test_forkserver_workers_warm_the_pipeline_and_prepare(nifti_dataset: Path, tmp_path: Path) -> None:
    from prep.cluster import ClusterStarter, run_tasks

    items = load_datalist(nifti_dataset)
    (tmp_path / JOURNAL_DIR).mkdir()
    with ClusterStarter(2, None, processes=True, pipeline=SPHERES) as starter:
        client = starter.client()
        run_tasks(client, _spec(tmp_path), items, list(range(len(items))), 3, pids=starter.pids)
    state = read_journals(tmp_path)
    assert sorted(state.done) == list(range(len(items))) and not state.quarantined
    assert 0 < starter.start_cpu_s < starter.worker_cpu_s  # started and warm, then the tasks' CPU on top


class _InterruptsInDel:
    """Ctrl-C arriving while the main thread runs a `__del__`: Python prints the KeyboardInterrupt and goes on."""

    def __del__(self) -> None:
        import signal

        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        for _ in range(10_000):  # the handler runs here, inside __del__
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt, on purpose
def test_ctrl_c_swallowed_by_a_del_still_stops_the_run(nifti_dataset: Path, tmp_path: Path) -> None:
    from prep.cluster import ClusterStarter, interrupt_scope, run_tasks

    items = load_datalist(nifti_dataset)
    (tmp_path / JOURNAL_DIR).mkdir()
    sunk: list[int] = []

    def sink(statuses: list[dict[str, Any]]) -> None:
        sunk.append(len(statuses))
        if len(sunk) == 1:
            _InterruptsInDel()  # made and dropped at once: its __del__ runs here, on the main thread

    with interrupt_scope(), ClusterStarter(1, None, processes=False) as starter, pytest.raises(KeyboardInterrupt):
        run_tasks(starter.client(), _spec(tmp_path), items, list(range(len(items))), 1, sink=sink)
    assert sunk[0] == 1
    # the next run in this process (a notebook's next cell) prepares: the stop asked of the first is not kept
    again = prepare_cache(nifti_dataset, SPHERES, tmp_path / "again", workers=1, processes=False)
    assert again.n_items == len(items)


_AT_ONCE = {"now": 0, "most": 0}
_AT_ONCE_LOCK = threading.Lock()


def _counted(x: Any) -> Any:
    """A head step that notes how many heads run at once in this process (the test's thread workers)."""
    import time

    with _AT_ONCE_LOCK:
        _AT_ONCE["now"] += 1
        _AT_ONCE["most"] = max(_AT_ONCE["most"], _AT_ONCE["now"])
    time.sleep(0.05)
    with _AT_ONCE_LOCK:
        _AT_ONCE["now"] -= 1
    return x


@pytest.mark.parametrize("heads", [1, 2])
def test_heads_at_once_bound_the_items_side_by_side(
    nifti_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: int
) -> None:
    """prep cache's bound on heads running at once in a process (memory: prep.cluster.heads_at_once) holds
    whatever threads dask has: 2 item threads here, heads=1 lets one head run at a time."""
    import prep.cache
    import prep.cluster
    from prep.cache import prepare_cache

    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Lambdad\n"
        "from test_worker import _counted\n"
        "transform = Compose([LoadImaged(keys=['image', 'label']), EnsureChannelFirstd(keys=['image', 'label']),\n"
        "                     Lambdad(keys='image', func=_counted)])\n"
    )
    monkeypatch.setattr(prep.cache, "heads_at_once", lambda *a, **k: heads)
    monkeypatch.setattr(prep.cache, "items_per_worker", lambda w: 2)
    monkeypatch.setattr(prep.cluster, "items_per_worker", lambda w, cores=None: 2)
    _AT_ONCE.update(now=0, most=0)
    summary = prepare_cache(nifti_dataset, pipeline, tmp_path / "cache", workers=1, processes=False, batch_size=1)
    assert summary.n_items == 6 and not summary.quarantined
    assert _AT_ONCE["most"] == heads  # 2: the two item threads do overlap; 1: the bound holds them apart


class _WaitsForTheStart:
    """A reference cycle whose finalizer waits for the cluster's start thread: gc runs it inside a full collection,
    with the GIL released, while that thread starts dask's scheduler and worker."""

    def __init__(self, thread: Any) -> None:
        self.thread = thread
        self.cycle = self

    def __del__(self) -> None:
        self.thread.join(timeout=60)


def test_cluster_started_during_a_full_collection_leaves_no_gc_callback_error() -> None:
    """dask's scheduler and worker add a gc callback when they start (distributed.gc): added on the start thread
    while the main thread is inside a full collection, it saw the collection's end without its start and raised
    AssertionError from inside gc (a failure that came and went with the timing)."""
    import gc

    from prep.cluster import ClusterStarter

    errors: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, errors.append
    try:
        with ClusterStarter(1, None, processes=False) as starter:
            _WaitsForTheStart(starter._thread)
            gc.collect()  # full: the finalizer runs between the collection's start and stop callbacks
            assert not starter._thread.is_alive() and starter.client() is not None
    finally:
        sys.unraisablehook = hook
    assert [repr(e.exc_value) for e in errors] == []


FORKSERVER_FIRST = """
import multiprocessing, sys

from prep.cluster import ClusterStarter

def origin():
    return "torch" in sys.modules and "monai.transforms" in sys.modules

if __name__ == "__main__":
    with multiprocessing.get_context("forkserver").Pool(1) as pool:  # a DataLoader's forkserver workers, say
        pool.map(abs, [1])
    with ClusterStarter(1, None, processes=True) as starter:
        print(list(starter.client().run(origin).values()))
"""


def test_a_forkserver_started_for_something_else_is_replaced_by_the_preloaded_one(tmp_path: Path) -> None:
    """A forkserver the process started before (without the preload or the workers' environment) is stopped:
    the workers still come from one that imported torch and MONAI."""
    script = tmp_path / "first.py"
    script.write_text(FORKSERVER_FIRST)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[True]", done.stdout
