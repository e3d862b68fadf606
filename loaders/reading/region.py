"""Region reads: fetch only the bytes a patch of a C-order tensor needs, in one backend batch.

A region `[start, start + shape)` of a C-order array is a set of contiguous byte runs. Reading every run
(one per row along the last axis) costs a request each; reading whole slabs costs bytes. `plan_region`
picks the axis at which to cut: each request covers the region along that axis and everything after it
(from the first needed byte to the last), so the request count is the product of the region's leading
extents. A cost model (per-request overhead against bandwidth) chooses the cut; when the region spans the
full trailing dims the runs merge for free. The bytes land in a buffer laid out like full slabs, so the
result is one strided numpy copy: exactly `full[slices]`.

How the runs are issued depends on where the bytes are (asked without I/O through cachestat(2)). Warm
(page cache): runs are memory copies, so they are split into a few groups (about one per core) and each
group is read run after run on one thread: the thread handoff is paid per group, not per run. Cold: runs
separated by gaps cheaper to read than to skip (a request's cost against the device's bandwidth, measured:
`loaders.reading.diskcost`) are merged into one read, and many requests go in flight at once. Where the cache
has bricks (`prep bricks`), a cold region is read from its tensor's blocks (`loaders.reading.bricked`) or from the
tensor, whichever the process's first cold reads of that cache found faster (`diskcost.BrickTrial`).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.backends.base import Backend, PageCacheProbe, ReadRequest
from loaders.cache.format import TensorEntry
from loaders.cache.layout import open_read
from loaders.cache.spec import ALIGN, align_up
from loaders.opener import safe_to_map
from loaders.reading.diskcost import CostModel, brick_trial, disk_cost
from loaders.reading.staging import host_array
from loaders.tunables import BANDWIDTH_BPS, COLD_INFLIGHT, REQUEST_COST_S, SEQUENTIAL_BELOW


@dataclass(frozen=True)
class RegionPlan:
    """How to read a region: `spans` requests (byte offset in the tensor, nbytes, offset inside its slab)."""

    axis: int  # requests are cut at this axis: one per index combination of the axes before it
    slab_shape: tuple[int, ...]  # shape of one request's slab: (region extent at axis, *full trailing dims)
    spans: list[tuple[int, int, int]]  # (tensor byte offset, nbytes, byte offset inside the slab)
    lead_shape: tuple[int, ...]  # region extents of the axes before `axis`

    @property
    def nbytes(self) -> int:
        """Bytes the plan reads."""
        return sum(n for _, n, _ in self.spans)


def _check(full: Sequence[int], start: Sequence[int], shape: Sequence[int], what: str) -> None:
    if len(start) != len(full) or len(shape) != len(full):
        raise ValueError(f"{what}: region start {tuple(start)} / shape {tuple(shape)} do not match {len(full)} dims")
    for s, n, f in zip(start, shape, full):
        if s < 0 or n < 1 or s + n > f:
            raise ValueError(f"{what}: region start {tuple(start)} shape {tuple(shape)} outside {tuple(full)}")


def _cost(full: Sequence[int], shape: Sequence[int], axis: int, itemsize: int) -> float:
    requests = math.prod(shape[:axis])
    per = (shape[axis] - 1) * math.prod(full[axis + 1 :]) + _tail_span(full, shape, axis)
    return requests * REQUEST_COST_S + requests * per * itemsize / BANDWIDTH_BPS


def _tail_span(full: Sequence[int], shape: Sequence[int], axis: int) -> int:
    """Elements from the first to the last needed one within one slab row at `axis` (inclusive)."""
    span = 1
    stride = 1
    for d in range(len(full) - 1, axis, -1):
        span += (shape[d] - 1) * stride
        stride *= full[d]
    return span


def plan_region(
    full: Sequence[int], itemsize: int, start: Sequence[int], shape: Sequence[int], axis: int | None = None
) -> RegionPlan:
    """Plan the requests for region `[start, start+shape)` of a C-order array of shape `full`."""
    full, start, shape = tuple(full), tuple(start), tuple(shape)
    _check(full, start, shape, "plan_region")
    if not full:
        return RegionPlan(0, (), [(0, itemsize, 0)], ())
    if axis is None:
        # Axes before the first partial one are free to cut at: cutting earlier reads the same bytes.
        axis = min(range(len(full)), key=lambda a: _cost(full, shape, a, itemsize))
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    slab_stride = strides[axis]  # elements per index along `axis`
    slab_shape = (shape[axis], *full[axis + 1 :])
    inner = sum(start[d] * strides[d] for d in range(axis + 1, len(full)))  # first needed element in a slab row
    span = (shape[axis] - 1) * slab_stride + _tail_span(full, shape, axis)
    spans = []
    for lead in itertools.product(*(range(s, s + n) for s, n in zip(start[:axis], shape[:axis]))):
        base = sum(i * strides[d] for d, i in enumerate(lead)) + start[axis] * slab_stride
        spans.append(((base + inner) * itemsize, span * itemsize, inner * itemsize))
    return RegionPlan(axis, slab_shape, spans, tuple(shape[:axis]))


def window_spans(
    full: Sequence[int], itemsize: int, start: Sequence[int], shape: Sequence[int]
) -> list[tuple[int, int]]:
    """(byte offset, nbytes) of the runs holding a spatial window `[start, start + shape)` of every channel of a
    C-order array of shape `full` = (channels, *spatial): one per index of all but the last two axes (in pages,
    the fewest bytes: a row of the last axis is shorter than a page but in the largest images); none for an empty
    window."""
    if not shape or min(shape) < 1:
        return []
    plan = plan_region(full, itemsize, (0, *start), (full[0], *shape), axis=max(len(full) - 2, 0))
    return [(off, n) for off, n, _ in plan.spans]


@dataclass(frozen=True)
class RegionRead:
    """The planned read of one tensor's region: its requests, and how the slabs become the region."""

    entry: TensorEntry
    start: tuple[int, ...]
    shape: tuple[int, ...]
    plan: RegionPlan
    brick: Any = None  # the tensor's blocks (`loaders.cache.bricks.BrickEntry`) where the cache has bricks

    @property
    def base(self) -> int:
        """Where the tensor begins in its file."""
        return self.entry.offset

    @property
    def count(self) -> int:
        """Requests this read makes."""
        return len(self.plan.spans)

    def cold(self) -> Any:
        """The read to make where the bytes are on disk: from the tensor's blocks where it has them (fewer bytes,
        `loaders.reading.bricked`), else this one."""
        if self.brick is None:
            return self
        from loaders.reading.bricked import BrickRead

        return BrickRead(self.entry, self.start, self.shape, self.brick)

    @property
    def slab_bytes(self) -> int:
        """Bytes of one request's slab in the scratch buffer."""
        return math.prod(self.plan.slab_shape) * self.entry.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Scratch bytes this read needs (whole slabs; only the planned spans are read into them)."""
        return self.slab_bytes * len(self.plan.spans)

    def requests(self) -> list[ReadRequest]:
        """One request per span."""
        return [ReadRequest(self.entry.shard, self.entry.offset + off, n) for off, n, _ in self.plan.spans]

    def targets(self, buf: Any, at: int = 0) -> list[Any]:
        """Where each span lands in `buf` (whose slabs start at byte `at`)."""
        slab = self.slab_bytes
        return [buf[at + i * slab + pre : at + i * slab + pre + n] for i, (_, n, pre) in enumerate(self.plan.spans)]

    def assemble(self, host: np.ndarray, at: int = 0) -> np.ndarray:
        """The region from the slabs in host bytes `host[at:]`: one strided copy."""
        slabs = np.asarray(host[at : at + self.nbytes]).view(self.entry.dtype)
        slabs = slabs.reshape(*self.plan.lead_shape, *self.plan.slab_shape)
        axis = self.plan.axis
        trailing = tuple(slice(s, s + n) for s, n in zip(self.start[axis + 1 :], self.shape[axis + 1 :]))
        index: tuple[Any, ...] = (Ellipsis, *trailing)
        return np.ascontiguousarray(slabs[index] if trailing else slabs)

    def strided(self, scratch: np.ndarray, tensor_at: int) -> np.ndarray:
        """The region copied out of `scratch`, which holds the tensor's bytes as the file does from byte
        `tensor_at` on (a position that may lie before the scratch: only the region's bytes must be in it)."""
        item = self.entry.dtype.itemsize
        strides = [math.prod(self.entry.shape[d + 1 :]) * item for d in range(len(self.entry.shape))]
        first = tensor_at + sum(s * st for s, st in zip(self.start, strides))
        view = np.ndarray(self.shape, dtype=self.entry.dtype, buffer=scratch, offset=first, strides=strides)
        return np.ascontiguousarray(view)


def plan_read(
    entry: TensorEntry, start: Sequence[int], shape: Sequence[int], axis: int | None = None, brick: Any = None
) -> RegionRead:
    """Plan the read of region `[start, start+shape)` of one cached tensor (ValueError when outside it); `brick`:
    its blocks, which a cold read may take instead (`read_regions`)."""
    _check(entry.shape, start, shape, f"{entry.shard}: item {entry.item} key '{entry.key}'")
    plan = plan_region(entry.shape, entry.dtype.itemsize, start, shape, axis)
    return RegionRead(entry, tuple(start), tuple(shape), plan, brick)


def read_regions(
    backend: Backend,
    reads: Sequence[RegionRead],
    allocate: Callable[[int], Any] | None = None,
    cost: CostModel | None = None,
    groups: int | None = None,
    inflight: int | None = None,
    warm: bool | None = None,
    mapped: bool = True,
    bricks: bool | None = None,
) -> list[np.ndarray]:
    """Read several planned regions (e.g. the same patch of image and label) together.

    `allocate(nbytes)` supplies the scratch buffer for the slabs (default: the backend's; PreparedDataset
    passes its pool of reused buffers, which saves the page faults of fresh memory). Warm runs go in
    `groups` sequential groups (default min(backend threads, cores)); cold runs are merged across gaps
    cheaper than a request under `cost` (default: the disk's, measured once, `loaders.reading.diskcost`) and
    read `inflight` (default COLD_INFLIGHT, at most 8 per core) at a time. Where the cache has bricks, cold
    regions come from the tensors' blocks or the tensors, whichever its first cold reads found faster
    (`diskcost.BrickTrial`; `bricks` True: always the blocks; False: never). `warm` None asks the page cache
    (cachestat); True/False forces the schedule. With `mapped`, warm regions of file backends are copied
    straight out of a read-only mapping of the shard (no syscall per run, no scratch slabs). GPU backends get
    one batch."""
    warm = None if backend.gpu else (warm if warm is not None else _resident(reads))
    # backends that read warm data through the page cache: their warm regions may come from a mapping
    if warm and mapped and backend.page_cache_reads:
        cores = min(backend.threads, os.cpu_count() or 1) if groups is None else groups
        mapped_out = [_from_mapping(r, allocate, cores) for r in reads]
        if all(a is not None for a in mapped_out):
            return mapped_out  # type: ignore[return-value]
    if warm is False:
        inflight = inflight or min(COLD_INFLIGHT, 8 * (os.cpu_count() or 1))
        cost = cost or disk_cost(backend, [r.entry.shard for r in reads], inflight, _grouped)
        trial = _trial(reads) if bricks is None else None
        from_blocks = bool(bricks) or (trial is not None and trial.pick())
        cold = [r.cold() for r in reads] if from_blocks else reads
        if trial is None or trial.chosen is not None:
            return _read_cold(backend, cold, allocate, cost, inflight)
        began = time.perf_counter()  # one of the trial's reads: timed
        out = _read_cold(backend, cold, allocate, cost, inflight)
        needed = sum(math.prod(r.shape) * r.entry.dtype.itemsize for r in reads)
        trial.record(from_blocks, time.perf_counter() - began, needed)
        return out
    offsets, buf = _scratch(backend, reads, allocate)
    requests = [q for r in reads for q in r.requests()]
    targets = [t for r, at in zip(reads, offsets) for t in r.targets(buf, at)]
    if backend.gpu:
        backend.read_into(requests, targets)
        host: Any = host_array(buf)  # a cupy array or torch CUDA tensor, copied down
    else:
        if groups is None:
            groups = min(backend.threads, os.cpu_count() or 1)
        if sum(q.nbytes for q in requests) < SEQUENTIAL_BELOW:
            groups = 1
        _grouped(backend.warm_reader(), requests, targets, groups)
        host = buf
    return [r.assemble(host, at) for r, at in zip(reads, offsets)]


def _scratch(backend: Backend, reads: Sequence[Any], allocate: Callable[[int], Any] | None) -> tuple[list[int], Any]:
    """Where each read's slabs land (aligned offsets) in one scratch buffer, and the buffer."""
    offsets = [0]
    for r in reads:
        offsets.append(offsets[-1] + align_up(r.nbytes))
    return offsets, (allocate if allocate is not None and not backend.gpu else backend.allocate)(max(offsets[-1], 1))


def _read_cold(
    backend: Backend, reads: Sequence[Any], allocate: Callable[[int], Any] | None, cost: CostModel, inflight: int
) -> list[np.ndarray]:
    """Cold regions of a host backend: their runs merged and read many at a time (`_cold`)."""
    offsets, buf = _scratch(backend, reads, allocate)
    requests = [q for r in reads for q in r.requests()]
    targets = [t for r, at in zip(reads, offsets) for t in r.targets(buf, at)]
    done = _cold(backend, reads, requests, targets, cost, inflight, allocate)
    return [d if d is not None else r.assemble(buf, at) for d, r, at in zip(done, reads, offsets)]


def _trial(reads: Sequence[RegionRead]) -> Any:
    """The bricks trial of the reads' cache (`loaders.reading.diskcost.BrickTrial`), None where it has no bricks."""
    brick = next((r.brick for r in reads if r.brick is not None), None)
    return None if brick is None else brick_trial(os.path.dirname(brick.path))


def _cold(
    backend: Backend,
    reads: Sequence[Any],
    requests: Sequence[ReadRequest],
    targets: Sequence[Any],
    cost: CostModel,
    inflight: int,
    allocate: Callable[[int], Any] | None,
) -> list[np.ndarray | None]:
    """Cold runs: widened to whole pages (O_DIRECT reads them anyway; aligned, they need no bounce buffer),
    merged across gaps cheaper than a request, read `inflight` at a time into one scratch buffer. A region
    whose runs all landed in one merged read is copied straight out of it (one strided copy, returned);
    the others' runs are copied to their targets (None returned: assemble them from the slabs)."""
    pages = [
        ReadRequest(q.path, q.offset - q.offset % ALIGN, align_up(q.offset + q.nbytes) - (q.offset - q.offset % ALIGN))
        for q in requests
    ]
    merged, places = coalesce(pages, cost.gap)
    at = [0]
    for m in merged:
        at.append(at[-1] + m.nbytes)
    scratch = (allocate or backend.allocate)(max(at[-1], 1))
    _grouped(backend, merged, [scratch[a : a + m.nbytes] for a, m in zip(at, merged)], inflight)
    where = {i: k for k, p in enumerate(places) for i in p}  # request -> its merged read
    out: list[np.ndarray | None] = []
    first = 0
    for r in reads:
        mine = range(first, first + r.count)
        first += r.count
        if hasattr(r, "gather"):  # blocks: gathered where the merged reads left them
            out.append(r.gather(scratch, [at[where[i]] + requests[i].offset - merged[where[i]].offset for i in mine]))
            continue
        ks = {where[i] for i in mine}
        if len(ks) == 1:
            k = ks.pop()
            out.append(r.strided(scratch, at[k] - (merged[k].offset - r.base)))
            continue
        out.append(None)
        for i in mine:
            q, k = requests[i], where[i]
            off = at[k] + q.offset - merged[k].offset
            targets[i][: q.nbytes] = scratch[off : off + q.nbytes]
    return out


def coalesce(requests: Sequence[ReadRequest], gap: int) -> tuple[list[ReadRequest], list[list[int]]]:
    """Merge runs of one file whose gap is at most `gap` bytes (in offset order): the merged requests and,
    for each, the indices of the runs it covers."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i].path, requests[i].offset))
    merged: list[ReadRequest] = []
    places: list[list[int]] = []
    for i in order:
        q = requests[i]
        if merged and merged[-1].path == q.path and q.offset - (merged[-1].offset + merged[-1].nbytes) <= gap:
            last = merged[-1]
            merged[-1] = ReadRequest(q.path, last.offset, max(last.nbytes, q.offset + q.nbytes - last.offset))
            places[-1].append(i)
        else:
            merged.append(q)
            places.append([i])
    return merged, places


def _grouped(backend: Backend, requests: Sequence[ReadRequest], targets: Sequence[Any], groups: int) -> None:
    """Read the requests in `groups` contiguous groups, each run after run on one thread (the first group
    on the calling thread): one handoff per group instead of one per request."""
    groups = max(1, min(groups, len(requests)))
    bounds = [len(requests) * g // groups for g in range(groups + 1)]

    def run(g: int) -> None:
        for k in range(bounds[g], bounds[g + 1]):
            backend.read_into([requests[k]], [targets[k]])  # one request: read on this thread

    futures: list[Future[None]] = [_pool(groups - 1).submit(run, g) for g in range(1, groups)] if groups > 1 else []
    try:
        run(0)
    finally:
        for f in futures:
            f.result()


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child builds its own
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The region readers' thread pool, grown to at least `workers` threads."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers < workers:
            if _POOL is not None and _POOL[0] == os.getpid():
                _POOL[1].shutdown(wait=False)  # running groups finish; new ones go to the bigger pool
            _POOL = (os.getpid(), ThreadPoolExecutor(max(workers, 4), thread_name_prefix="blockprep-region"))
        return _POOL[1]


def _resident(reads: Sequence[RegionRead], samples: int = 3) -> bool:
    """True when the page cache holds the reads' bytes, judged by `samples` spans of each (first, middle,
    last; cachestat(2), no I/O): probing a whole 25 MB range costs as much as a tenth of the warm read.
    Where the kernel cannot say, reads are treated as warm (grouped), the right guess for buffered reads."""
    probe = _probe()
    if not probe.available:
        return True
    for r in reads:
        spans = r.plan.spans
        picks = {spans[k * (len(spans) - 1) // max(samples - 1, 1)] for k in range(samples)}
        try:
            fd = open_read(r.entry.shard)
        except OSError:
            return True  # the backend names the missing file
        try:
            for off, n, _ in picks:
                lo = r.entry.offset + off
                if not probe.resident(fd, lo - lo % 4096, n + lo % 4096):
                    return False
        finally:
            os.close(fd)
    return True


_MAPS: dict[str, tuple[int, tuple[int, int, int], np.ndarray]] = {}  # path -> (pid, identity, bytes)
_MAPS_KEEP = 64


def _mapping(path: str) -> np.ndarray | None:
    """The whole file as a read-only uint8 array over a shared mapping (kept per process; remapped when the
    file's inode, size or mtime changed); None when it cannot be mapped."""
    import mmap

    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = (st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _MAPS.get(path)
    if hit is not None and hit[0] == os.getpid() and hit[1] == ident:
        return hit[2]
    if st.st_size == 0 or not safe_to_map(st):  # another user could truncate it under the mapping: SIGBUS
        return None
    try:
        fd = open_read(path)
        try:
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    if len(_MAPS) >= _MAPS_KEEP:
        _MAPS.clear()  # dropped mappings are unmapped when no copy is in progress over them
    arr = np.frombuffer(mm, dtype=np.uint8)
    _MAPS[path] = (os.getpid(), ident, arr)
    return arr


def _from_mapping(r: RegionRead, allocate: Callable[[int], Any] | None, groups: int) -> np.ndarray | None:
    """The region copied out of the shard's mapping (strided copies from the page cache, split along the
    region's first axis over `groups` threads: numpy copies run without the GIL), or None when the file is
    not mappable or is shorter than the index says (the backend path then names the error; touching a
    mapped page past the end of a file would be SIGBUS, not an exception). The result lands in
    `allocate(nbytes)` memory when given (reused, already faulted-in pages)."""
    arr = _mapping(r.entry.shard)
    if arr is None or len(arr) < r.entry.offset + r.entry.nbytes:
        return None
    full = arr[r.entry.offset : r.entry.offset + r.entry.nbytes].view(r.entry.dtype).reshape(r.entry.shape)
    src = full[tuple(slice(s, s + n) for s, n in zip(r.start, r.shape))]
    nbytes = src.size * src.itemsize
    if allocate is None:
        out = np.empty(r.shape, dtype=r.entry.dtype)
    else:
        out = np.asarray(allocate(max(nbytes, 1)))[:nbytes].view(r.entry.dtype).reshape(r.shape)
    axis = next((d for d, n in enumerate(r.shape) if n > 1), 0)
    groups = max(1, min(groups, r.shape[axis] if r.shape else 1, nbytes // SEQUENTIAL_BELOW))
    cuts = [r.shape[axis] * g // groups for g in range(groups + 1)] if r.shape else [0, 0]

    def part(g: int) -> None:
        index = (slice(None),) * axis + (slice(cuts[g], cuts[g + 1]),)
        np.copyto(out[index], src[index])

    if groups == 1:
        np.copyto(out, src)
    else:
        futures = [_pool(groups - 1).submit(part, g) for g in range(1, groups)]
        try:
            part(0)
        finally:
            for f in futures:
                f.result()
    return out


_PROBE: Any = None  # one PageCacheProbe (its libc handle) for the process


def _probe() -> Any:
    """The process's page-cache probe (built on first use)."""
    global _PROBE
    if _PROBE is None:
        _PROBE = PageCacheProbe()
    return _PROBE


def read_region_entry(
    backend: Backend,
    entry: TensorEntry,
    start: Sequence[int],
    shape: Sequence[int],
    axis: int | None = None,
    allocate: Callable[[int], Any] | None = None,
) -> np.ndarray:
    """Read region `[start, start+shape)` of one cached tensor; equals `full[tuple(slices)]` exactly."""
    return read_regions(backend, [plan_read(entry, start, shape, axis)], allocate)[0]
