"""`prep cache`: plan items -> dask tasks -> shard files + journals -> index, meta, manifest (committed last).

The run holds CACHE/.lock. Its plan (pipeline fingerprint, datalist hash) is written before any item, so a
later run knows whether the journals it finds belong to the same preparation (resume) or not (stale).
Tasks run `prep.worker.run_batch`; the commit turns journals into the layout of `loaders.cache.format`.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.cache import chain
from loaders.cache.format import PreparedCache
from loaders.cache.spec import JOURNAL_DIR, MANIFEST, SHARD_DIR
from loaders.fast.folds import crop_sets_of
from loaders.machine import available_memory
from prep.cache_plan import (
    adopt,
    check_head,
    differences,
    head_differences,
    load_json,
    load_plan,
    reconcile,
    regrow,
    reopen,
    up_to_date,
)
from prep.cache_verify import verify_cache
from prep.cluster import (
    ClusterStarter,
    Progress,
    Sink,
    batch_size_for,
    check_security,
    heads_at_once,
    interrupt_scope,
    items_per_worker,
    local_cores,
    run_tasks,
    torch_threads_for,
    worker_mode,
)
from prep.commit import commit
from prep.datalist import Repeats, load_datalist
from prep.errors import PrepError, StaleError, UsageError
from prep.item_size import declared_total, default_max_item_bytes
from prep.journal import CacheLock, JournalState, check_output, read_journals, write_plan
from prep.outdirs import OutputDirs
from prep.pipeline import Pipeline, load_pipeline
from prep.processes import start_forkserver
from prep.quarantine import input_paths, to_retry
from prep.sampling import WorkerSets, ensure_sets
from prep.summary import CacheSummary, summary_of
from prep.worker import TaskSpec, keep_pipeline, run_batch, set_torch_threads

__all__ = ["DEFAULT_SHARD_SIZE", "load_datalist", "prepare_cache"]  # load_datalist: imported from here by callers

DEFAULT_SHARD_SIZE = 1 << 30

_Items = list[tuple[str, dict[str, Any]]]  # the datalist entries to prepare: (section, entry)


def prepare_cache(
    datalist: str | Path,
    pipeline: str | Path,
    output: str | Path,
    *,
    workers: int = 2,
    scheduler: str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    verify: bool = False,
    sections: Sequence[str] = ("training",),
    bundle_key: str | None = None,
    processes: bool | None = None,
    batch_size: int | None = None,
    progress: Progress | None = None,
    security: Any = None,
    allow_empty_head: bool = False,
    max_item_bytes: int | None = None,
    keep_repeats: bool = False,
) -> CacheSummary:
    """Run the pipeline's deterministic head over the datalist on dask and commit a prepared cache.

    Resumes an interrupted run of the same plan; raises StaleError for a different pipeline or datalist
    unless `force` (then starts over). Quarantined items are listed in the summary and the manifest.
    The local cluster runs `workers` threads in this process (each task with cores / workers torch threads),
    or (`processes=True`) one process per worker (cores / workers torch threads each), forked by a
    forkserver (`prep.processes`: a script calling this needs the `if __name__ == "__main__":` guard);
    `processes=None` chooses by `prep.cluster.worker_mode` from the head (threads for a CUDA head) and its
    time on the first item. A head that prepares nothing (the chain's first transform is random) is refused unless
    `allow_empty_head`. `security` (a distributed.security.Security) is required for a tls:// `scheduler`.
    An input whose header declares more than `max_item_bytes` decoded (default: a quarter of this machine's
    available memory, `prep.item_size`) is quarantined before it is decoded. An entry listed again in its
    section is prepared once (every copy with `keep_repeats`); the summary says how many repeat.
    """
    t0 = time.perf_counter()
    max_item_bytes = _checked_options(datalist, pipeline, workers, shard_size, max_item_bytes)
    check_security(scheduler, security)
    root = Path(output)
    check_output(root)
    # a committed cache is usually up to date (or stale): no cluster for it unless work turns out to be needed
    early = force or not (root / MANIFEST).exists()
    if not early:  # complete and current: reported without the lock, as readers need none (read-only mounts)
        pipe, items, plan, repeats = _load(pipeline, bundle_key, allow_empty_head, datalist, sections, keep_repeats)
        summary = _committed(root, pipe, items, plan, repeats, max_item_bytes, workers, verify, t0)
        if summary is not None:
            return summary
    with ExitStack() as stack:  # closes in reverse: the cluster is gone before the lock is released
        stack.enter_context(interrupt_scope())
        stack.enter_context(CacheLock(root))
        dirs = stack.enter_context(OutputDirs(root))  # every write of the run is relative to these (prep.outdirs)
        starter = _start_while_planning(stack, early, workers, scheduler, processes, pipeline, bundle_key, security)
        pipe, items, plan, repeats = _load(pipeline, bundle_key, allow_empty_head, datalist, sections, keep_repeats)
        stack.enter_context(_no_space(root))
        run = _Run(root, plan, pipe, items, workers, scheduler, processes, shard_size, batch_size, progress,
                   dirs, security, max_item_bytes)  # fmt: skip
        summary = _reused_or_prepared(run, stack, starter, force, max_item_bytes, t0)
        _complete(summary, root, pipe, repeats, workers, verify)
    return summary


def _checked_options(
    datalist: str | Path, pipeline: str | Path, workers: int, shard_size: int, max_item_bytes: int | None
) -> int:
    """Refuse options out of range and input files not found; returns the item bound (default: from memory)."""
    if workers < 1 or shard_size < 4096:
        raise UsageError(f"--workers must be >= 1 and --shard-size >= 4096 (got {workers}, {shard_size})")
    if max_item_bytes is None:
        max_item_bytes = default_max_item_bytes(available_memory())
    elif max_item_bytes < 1:
        raise UsageError(f"--max-item-bytes must be at least 1 (got {max_item_bytes})")
    for path, what in ((Path(datalist), "datalist"), (Path(pipeline), "pipeline file")):
        if not path.is_file():
            raise UsageError(f"{path}: {what} not found")
    return max_item_bytes


def _load(
    pipeline: str | Path,
    bundle_key: str | None,
    allow_empty_head: bool,
    datalist: str | Path,
    sections: Sequence[str],
    keep_repeats: bool,
) -> tuple[Pipeline, _Items, dict[str, Any], Repeats]:
    """The user's chain (an empty head refused), the items to prepare, the run's plan and what repeated."""
    pipe = load_pipeline(pipeline, bundle_key)
    check_head(pipe, allow_empty_head)
    items, plan, repeats = load_plan(pipe, Path(datalist), sections, keep_repeats)
    return pipe, items, plan, repeats


def _committed(
    root: Path,
    pipe: Pipeline,
    items: _Items,
    plan: dict[str, Any],
    repeats: Repeats,
    max_item_bytes: int,
    workers: int,
    verify: bool,
    t0: float,
) -> CacheSummary | None:
    """Before the lock: the summary of a committed cache that is current with nothing to retry; None where
    work is needed; StaleError where the plan changed."""
    summary = up_to_date(root, plan, pipe, len(items), t0)
    retry = summary is not None and to_retry(summary.quarantined, max_item_bytes) and os.access(root, os.W_OK)
    if summary is not None and not retry:  # quarantined inputs that changed since are prepared again below
        summary.repeats = repeats.note()
        if summary.n_items:  # sets missing from a cache made before them are added (a read-only one: said)
            summary.sampling = _sets_or_why(root, pipe.tail, workers)
        _verify(summary, root, verify)
        return summary
    manifest = load_json(root / MANIFEST)
    diffs = differences(manifest, plan) if manifest is not None and head_differences(manifest, plan) else []
    if diffs:  # refused before taking the lock, so a read-only cache says what changed too
        raise StaleError(f"{root}: {'; '.join(diffs)} since this cache was made; re-run with --force to rebuild")
    return None  # work to do: items to retry, or a datalist changed (the items still listed are kept)


def _start_while_planning(
    stack: ExitStack,
    early: bool,
    workers: int,
    scheduler: str | None,
    processes: bool | None,
    pipeline: str | Path,
    bundle_key: str | None,
    security: Any,
) -> ClusterStarter | None:
    """The cluster, started while this thread plans where its kind is known already (else the forkserver)."""
    if early and (scheduler or processes is not None or workers == 1):
        # the kind is known (a scheduler, threads or processes asked for, one worker's threads): it starts
        # while this thread plans; otherwise once the head is timed (worker_mode)
        asked = bool(processes) and not scheduler
        return stack.enter_context(ClusterStarter(workers, scheduler, asked, pipeline, bundle_key, security))
    if early:  # processes may run: the forkserver imports torch and MONAI while this thread plans
        start_forkserver(torch_threads_for(workers, None, processes=True))
    return None


def _complete(summary: CacheSummary, root: Path, pipe: Pipeline, repeats: Repeats, workers: int, verify: bool) -> None:
    """Add to a locked run's summary its head, its repeats, the sampling sets no worker made, and `--verify`."""
    summary.head, summary.head_reason = pipe.head_description, pipe.head_reason
    summary.repeats = repeats.note()
    if summary.n_items and not summary.sampling:  # none made by the workers (or a resumed run's)
        summary.sampling = ensure_sets(root, pipe.tail, workers)
    _verify(summary, root, verify)


def _sets_or_why(root: Path, tail: list[Any], workers: int) -> str:
    """ensure_sets for an up-to-date cache, which may sit on a read-only mount: then say what is missing."""
    try:
        return ensure_sets(root, tail, workers)
    except OSError as exc:
        return f"sampling sets: not written ({exc.strerror}); crops are drawn from whole labels"


def _verify(summary: CacheSummary, root: Path, verify: bool) -> None:
    """Run `prep verify`'s checks when asked; note in the summary what was checked."""
    if not verify:
        return
    summary.bad = verify_cache(root)
    cache = PreparedCache(root)
    summary.verified, summary.checked_files, summary.n_tensors = True, list(cache.files), len(cache.index)


@dataclass
class _Run:
    """What one `prepare_cache` call works on, passed between its steps."""

    root: Path
    plan: dict[str, Any]
    pipe: Pipeline
    items: _Items
    workers: int
    scheduler: str | None
    processes: bool | None
    shard_size: int
    batch_size: int | None
    progress: Progress | None
    dirs: OutputDirs  # the output's folders, held open from start-up: every write of the run is relative to them
    security: Any = None
    max_item_bytes: int | None = None


def _reused_or_prepared(
    run: _Run, stack: ExitStack, starter: ClusterStarter | None, force: bool, max_item_bytes: int, t0: float
) -> CacheSummary:
    """Under the lock: the committed cache where it is current with nothing to retry, else the run prepared."""
    root, n_items = run.root, len(run.items)
    manifest = reconcile(root, run.plan, force)
    if manifest is not None and differences(manifest, run.plan):  # the datalist changed (reconcile: only it)
        kept, taken = regrow(root, manifest, run.plan, run.items, max_item_bytes)
        return _prepare(run, stack, starter, t0, (kept, int(manifest["n_items"]) - kept), taken)
    if manifest is not None and not reopen(root, manifest, run.plan, n_items, max_item_bytes):
        return up_to_date(root, run.plan, run.pipe, n_items, t0) or summary_of(
            root, manifest, n_items, 0, 0, time.perf_counter() - t0, up_to_date=True
        )
    return _prepare(run, stack, starter, t0, taken=adopt(root, run.plan, run.items) if manifest is None else 0)


class _Statuses:
    """The tasks' sink: the items' own CPU seconds on their threads (against the workers' whole), and the
    sampling sets the workers made."""

    def __init__(self, made: WorkerSets | None) -> None:
        self.made, self.item_cpu = made, 0.0

    def __call__(self, statuses: list[dict[str, Any]]) -> None:
        self.item_cpu += sum(float(s.get("cpu") or 0.0) for s in statuses)
        if self.made is not None:
            self.made.add(statuses)


def _prepare(
    run: _Run, stack: ExitStack, starter: ClusterStarter | None, t0: float, regrown: tuple[int, int] = (0, 0),
    taken: int = 0,
) -> CacheSummary:  # fmt: skip
    """Prepare the items no journal marks finished, then commit and map the shards. `regrown`: (items kept,
    items dropped) of a committed cache whose datalist changed; `taken`: its new entries the MONAI drop-in wrote."""
    root, items = run.root, run.items
    write_plan(root, run.plan, run.dirs.fd(JOURNAL_DIR))
    run.dirs.fd(SHARD_DIR)  # opened (made) here: tasks compare their own with it
    before = read_journals(root, run.dirs)
    todo = [i for i in range(len(items)) if i not in before.finished]
    n_todo = len(todo)  # the probe's items (prepared before the tasks) count as this run's
    if run.progress:
        run.progress(0, len(todo))
    processes = False
    item_s, probed = None, 0
    sig = crop_sets_of(run.pipe.tail) if todo else None
    made = stack.enter_context(closing(WorkerSets(root, sig))) if sig is not None else None
    sink = _Statuses(made)
    if todo:
        starter, item_s, probed = _probe_first(run, stack, starter, todo, sig, sink)
    progress, todo = _counting(run.progress, probed), todo[probed:]
    if todo:
        processes, starter = _run_todo(run, stack, starter, todo, item_s, sig, sink, progress)
    state, manifest, bmap_note = _commit_while_closing(run, starter)
    worker_cpu_s = starter.worker_cpu_s if starter is not None else 0.0
    start_cpu_s = starter.start_cpu_s if starter is not None else 0.0
    n_resumed = len(items) - n_todo - regrown[0] - taken
    summary = summary_of(root, manifest, len(items), n_todo, n_resumed, time.perf_counter() - t0)
    summary.n_kept, summary.n_dropped, summary.n_taken = *regrown, taken
    if made is not None:  # "" where a resumed run's items have none: prepare_cache's pass makes them
        summary.sampling = made.write(state.order(len(items)), run.pipe.tail)
    summary.bmap_note, summary.worker_cpu_s = bmap_note or summary.bmap_note, worker_cpu_s
    summary.item_cpu_s, summary.worker_start_cpu_s = sink.item_cpu, start_cpu_s
    if todo and not run.scheduler:
        summary.mode = _mode(run, processes)
    return summary


def _probe_first(
    run: _Run,
    stack: ExitStack,
    starter: ClusterStarter | None,
    todo: list[int],
    sig: dict[str, Any] | None,
    sink: Sink,
) -> tuple[ClusterStarter | None, float | None, int]:
    """Time the first items here (the cluster's processes starting meanwhile where they will be used): (the
    cluster started, seconds an item takes, items the probe prepared)."""
    keep_pipeline(run.pipe)
    if starter is None and _start_early(run, len(todo)):
        # worker processes start while this process probes (see _start_early)
        starter = _starter(run, True)
        stack.callback(starter.close)
    item_s, probed = None, 0
    if len(todo) > run.workers and not run.scheduler:
        item_s, probed = _probe(run, todo, sig, sink)
    if run.progress and probed:
        run.progress(probed, len(todo))
    return starter, item_s, probed


def _run_todo(
    run: _Run,
    stack: ExitStack,
    starter: ClusterStarter | None,
    todo: list[int],
    item_s: float | None,
    sig: dict[str, Any] | None,
    sink: Sink,
    progress: Progress | None,
) -> tuple[bool, ClusterStarter]:
    """Run the items of `todo` as dask tasks, on workers of the kind chosen now (threads or processes)."""
    processes = worker_mode(run.workers, len(todo), item_s, run.pipe.head, _cuda_initialized(), run.processes)
    if starter is not None and not run.scheduler and starter.processes != processes:
        starter.close()  # started before the choice, which went the other way
        starter = None
    starter = starter or stack.enter_context(_starter(run, processes))
    threads = torch_threads_for(run.workers, run.scheduler, processes)
    first_bytes = declared_total(input_paths(run.items[todo[0]][1]))  # bounds the items side by side
    heads = 0 if run.scheduler else heads_at_once(run.workers, processes, first_bytes, available_memory())
    spec = _spec(run, uuid.uuid4().hex[:8], threads, heads, sig)
    at_once = run.workers * (items_per_worker(run.workers) if not run.scheduler else 1)
    size = batch_size_for(len(todo), at_once, run.batch_size, item_s)
    with _torch_threads_kept(in_process=not (processes or run.scheduler)):
        client = starter.client()
        singles = 0 if run.batch_size or run.scheduler else at_once
        local = not run.scheduler
        run_tasks(client, spec, run.items, todo, size, progress, starter.pids, sink, singles, commit_later=local)
    return processes, starter


def _commit_while_closing(run: _Run, starter: ClusterStarter | None) -> tuple[JournalState, dict[str, Any], str]:
    """Read the journals and commit the cache while the cluster closes on its own thread."""
    # every task has returned and every worker's last commits are done (run_tasks waited): no worker
    # writes any more, so the cluster closes (0.1 s for 16 processes) while the journals are read and committed
    closer = threading.Thread(target=starter.close, name="blockprep-close") if starter is not None else None
    if closer is not None:
        closer.start()
    try:
        state = read_journals(run.root, run.dirs)
        missing = [i for i in range(len(run.items)) if i not in state.finished]
        if missing:
            raise PrepError(f"{run.root}: {len(missing)} items were not prepared (workers lost?); re-run to resume")
        manifest, bmap_note = commit(run.root, run.plan, run.pipe, run.items, state, run.dirs)
    finally:
        if closer is not None:
            closer.join()
    return state, manifest, bmap_note


def _mode(run: _Run, processes: bool) -> str:
    """How a local run's workers ran, as the summary says it: "4 processes x 2 items (auto)"."""
    how = "processes" if processes else "threads"
    each = items_per_worker(run.workers)
    return f"{run.workers} {how}{f' x {each} items' if each > 1 else ''}{' (auto)' if run.processes is None else ''}"


def _spec(run: _Run, run_id: str, threads: int, heads: int, sets: dict[str, Any] | None) -> TaskSpec:
    """The tasks' spec of this run (the probe's too): where to write, which pipeline, how to run it."""
    return TaskSpec(str(run.root.resolve()), str(run.pipe.path), run.pipe.bundle_key, run.pipe.fingerprint,
                    run.shard_size, run_id, threads, run.max_item_bytes, heads, sets,
                    run.dirs.ids())  # fmt: skip


def _starter(run: _Run, processes: bool) -> ClusterStarter:
    """This run's cluster (threads or processes), starting on its thread."""
    return ClusterStarter(run.workers, run.scheduler, processes, run.pipe.path, run.pipe.bundle_key, run.security)


EARLY_START_CORES = 8  # on 16 cores auto took processes at 4-16 workers on every workload (docs/benchmarks.md)


def _start_early(run: _Run, n_todo: int) -> bool:
    """Whether a local run starts its worker processes before the probe: processes asked for, or (auto) a
    machine of EARLY_START_CORES cores or more running 4 workers or more, where the auto choice takes processes
    (docs/benchmarks.md, Preparation); not for a head that touches CUDA
    or a process where CUDA is initialised. A start the probe then overrules costs its idle cores' time."""
    if run.scheduler or n_todo <= run.workers or run.processes is False:
        return False
    if run.processes:
        return True
    cuda = _cuda_initialized() or chain.touches_cuda(run.pipe.head)
    return not cuda and run.workers >= 4 and local_cores() >= EARLY_START_CORES


def _counting(progress: Progress | None, done: int) -> Progress | None:
    """`progress` for the tasks, whose count leaves out the `done` items the probe prepared."""
    if progress is None or not done:
        return progress
    return lambda advance, total: progress(advance, total + done)


def _cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (the probe of a CUDA head does): its forks could not use it."""
    import torch

    return bool(torch.cuda.is_initialized())


def _probe(
    run: _Run, todo: list[int], sets: dict[str, Any] | None = None, sink: Sink | None = None
) -> tuple[float | None, int]:
    """(seconds an item takes here on one torch thread, items prepared): the first item of `todo` prepared in
    this process as a task prepares it (checked, its head run, written and journaled), and a second one where
    the first was quick enough for its readers' first imports to dominate. None where an item is
    quarantined (its journal says why). The probe's items are not prepared again by the tasks: one or two
    items' work a run, within a whole run's spread (docs/benchmarks.md, Preparation)."""
    import torch

    threads = torch.get_num_threads()
    spec = _spec(run, "probe" + uuid.uuid4().hex[:3], 1, 0, sets)
    seconds: float | None = None
    probed = 0
    try:
        for n, item in enumerate(todo[:2]):
            statuses = run_batch(spec, n, [(item, run.items[item][1], run.items[item][0])])
            if sink is not None:
                sink(statuses)
            status = statuses[0]
            probed += 1
            seconds = None if status["quarantined"] else float(status["seconds"])
            if seconds is None or seconds > 0.2:
                break
    finally:
        set_torch_threads(threads)
    return seconds, probed


@contextmanager
def _torch_threads_kept(in_process: bool) -> Iterator[None]:
    """Tasks on in-process worker threads set this process's torch threads: give the caller its setting back."""
    if not in_process:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        set_torch_threads(threads)


@contextmanager
def _no_space(root: Path) -> Iterator[None]:
    """A full disk anywhere in the run becomes one clear PrepError; journaled items stay for the resume."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise PrepError(
            f"{root}: no space left on the device; finished items are kept: free space and re-run the same "
            "command to resume"
        ) from None
