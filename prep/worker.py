"""What one dask task of `prep cache` does: run the deterministic head on a batch of items and write them.

Each task run writes its own shard file(s) and its own journal, both named with a fresh token, so a task
re-run after a crash never overwrites bytes that an earlier journal vouches for. Items are committed in
groups (about COMMIT_INTERVAL_S apart, on a thread while the next items compute, and at the end of the
task): fsync the group's shards, then append its journal lines and fsync the journal. A line is thus never
on disk before the bytes it describes; a crash loses at most the items not yet committed, which the next
run prepares again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.cache.journals import JournalWriter, write_tensors
from loaders.cache.meta import meta_line, split_output
from loaders.cache.spec import JOURNAL_DIR, SHARD_DIR, align_up
from loaders.cache.writing import ShardWriter
from prep.errors import StaleError
from prep.finish import finish_later, raise_failed
from prep.grids import shared_grids
from prep.inflated import served
from prep.outdirs import Ids, OutputDirs
from prep.pipeline import Pipeline, load_pipeline
from prep.quarantine import check_entry, input_paths, input_stats

_PREALLOC_MAX = 256 << 20
COMMIT_INTERVAL_S = 1.0  # group commit: one shard + journal fsync pair per second per writer, not per item
_lock = threading.Lock()
_pipelines: dict[tuple[str, str | None, str], tuple[Pipeline, Any]] = {}
# one head per thread: MONAI transforms may keep state between calls, so threads never share instances
_local = threading.local()
# set on Ctrl-C: every task of this process stops after its current item and commits what it finished
_stop = threading.Event()


def request_stop() -> None:
    """Make this process's running tasks stop after their current item (their finished items are committed)."""
    _stop.set()


def clear_stop() -> None:
    """Let tasks run again (a new `prep cache` run in the same process)."""
    _stop.clear()


def ignore_sigint() -> int:
    """In a local worker process (on its main thread): leave Ctrl-C to `prep cache`, which stops the tasks and
    closes the cluster; a terminal sends SIGINT to the whole process group. Returns the process id."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return os.getpid()


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, picklable: where to write and which pipeline (by path) to run."""

    output: str
    pipeline: str
    bundle_key: str | None
    fingerprint: str
    shard_size: int
    run_id: str
    torch_threads: int = 0  # intra-op threads per task (cores / concurrent tasks); 0: leave the worker's setting
    max_item_bytes: int | None = None  # an input whose header declares more is quarantined before decoding
    heads: int = 0  # heads a worker process runs at once (memory: prep.cluster.heads_at_once); 0: no bound
    sets: dict[str, Any] | None = None  # the tail's label-driven crop signature: its sampling sets made here too
    dirs: Ids = ()  # the output's folders as the run opened them: a task refuses one swapped since (prep.outdirs)


_SLOTS: dict[int, threading.BoundedSemaphore] = {}  # heads at once in this process, by bound
_SLOTS_LOCK = threading.Lock()


def _head_slots(n: int) -> Any:
    """The process-wide bound on heads running at once (a null context for 0)."""
    if n <= 0:
        return contextlib.nullcontext()
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(n, threading.BoundedSemaphore(n))


def _head(spec: TaskSpec) -> Any:
    """The head Compose, loaded once per worker process (copied once per thread); refuses a pipeline that
    changed since planning."""
    # keyed by fingerprint too: a long-lived cluster (--scheduler) may serve runs of an edited pipeline
    key = (spec.pipeline, spec.bundle_key, spec.fingerprint)
    heads = _local.__dict__.setdefault("heads", {})
    if key in heads:
        return heads[key]
    with _lock:
        if key not in _pipelines:
            pipe = load_pipeline(spec.pipeline, spec.bundle_key)
            _pipelines[key] = (pipe, pipe.head_compose())
        pipe, head = _pipelines[key]
        head = copy.deepcopy(head)
    if pipe.fingerprint != spec.fingerprint:
        raise StaleError(
            f"{spec.pipeline}: the pipeline on this worker differs from the one planned (edited during the run, "
            "or other library versions on this worker); re-run `prep cache`"
        )
    heads[key] = head
    return head


def set_torch_threads(n: int) -> None:
    """Give torch `n` intra-op threads (no-op for 0): cores / concurrent tasks, so cores are never oversubscribed."""
    if n > 0:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


_torch_warm = threading.Lock()
_torch_warmed = False


def warm_torch() -> None:
    """Run torch's lazy numpy initialisation once in this process, before task threads race to it.

    torch 2.3 initialises numpy support inside a C++ function-local static, holding the GIL, and that
    initialiser imports a Python module (letting go of the GIL): a second thread making its first numpy<->tensor
    conversion meanwhile blocks on the static's guard while holding the GIL, and both threads stop for good.
    Call it on the process's main thread ahead of the workers (it is also called first by every task, under a
    lock that waits without the GIL, for workers nobody warmed).
    """
    global _torch_warmed
    if _torch_warmed:
        return
    with _torch_warm:
        if not _torch_warmed:
            import numpy as np
            import torch

            torch.as_tensor(np.zeros(1, np.float32)).numpy()
            _torch_warmed = True


def warm(pipeline: str, bundle_key: str | None, found: dict[str, list[str]] | None = None) -> str:
    """Load a pipeline into this worker's cache ahead of its tasks (unless this process has it: forked from
    `prep cache`, which did, see `keep_pipeline`); returns its fingerprint. `found`: what `prep cache`'s own
    process found of the transforms' classes (`loaders.cache.chain.runtime_attrs_found`; local worker processes)."""
    warm_torch()
    if found:
        from loaders.cache.chain import take_runtime_attrs

        take_runtime_attrs(found)
    with _lock:
        known = [key[2] for key in _pipelines if key[:2] == (pipeline, bundle_key)]
    if known:
        return known[-1]
    pipe = load_pipeline(pipeline, bundle_key)
    keep_pipeline(pipe)
    return pipe.fingerprint


def keep_pipeline(pipe: Pipeline) -> None:
    """Hand a pipeline loaded by this process to its tasks (in-process threads, and worker processes forked
    from it afterwards), so they do not load and fingerprint it again."""
    with _lock:
        # a copy: the caller may go on calling its own transforms (prep cache times the head on one item)
        _pipelines.setdefault(
            (str(pipe.path), pipe.bundle_key, pipe.fingerprint), (pipe, copy.deepcopy(pipe.head_compose()))
        )


class _Shards:
    """The shard files of one task run: a new file whenever the current one reaches shard_size."""

    def __init__(self, root: Path, name: str, shard_size: int, dir_fd: int) -> None:
        self.root, self.name, self.shard_size, self.dir_fd = root, name, shard_size, dir_fd
        self.count = 0
        self.writer: ShardWriter | None = None
        self.rel = ""
        self.left = 0  # bytes this task is still expected to write (0 until one item is written)

    def _prealloc(self) -> int:
        """Reserve ahead no more than this task has left to write (never 256 MiB for a 1 MB remainder)."""
        return max(0, min(self.shard_size, _PREALLOC_MAX, self.left))

    def expect(self, left: int) -> None:
        """Tell the writer how many bytes this task still expects to write."""
        self.left = left
        if self.writer is not None:
            self.writer.prealloc = self._prealloc()

    def current(self) -> ShardWriter:
        if self.writer is None or self.writer.size >= self.shard_size:
            self.close()
            self.rel = f"{SHARD_DIR}/shard-{self.name}-{self.count:03d}.bin"
            self.count += 1
            self.writer = ShardWriter(self.root / self.rel, prealloc=self._prealloc(), dir_fd=self.dir_fd)
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def run_batch(
    spec: TaskSpec, batch: int, items: list[tuple[int, dict[str, Any], str]], commit_later: bool = False
) -> list[dict[str, Any]]:
    """Prepare (item number, resolved entry, section) triples; returns one small status dict per item.
    `commit_later`: the task's last commit runs after it returns (`prep.finish`; the caller then waits for
    `wait_commits` before reading the journals), else before."""
    _quiet_disk_full()
    raise_failed()  # an earlier task's last commit that failed (a full disk) stops this one
    warm_torch()
    set_torch_threads(spec.torch_threads)
    head = _head(spec)
    name = f"{batch:06d}-{spec.run_id}-{uuid.uuid4().hex[:8]}"
    dirs, shards, journal = _open_task(spec, name)
    pending: list[dict[str, Any]] = []
    statuses: list[dict[str, Any]] = []
    # commits run on a thread, one at a time, so the head goes on computing while the disk writes back
    committer = ThreadPoolExecutor(1, thread_name_prefix="blockprep-commit")
    inflight: list[Future[None]] = []
    ending = False
    try:
        _run_items(spec, head, shards, items, journal, committer, pending, statuses, inflight)
        ending = True
    finally:
        if not ending:  # an error: close what this task opened, commit nothing more
            _close_task(committer, shards, journal, dirs)
    if commit_later:
        finish_later(_end_task, dirs, journal, pending, inflight, committer, shards)
    else:
        _end_task(dirs, journal, pending, inflight, committer, shards)
    return statuses


def _open_task(spec: TaskSpec, name: str) -> tuple[OutputDirs, _Shards, JournalWriter]:
    """This task's folders (opened here, checked against the run's: `spec.dirs`), shard files and journal."""
    root = Path(spec.output)
    dirs = OutputDirs(root, spec.dirs)
    try:
        shards = _Shards(root, name, spec.shard_size, dirs.fd(SHARD_DIR))
        journal = JournalWriter(root / JOURNAL_DIR / f"{name}.jsonl", dirs.fd(JOURNAL_DIR))
    except BaseException:
        dirs.close()
        raise
    return dirs, shards, journal


def _run_items(
    spec: TaskSpec, head: Any, shards: _Shards, items: list[tuple[int, dict[str, Any], str]],
    journal: JournalWriter, committer: ThreadPoolExecutor, pending: list[dict[str, Any]],
    statuses: list[dict[str, Any]], inflight: list[Future[None]],
) -> None:  # fmt: skip
    """The task's items, one after another; a group of finished items is committed about every
    COMMIT_INTERVAL_S on `committer` (its future last in `inflight`), the rest stay in `pending`."""
    last = time.monotonic()
    written = 0
    for n, (item, entry, section) in enumerate(items, 1):
        if _stop.is_set():
            break
        t0, c0 = time.perf_counter(), time.thread_time()
        with _head_slots(spec.heads):
            record = _prepare_one(head, shards, item, entry, section, spec.max_item_bytes, spec.sets)
        sets = record.pop("_sets", None)  # bytes for `prep cache`, not for the journal
        pending.append(record)
        # the CPU is this thread's: torch's other threads are not counted
        status = {"item": item, "quarantined": record.get("quarantined"), "seconds": time.perf_counter() - t0,
                  "cpu": time.thread_time() - c0}  # fmt: skip
        if sets is not None:
            status["sets"] = sets
        statuses.append(status)
        written += sum(align_up(int(t["nbytes"])) for t in pending[-1].get("tensors", []))
        shards.expect(written * (len(items) - n) // n)  # the mean item so far, times the items left
        if time.monotonic() - last >= COMMIT_INTERVAL_S and (not inflight or inflight[-1].done()):
            if inflight:
                inflight.pop().result()  # re-raise its error (a full disk) here
            inflight.append(committer.submit(_commit_group, shards.dir_fd, journal, pending[:]))
            pending.clear()
            last = time.monotonic()


def _end_task(
    dirs: OutputDirs, journal: JournalWriter, pending: list[dict[str, Any]], inflight: list[Future[None]],
    committer: ThreadPoolExecutor, shards: _Shards,
) -> None:  # fmt: skip
    """Commit a task's last items (after its group commit in flight), then close its files."""
    try:
        for future in inflight:
            future.result()
        _commit_group(shards.dir_fd, journal, pending)
    finally:
        _close_task(committer, shards, journal, dirs)


def _close_task(committer: ThreadPoolExecutor, shards: _Shards, journal: JournalWriter, dirs: OutputDirs) -> None:
    committer.shutdown(wait=True)  # before the journal closes
    try:
        shards.close()
    finally:
        try:
            journal.close()
        finally:
            dirs.close()


def _commit_group(shards_fd: int, journal: JournalWriter, group: list[dict[str, Any]]) -> None:
    """Make a group of items durable: their shards' bytes first, then their journal lines (one fsync each).

    The shards are fsynced through a descriptor of their own: on Linux fsync flushes the file, whichever
    descriptor names it, and the writer may meanwhile roll over to (and close) a new shard.
    """
    if not group:
        return
    for shard in sorted({r["shard"] for r in group if "shard" in r}):
        fd = os.open(os.path.basename(shard), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=shards_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    journal.append_many(group)


def _prepare_one(
    head: Any,
    shards: _Shards,
    item: int,
    entry: dict[str, Any],
    section: str,
    max_bytes: int | None = None,
    sets: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check, transform and write one item; returns its journal record (prepared or quarantined), with its
    sampling sets under "_sets" where `sets` (a crop signature) asks for them and they can be made.

    The .gz streams are inflated once, by their check (CRC and length, `prep.quarantine`); the head's nibabel
    then reads those bytes (`prep.inflated`) instead of inflating each file again (measured: docs/benchmarks.md,
    Preparation)."""
    decoded: dict[str, bytes] = {}
    bad = check_entry(entry, max_bytes, decoded)
    if bad:
        return _quarantined(item, entry, bad, max_bytes)
    try:
        with served(decoded), shared_grids():
            arrays, parts = split_output(head(dict(entry)))
    except Exception as exc:  # any failure of the user's head on this input quarantines the item
        reason = _root_cause(exc)
        return {"item": item, "quarantined": reason[:500], "path": _culprit(entry, exc), "inputs": input_stats(entry)}
    del decoded
    tensors = write_tensors(shards.current(), arrays)
    line = meta_line(entry, section, parts)
    record = {"item": item, "shard": shards.rel, "tensors": tensors, "meta": line}
    made = _sets_of(sets, arrays) if sets else None
    if made is not None:
        record["_sets"] = made
    return record


# An item's sets travel back with its task's statuses: larger ones are made by the pass after the commit (a task
# of 32 items then carries at most 128 MiB; 4 MiB is two sets of a 256^3 label, 1 bit a voxel)
WORKER_SETS_MAX_BYTES = 4 << 20


def _sets_of(sig: dict[str, Any], arrays: dict[str, Any]) -> Any:
    """An item's sampling sets from the arrays just written, as the tail will see them (torch tensors, as
    `prep.sampling` reads them back); None where they are not made here (the set pass after the commit
    makes them from the cache then)."""
    import math

    import torch

    from loaders.cache.sampling import packed_sets

    label, key = arrays.get(sig["label_key"]), sig["image_key"]
    image = arrays.get(key) if key else None
    if label is None or (key and image is None) or label.ndim < 2:
        return None
    n_sets = 2 if sig["kind"] == "posneg" else int(sig.get("num_classes") or label.shape[0])
    if math.prod(label.shape[1:]) * n_sets // 8 > WORKER_SETS_MAX_BYTES:
        return None
    try:
        made = packed_sets(sig, torch.from_numpy(label), None if image is None else torch.from_numpy(image))
    except Exception:  # noqa: BLE001  (the pass after the commit makes them, or says why)
        return None
    return made if sum(len(d) for _, d, _ in made) <= WORKER_SETS_MAX_BYTES * 5 // 4 else None


def _quarantined(item: int, entry: dict[str, Any], bad: tuple[str, str], max_bytes: int | None) -> dict[str, Any]:
    """The journal record of an item whose input file `bad[0]` the checks refused for `bad[1]`."""
    bound = {"max_item_bytes": max_bytes} if "--max-item-bytes" in bad[1] else {}
    return {"item": item, "quarantined": bad[1], "path": bad[0], "inputs": input_stats(entry), **bound}


def _culprit(entry: dict[str, Any], exc: BaseException) -> str:
    """The input file a head failure is about: the one its error messages name (MONAI names the file it
    could not read), else the only file the entry names, else the first image file."""
    texts: list[str] = []
    link: BaseException | None = exc
    while link is not None and len(texts) < 16:
        texts.append(str(link))
        link = link.__cause__ or link.__context__
    text = "\n".join(texts)
    files = [v for value in entry.values() for v in (value if isinstance(value, (list, tuple)) else [value])
             if isinstance(v, str) and os.path.isfile(v)]  # fmt: skip
    named = [f for f in files if f in text or os.path.basename(f) in text]
    for candidates in (named, files if len(files) == 1 else [], input_paths(entry), files):
        if candidates:
            return max(candidates, key=len) if candidates is named else candidates[0]
    return ""


class _DiskFullFilter(logging.Filter):
    """Drops distributed's "Compute Failed" record of a task that ran out of space: `prep cache` reports it
    in one line (finished items kept), and the record would print a traceback before that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed"):
            return True
        return not any("No space left" in str(a) or "ENOSPC" in str(a) for a in record.args or ())


def _quiet_disk_full() -> None:
    logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _DiskFullFilter) for f in logger.filters):
        logger.addFilter(_DiskFullFilter())


def _root_cause(exc: BaseException) -> str:
    """One line for an exception: MONAI wraps errors in "applying transform ..." so show the cause too."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = " ".join(str(root).split())
    return f"{type(root).__name__}: {text}"[:500]
