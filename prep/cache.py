"""`prep cache`: plan items -> dask tasks -> shard files + journals -> index, meta, manifest (committed last).

The run holds CACHE/.lock. Its plan (pipeline fingerprint, datalist hash) is written before any item, so a
later run knows whether the journals it finds belong to the same preparation (resume) or not (stale).
Tasks run `prep.worker.run_batch`; the commit turns journals into the layout of `loaders.cache.format`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.cache import chain, layout, sampling
from loaders.cache.format import PreparedCache
from loaders.cache.spec import BMAP, INDEX, JOURNAL_DIR, MANIFEST, META, META_OFFSETS, SCHEMA_VERSION, SHARD_DIR
from loaders.cache.writing import fsync_dir
from loaders.fast.folds import crop_sets_of
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
from prep.datalist import Repeats, datalist_hash, load_datalist, unique_items
from prep.errors import PrepError, StaleError, UsageError
from prep.item_size import available_memory, declared_total, default_max_item_bytes
from prep.journal import (
    CacheLock,
    JournalWriter,
    check_output,
    committed_records,
    read_journals,
    read_plan,
    write_plan,
)
from prep.pipeline import Pipeline, file_sha256, load_pipeline
from prep.processes import start_forkserver
from prep.quarantine import input_paths, to_retry
from prep.sampling import WorkerSets, ensure_sets
from prep.summary import CacheSummary, summary_of
from prep.worker import TaskSpec, keep_pipeline, run_batch, set_torch_threads

DEFAULT_SHARD_SIZE = 1 << 30
_COMMITTED = "committed.jsonl"  # a committed cache's items as journal lines, while its quarantine is retried


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
    if workers < 1 or shard_size < 4096:
        raise UsageError(f"--workers must be >= 1 and --shard-size >= 4096 (got {workers}, {shard_size})")
    if max_item_bytes is None:
        max_item_bytes = default_max_item_bytes(available_memory())
    elif max_item_bytes < 1:
        raise UsageError(f"--max-item-bytes must be at least 1 (got {max_item_bytes})")
    for path, what in ((Path(datalist), "datalist"), (Path(pipeline), "pipeline file")):
        if not path.is_file():
            raise UsageError(f"{path}: {what} not found")
    check_security(scheduler, security)
    root = Path(output)
    check_output(root)
    # a committed cache is usually up to date (or stale): no cluster for it unless work turns out to be needed
    early = force or not (root / MANIFEST).exists()
    if not early:  # complete and current: reported without the lock, as readers need none (read-only mounts)
        pipe = load_pipeline(pipeline, bundle_key)
        _check_head(pipe, allow_empty_head)
        items, plan, repeats = _load_plan(pipe, Path(datalist), sections, keep_repeats)
        summary = _up_to_date(root, plan, pipe, len(items), t0)
        retry = summary is not None and to_retry(summary.quarantined, max_item_bytes) and os.access(root, os.W_OK)
        if summary is not None and not retry:  # quarantined inputs that changed since are prepared again below
            summary.repeats = repeats.note()
            if summary.n_items:  # sets missing from a cache made before them are added (a read-only one: said)
                summary.sampling = _sets_or_why(root, pipe.tail, workers)
            _verify(summary, root, verify)
            return summary
        manifest = _load_json(root / MANIFEST)
        diffs = _differences(manifest, plan) if manifest is not None else []
        if diffs:  # refused before taking the lock, so a read-only cache says what changed too
            raise StaleError(f"{root}: {'; '.join(diffs)} since this cache was made; re-run with --force to rebuild")
    with ExitStack() as stack:  # closes in reverse: the cluster is gone before the lock is released
        stack.enter_context(interrupt_scope())
        stack.enter_context(CacheLock(root))
        starter = None
        if early and (scheduler or processes is not None or workers == 1):
            # the kind is known (a scheduler, threads or processes asked for, one worker's threads): it starts
            # while this thread plans; otherwise once the head is timed (worker_mode)
            asked = bool(processes) and not scheduler
            starter = stack.enter_context(ClusterStarter(workers, scheduler, asked, pipeline, bundle_key, security))
        elif early:  # processes may run: the forkserver imports torch and MONAI while this thread plans
            start_forkserver(torch_threads_for(workers, None, processes=True))
        pipe = load_pipeline(pipeline, bundle_key)
        _check_head(pipe, allow_empty_head)
        items, plan, repeats = _load_plan(pipe, Path(datalist), sections, keep_repeats)
        stack.enter_context(_no_space(root))
        manifest = _reconcile(root, plan, force)
        if manifest is not None and not _reopen(root, manifest, plan, len(items), max_item_bytes):
            summary = _up_to_date(root, plan, pipe, len(items), t0) or summary_of(
                root, manifest, len(items), 0, 0, time.perf_counter() - t0, up_to_date=True
            )
        else:
            run = _Run(root, plan, pipe, items, workers, scheduler, processes, shard_size, batch_size, progress,
                       security, max_item_bytes)  # fmt: skip
            summary = _prepare(run, stack, starter, t0)
        summary.head, summary.head_reason = pipe.head_description, pipe.head_reason
        summary.repeats = repeats.note()
        if summary.n_items and not summary.sampling:  # none made by the workers (or a resumed run's)
            summary.sampling = ensure_sets(root, pipe.tail, workers)
        _verify(summary, root, verify)
    return summary


def _reopen(root: Path, manifest: dict[str, Any], plan: dict[str, Any], n_items: int, max_item_bytes: int) -> bool:
    """Turn a committed cache whose quarantine holds items worth preparing again (`prep.quarantine.to_retry`:
    a file restored or replaced, a larger --max-item-bytes) into a resumable one: its prepared items and the
    quarantined items not retried become journal lines (plan first, manifest last, so a kill leaves a
    resumable cache), and the run prepares the retried items and commits anew. False when none is retried."""
    quarantined = list(manifest.get("quarantined", []))
    retry = set(to_retry(quarantined, max_item_bytes))
    if not retry:
        return False
    held = {int(q["item"]) for q in quarantined}
    records = committed_records(root, [i for i in range(n_items) if i not in held])
    if records is None:
        return False
    kept = [{"item": q["item"], "quarantined": q["reason"], "path": q.get("path", ""),
             **{k: q[k] for k in ("inputs", "max_item_bytes") if k in q}}
            for q in quarantined if int(q["item"]) not in retry]  # fmt: skip
    write_plan(root, plan)
    (root / JOURNAL_DIR / _COMMITTED).unlink(missing_ok=True)
    with JournalWriter(root / JOURNAL_DIR / _COMMITTED) as journal:
        journal.append_many(records + kept)
    (root / MANIFEST).unlink()
    fsync_dir(root)
    return True


def _sets_or_why(root: Path, tail: list[Any], workers: int) -> str:
    """ensure_sets for an up-to-date cache, which may sit on a read-only mount: then say what is missing."""
    try:
        return ensure_sets(root, tail, workers)
    except OSError as exc:
        return f"sampling sets: not written ({exc.strerror}); crops are drawn from whole labels"


def _check_head(pipe: Pipeline, allow_empty_head: bool) -> None:
    """Refuse a chain whose head is empty: the cache would hold no tensors, only the datalist's entries."""
    if pipe.head or allow_empty_head:
        return
    raise UsageError(
        f"{pipe.path}: nothing to prepare: the head is empty ({pipe.head_reason}); put the deterministic "
        "transforms (LoadImaged, ...) first, or pass --allow-empty-head to cache the entries as they are"
    )


def _open_checked(root: Path) -> PreparedCache:
    """Open a committed cache (layout files against their checksums, extents inside the shards present: see
    loaders.cache.layout) and check that no shard is missing, so a damaged cache is refused in one line, never
    reported up to date."""
    cache = PreparedCache(root)
    for shard in cache.shards:
        if layout.file_size(shard) < 0:
            raise StaleError(
                f"{root}: shard {shard.name} is missing (the cache is damaged); re-run with --force to rebuild"
            )
    return cache


def _verify(summary: CacheSummary, root: Path, verify: bool) -> None:
    """Run `prep verify`'s checks when asked; note in the summary what was checked."""
    if not verify:
        return
    summary.bad = verify_cache(root)
    cache = PreparedCache(root)
    summary.verified, summary.checked_files, summary.n_tensors = True, list(cache.files), len(cache.index)


def _up_to_date(root: Path, plan: dict[str, Any], pipe: Pipeline, n_planned: int, t0: float) -> CacheSummary | None:
    """The summary of a committed cache made with this plan whose files pass their checksums, else None."""
    manifest = _load_json(root / MANIFEST)
    if manifest is None or _differences(manifest, plan):
        return None
    _open_checked(root)  # damaged files: refused here, never reported as up to date
    summary = summary_of(root, manifest, n_planned, 0, 0, time.perf_counter() - t0, up_to_date=True)
    summary.version_notes = chain.compare_versions(manifest.get("versions", {}), plan["versions"])[1]
    summary.head, summary.head_reason = pipe.head_description, pipe.head_reason
    return summary


@dataclass
class _Run:
    """What one `prepare_cache` call works on, passed between its steps."""

    root: Path
    plan: dict[str, Any]
    pipe: Pipeline
    items: list[tuple[str, dict[str, Any]]]
    workers: int
    scheduler: str | None
    processes: bool | None
    shard_size: int
    batch_size: int | None
    progress: Progress | None
    security: Any = None
    max_item_bytes: int | None = None


def _prepare(run: _Run, stack: ExitStack, starter: ClusterStarter | None, t0: float) -> CacheSummary:
    """Prepare the items no journal marks finished, then commit and map the shards."""
    root, items = run.root, run.items
    write_plan(root, run.plan)
    before = read_journals(root)
    todo = [i for i in range(len(items)) if i not in before.finished]
    n_todo = len(todo)  # the probe's items (prepared before the tasks) count as this run's
    if run.progress:
        run.progress(0, len(todo))
    processes = False
    item_s, probed = None, 0
    sig = crop_sets_of(run.pipe.tail) if todo else None
    made = stack.enter_context(closing(WorkerSets(root, sig))) if sig is not None else None
    item_cpu = [0.0]  # the items' own CPU seconds on their threads (statuses), against the workers' whole

    def sink(statuses: list[dict[str, Any]]) -> None:
        item_cpu[0] += sum(float(s.get("cpu") or 0.0) for s in statuses)
        if made is not None:
            made.add(statuses)

    if todo:
        keep_pipeline(run.pipe)
        if starter is None and _start_early(run, len(todo)):
            # worker processes start while this process probes (see _start_early)
            starter = _starter(run, True)
            stack.callback(starter.close)
        if len(todo) > run.workers and not run.scheduler:
            item_s, probed = _probe(run, todo, sig, sink)
        if run.progress and probed:
            run.progress(probed, len(todo))
    progress, todo = _counting(run.progress, probed), todo[probed:]
    if todo:
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
            run_tasks(client, spec, items, todo, size, progress, starter.pids, sink, singles, commit_later=local)
    # every task has returned and every worker's last commits are done (run_tasks waited): no worker
    # writes any more, so the cluster closes (0.1 s for 16 processes) while the journals are read and committed
    closer = threading.Thread(target=starter.close, name="blockprep-close") if starter is not None else None
    if closer is not None:
        closer.start()
    try:
        state = read_journals(root)
        missing = [i for i in range(len(items)) if i not in state.finished]
        if missing:
            raise PrepError(f"{root}: {len(missing)} items were not prepared (workers lost?); re-run to resume")
        manifest, bmap_note = commit(root, run.plan, run.pipe, items, state)
    finally:
        if closer is not None:
            closer.join()
    worker_cpu_s = starter.worker_cpu_s if starter is not None else 0.0
    start_cpu_s = starter.start_cpu_s if starter is not None else 0.0
    summary = summary_of(root, manifest, len(items), n_todo, len(items) - n_todo, time.perf_counter() - t0)
    if made is not None:  # "" where a resumed run's items have none: prepare_cache's pass makes them
        summary.sampling = made.write(state.order(len(items)), run.pipe.tail)
    summary.bmap_note, summary.worker_cpu_s = bmap_note or summary.bmap_note, worker_cpu_s
    summary.item_cpu_s, summary.worker_start_cpu_s = item_cpu[0], start_cpu_s
    if todo and not run.scheduler:
        how = "processes" if processes else "threads"
        each = items_per_worker(run.workers)
        summary.mode = (
            f"{run.workers} {how}{f' x {each} items' if each > 1 else ''}{' (auto)' if run.processes is None else ''}"
        )
    return summary


def _spec(run: _Run, run_id: str, threads: int, heads: int, sets: dict[str, Any] | None) -> TaskSpec:
    """The tasks' spec of this run (the probe's too): where to write, which pipeline, how to run it."""
    return TaskSpec(str(run.root.resolve()), str(run.pipe.path), run.pipe.bundle_key, run.pipe.fingerprint,
                    run.shard_size, run_id, threads, run.max_item_bytes, heads, sets)  # fmt: skip


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


def _load_plan(
    pipe: Pipeline, datalist: Path, sections: Sequence[str], keep_repeats: bool
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any], Repeats]:
    """The items to prepare (repeats once unless kept), the run's plan, and what repeated."""
    listed = load_datalist(datalist, sections)
    items, repeats = unique_items(listed, keep_repeats)
    plan = _plan(pipe, datalist, listed, sections)
    if repeats.count:
        plan["repeats"] = "kept" if keep_repeats else "once"
    return items, plan, repeats


def _plan(pipe: Pipeline, datalist: Path, items: list[tuple[str, dict[str, Any]]], sections: Sequence[str]) -> dict:
    return {
        "fingerprint": pipe.fingerprint,
        "head": pipe.head_description,
        "head_end": pipe.head_reason,
        "versions": chain.versions(),
        "datalist": str(datalist.resolve()),
        "datalist_hash": datalist_hash(items),
        "n_datalist": len(items),
        "sections": list(sections),
        "pipeline": str(pipe.path),
        "pipeline_sha256": file_sha256(pipe.path),  # what it was: a cache never picks the code a trainer runs
        "bundle_key": pipe.bundle_key,
    }


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between the plan an existing cache was made with and this run's plan."""
    version = str(old.get("schema_version", SCHEMA_VERSION))  # plans carry none: they are this run's kind
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        return [f"blockprep's cache format changed (schema {version} -> {SCHEMA_VERSION})"]
    diffs = []
    if old.get("fingerprint") != new["fingerprint"]:
        if old.get("head") != new["head"]:
            diffs.append(f"pipeline head changed ({old.get('head')} -> {new['head']})")
        else:
            diffs.append("pipeline head settings changed (same transforms, different configuration)")
    refuse, _ = chain.compare_versions(old.get("versions", {}), new["versions"])
    if refuse:
        diffs.append(f"library versions changed ({'; '.join(refuse)})")
    if old.get("datalist_hash") != new["datalist_hash"]:
        diffs.append(f"datalist changed ({old.get('n_datalist')} -> {new['n_datalist']} items, {new['datalist']})")
    if old.get("repeats", "kept") != new.get("repeats", "kept"):  # older caches prepared every copy
        diffs.append(f"repeated datalist entries: {old.get('repeats', 'kept')} -> {new.get('repeats', 'kept')}")
    if old.get("sections") != new["sections"]:
        diffs.append(f"sections changed ({old.get('sections')} -> {new['sections']})")
    return diffs


def _reconcile(root: Path, plan: dict[str, Any], force: bool) -> dict[str, Any] | None:
    """The existing manifest if the cache is complete and current; else wipe (fresh/force) or keep (resume)."""
    manifest = _load_json(root / MANIFEST)
    previous = manifest if manifest is not None else read_plan(root)
    if previous is None:
        if force or (root / JOURNAL_DIR).exists() or (root / SHARD_DIR).exists():
            _wipe(root)  # leftovers without a plan: the run died before any item could be journaled
        return None
    diffs = _differences(previous, plan)
    if diffs and not force:
        state = "cache" if manifest is not None else "partial cache (interrupted run)"
        raise StaleError(f"{root}: {'; '.join(diffs)} since this {state} was made; re-run with --force to rebuild")
    if force or diffs:
        _wipe(root)
        return None
    if manifest is not None:
        _open_checked(root)  # a complete cache is reported up to date only while its files pass their checksums
    return manifest


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StaleError(f"{path}: unreadable ({exc}); re-run with --force to rebuild the cache") from exc
    return doc if isinstance(doc, dict) else None


def _wipe(root: Path) -> None:
    """Remove every cache file; the manifest first, so a crash mid-wipe leaves nothing trusted."""
    for name in (MANIFEST, INDEX, META, META_OFFSETS, BMAP):
        (root / name).unlink(missing_ok=True)
    for name in (SHARD_DIR, JOURNAL_DIR, sampling.DIR):
        shutil.rmtree(root / name, ignore_errors=True)


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
