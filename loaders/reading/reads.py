"""Reader: the one way a prepared cache's tensors, or regions of them, become bytes in a buffer and tensors.

    >>> reader = Reader(cache, ["image", "label"], backend="auto", device="cpu")   # doctest: +SKIP
    >>> got = reader.fetch(reader.plan([3, 7]))                                   # one backend call
    >>> flat = reader.upload(got)                                                 # one uint8 tensor

A `Reader` is built with `(cache, keys, backend, device)` and owns its backends and its staging (reused
host buffers, pinned slots: `loaders.reading.staging`). `plan(items, windows=None)` says which bytes to read and
where each tensor lands in one buffer: whole tensors (item- or key-major; one item alone merged into runs
when small, cut into pieces when large) or, with `windows`, the regions of them (`loaders.reading.region`).
`fetch(plan, into)` reads a plan with one backend call into `into` (a pinned slot) or the reader's own
memory, verifies whole tensors' checksums (`verify`), and names the item and key behind a short read.
Every reader of a cache reads through one: `PreparedDataset` (and so the MONAI drop-in and DALI's
`CacheSource`), `iter_batches`/`PreparedBatches`, `PreparedLoader`.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loaders.backends import Backend, ReadRequest, get_backend
from loaders.backends.base import aligned_empty
from loaders.cache.dtypes import to_tensor
from loaders.cache.format import PreparedCache, TensorEntry, check
from loaders.cache.spec import align_up
from loaders.errors import BackendError
from loaders.machine import available_memory
from loaders.reading.region import RegionRead, plan_read, read_regions
from loaders.reading.staging import BufferPool, Place, Slot, host_array, upload
from loaders.tunables import INLINE_BYTES, PLAN_CACHE, SPLIT_BYTES

Window = tuple[Sequence[int], Sequence[int]]  # (start, shape) over a tensor's trailing dims


@dataclass
class ReadPlan:
    """What one fetch reads and where it lands. Whole tensors: `tensors` (tag, entry, byte offset), read as
    `requests` into `places` ([start, end) of the buffer; merged or cut as the plan's options said), `small`:
    through `Backend.read_small`. Regions: `regions` (tag, RegionRead); `packed`: all landing in one buffer."""

    tensors: list[tuple[Any, TensorEntry, int]]
    nbytes: int
    requests: list[ReadRequest]
    places: list[tuple[int, int]]
    small: bool = False
    regions: list[tuple[Any, RegionRead]] = field(default_factory=list)
    packed: bool = False

    @property
    def entries(self) -> list[TensorEntry]:
        """Every tensor the plan touches."""
        return [e for _, e, _ in self.tensors] + [r.entry for _, r in self.regions]


@dataclass
class Fetched:
    """A fetched plan: its buffer (host, pinned `slot` or a device buffer) and where each tensor lies in it;
    unpacked regions come as one array each (`arrays`)."""

    plan: ReadPlan
    buf: Any
    nbytes: int
    on_device: bool
    slot: Slot | None = None
    region_places: list[Place] | None = None
    arrays: list[np.ndarray] | None = None

    @property
    def places(self) -> list[Place]:
        """(tag, key, byte offset, dtype, shape) of every tensor in the buffer, in buffer order."""
        if self.region_places is not None:
            return self.region_places
        return [(t, e.key, o, e.dtype, tuple(e.shape)) for t, e, o in self.plan.tensors]


def fits_in_memory(nbytes: int, share: float = 0.5) -> bool:
    """True when `nbytes` is at most `share` of the memory this process could still allocate (MemAvailable, or
    a cgroup's headroom when that is less: `loaders.machine.available_memory`).

    A cache that fits is read buffered on CPU (`auto` -> posix): the first epoch fills the page cache and
    later epochs are memory copies. O_DIRECT (`direct`) never fills it, so every epoch would go to the
    device: it is for caches larger than memory, where the page cache would only thrash."""
    return nbytes <= share * available_memory()


def short_read(root: Any, entries: Sequence[TensorEntry], exc: BackendError) -> BackendError:
    """A backend's failure on a cache read, with the item and key behind a short read named: the first entry
    its shard no longer holds (else the backend's words, after the cache's folder)."""
    sizes: dict[str, int] = {}
    for e in entries:
        if e.shard not in sizes:
            try:
                sizes[e.shard] = os.stat(e.shard).st_size
            except OSError:
                sizes[e.shard] = -1
        if sizes[e.shard] < e.offset + e.nbytes:
            return BackendError(
                f"{e.shard}: short read for item {e.item} key '{e.key}' (shard is {sizes[e.shard]} bytes, "
                f"the index needs {e.offset + e.nbytes}); the shard was truncated: rebuild with `prep cache`"
            )
    return BackendError(f"{root}: {exc}")


def _split(requests: list[ReadRequest], places: list[tuple[int, int]], pieces: int) -> tuple[list, list]:
    """Cut requests into about `pieces` aligned pieces of at least SPLIT_BYTES (more copies in flight)."""
    total = sum(r.nbytes for r in requests)
    step = max(SPLIT_BYTES, align_up(-(-total // max(pieces, 1))))
    out_r: list[ReadRequest] = []
    out_p: list[tuple[int, int]] = []
    for r, (at, _) in zip(requests, places):
        for off in range(0, r.nbytes, step):
            n = min(step, r.nbytes - off)
            out_r.append(ReadRequest(r.path, r.offset + off, n))
            out_p.append((at + off, at + off + n))
    return out_r, out_p


def _merge(requests: list[ReadRequest], places: list[tuple[int, int]]) -> tuple[list, list]:
    """Merge requests whose file gap equals their buffer gap (the cache writes an item's tensors at aligned
    offsets, as the buffer lays them out): one pread fills both, the gap's bytes land in the padding."""
    out: list[ReadRequest] = []
    at: list[tuple[int, int]] = []
    for r, (a, b) in zip(requests, places):
        if out:
            last, (la, _) = out[-1], at[-1]
            if r.path == last.path and r.offset - last.offset == a - la and a >= la + last.nbytes:
                out[-1] = ReadRequest(last.path, last.offset, r.offset + r.nbytes - last.offset)
                at[-1] = (la, b)
                continue
        out.append(r)
        at.append((a, b))
    return out, at


def _region_of(entry: TensorEntry, window: Window | None, bricks: Any = None) -> RegionRead:
    """`window` over `entry`'s trailing dims (its leading ones whole); None, or more dims than it has: whole.
    `bricks`: the cache's (`PreparedCache.bricks`), read instead where the region is cold."""
    brick = None if bricks is None or entry.row < 0 else bricks.of(entry)
    if window is None or len(window[0]) > len(entry.shape):
        return plan_read(entry, [0] * len(entry.shape), list(entry.shape), brick=brick)
    lead = len(entry.shape) - len(window[0])
    return plan_read(entry, [0] * lead + list(window[0]), list(entry.shape[:lead]) + list(window[1]), brick=brick)


class Reader:
    """Reads tensors of `keys` of a prepared cache through `backend` for `device` (see module doc).

    backend: a name or a Backend (built on first use). "auto": with `host_auto`, a host backend whose reads
    a GPU gets through pinned staging (PreparedLoader); else the buffered `posix` on the CPU when the cache
    fits in memory, O_DIRECT beyond (PreparedDataset). pooled: reuse host buffers (`BufferPool`; else a
    fresh one per read). copy_threads: threads copying warm regions (`read_regions`' groups). Pickles
    without its threads, buffers and descriptors, and rebuilds them in a forked child."""

    def __init__(
        self,
        cache: PreparedCache,
        keys: Sequence[str],
        backend: str | Backend = "auto",
        device: str = "cpu",
        *,
        verify: bool = False,
        backend_options: Mapping[str, Any] | None = None,
        pooled: bool = True,
        host_auto: bool = False,
        copy_threads: int | None = None,
    ) -> None:
        self.cache = cache
        self.keys = list(keys)
        self.device = str(device)
        self.gpu = self.device.startswith("cuda")
        self.verify = verify
        self.pooled, self.host_auto, self.copy_threads = pooled, host_auto, copy_threads
        self._spec = backend
        self._options = dict(backend_options or {})
        self._backend: Backend | None = backend if isinstance(backend, Backend) else None
        self._region_backend: Backend | None = None
        self._rank = {k: i for i, k in enumerate(self.keys)}
        self._entries: dict[int, list[TensorEntry]] = {}
        self._fresh()

    def _fresh(self) -> None:
        """Process-local state: made on build, after unpickling and in a forked child."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool: BufferPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(cache=None, _local=None, _lock=None, _pool=None, _region_backend=None, _entries={})
        state["_root"] = self.cache.root
        if not isinstance(self._spec, Backend):
            state["_backend"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        root = state.pop("_root")
        self.__dict__.update(state)
        self.cache = PreparedCache(root)
        self._fresh()

    def _after_fork(self) -> None:
        # A forked DataLoader worker inherits the reader without pickling: the backend's thread pool has no
        # threads in the child (a submit would wait forever) and locks may be held. Rebuild them here.
        if self._pid == os.getpid():
            return
        self._fresh()
        if self._backend is not None:
            self._backend = pickle.loads(pickle.dumps(self._backend))  # Backend.__getstate__ drops the pool
        self._region_backend = None

    # --- backends ---
    @property
    def backend(self) -> Backend:
        """The backend this process reads through (built on first use)."""
        self._after_fork()
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._build()
        return self._backend

    def _build(self) -> Backend:
        name = self._spec if isinstance(self._spec, str) else "auto"
        if self.host_auto:  # reads land in pinned staging and go up with one async copy, as regions must
            return get_backend(name, device="cpu" if name == "auto" else self.device, **self._options)
        if name == "auto" and not self.gpu and not self._options:
            name = "posix" if fits_in_memory(int(self.cache.index["nbytes"].sum())) else "auto"
        return get_backend(name, device=self.device, **self._options)

    @property
    def region_backend(self) -> Backend:
        """The backend packed regions are read through: a host one (regions are assembled in host memory)."""
        if not self.backend.gpu:
            return self.backend
        if self._region_backend is None:
            self._region_backend = get_backend("auto", device="cpu")
        return self._region_backend

    def close(self) -> None:
        """Release the backends' threads and descriptors."""
        for backend in {id(b): b for b in (self._backend, self._region_backend) if b is not None}.values():
            backend.close()

    # --- staging ---
    @property
    def staged(self) -> bool:
        """True when host reads go to the GPU through pinned slots."""
        return self.gpu and not self.backend.gpu

    def stager(self, slots: int) -> Any:
        """A new `loaders.reading.staging.PinnedStager` of `slots` pinned slots on this reader's device."""
        from loaders.reading.staging import PinnedStager

        return PinnedStager(self.device, slots=slots)

    def thread_slot(self) -> Slot:
        """This thread's one pinned slot for item reads (threads of a ThreadDataLoader each get their own)."""
        self._after_fork()
        stager = getattr(self._local, "stager", None)
        if stager is None:
            stager = self._local.stager = self.stager(1)
        return Slot(stager, 0)

    def pool(self) -> BufferPool:
        """The reused host read buffers of this process."""
        self._after_fork()
        if self._pool is None:
            backend = self.backend  # built outside the lock (it takes the same lock)
            with self._lock:
                if self._pool is None:
                    self._pool = BufferPool(backend.allocate)
        return self._pool

    def _buffer(self, backend: Backend, nbytes: int, into: Slot | None) -> Any:
        if into is not None and not backend.gpu:
            return into.host(nbytes)
        if self.pooled and not backend.gpu:
            return self.pool().get(nbytes)
        return backend.allocate(max(nbytes, 1))

    def upload(self, got: Fetched) -> Any:
        """The fetched bytes as one flat uint8 tensor on the device (`loaders.reading.staging.upload`)."""
        return upload(got.buf, got.nbytes, got.slot, got.on_device, self.device)

    def region_tensors(self, got: Fetched) -> list[Any]:
        """Unpacked regions as tensors on the device."""
        tensors = [to_tensor(a) for a in got.arrays or []]
        return [t.to(self.device, non_blocking=True) for t in tensors] if self.gpu else tensors

    # --- plans ---
    def entries(self, item: int) -> list[TensorEntry]:
        """The tensors of `item` this reader reads, in key order."""
        got = self._entries.get(item)
        if got is None:
            rank = self._rank
            got = sorted((e for e in self.cache.entries(item) if e.key in rank), key=lambda e: rank[e.key])
            if len(self._entries) >= PLAN_CACHE:
                self._entries.clear()
            self._entries[item] = got
        return got

    def nbytes(self, item: int) -> int:
        """Bytes of `item`'s tensors."""
        return sum(e.nbytes for e in self.entries(item))

    def plan(
        self,
        items: Sequence[int],
        windows: Sequence[Window | None] | None = None,
        *,
        keys: Sequence[str] | None = None,
        tags: Sequence[Any] | None = None,
        key_major: bool = True,
        alone: bool = False,
        packed: bool = False,
    ) -> ReadPlan:
        """What to read of `items` (of `keys`, default all), each tensor tagged by its item's `tags` entry
        (default the item). Whole tensors laid out key-major (a key's tensors back to back: one batch view)
        or item-major, at aligned offsets; `alone` (one item): merged into runs up to INLINE_BYTES (read on
        the calling thread), else cut into pieces for the backend's threads. `windows` (one per item, None:
        whole): regions instead; `packed`: into one buffer (the fetch says where each lies), else one array
        each."""
        tags = list(items) if tags is None else list(tags)
        wanted = None if keys is None else set(keys)
        if windows is not None:
            return self._plan_regions(items, windows, tags, wanted, key_major, packed)
        per = [[e for e in self.entries(i) if wanted is None or e.key in wanted] for i in items]
        if key_major:
            order = [(t, e) for k in self.keys for t, ents in zip(tags, per) for e in ents if e.key == k]
        else:
            order = [(t, e) for t, ents in zip(tags, per) for e in ents]
        tensors, requests, places, pos = [], [], [], 0
        for t, e in order:
            tensors.append((t, e, pos))
            requests.append(ReadRequest(e.shard, e.offset, e.nbytes))
            places.append((pos, pos + e.nbytes))
            pos += align_up(e.nbytes)
        plan = ReadPlan(tensors, pos, requests, places)
        if alone and pos <= INLINE_BYTES:  # small: one pread per run, on the calling thread where it can
            plan.requests, plan.places = _merge(requests, places)
            plan.small = True
        elif alone and len(requests) < getattr(self.backend, "threads", 1) and not self.backend.gpu:
            plan.requests, plan.places = _split(requests, places, self.backend.threads)
        return plan

    def _plan_regions(
        self,
        items: Sequence[int],
        windows: Sequence[Window | None],
        tags: list[Any],
        wanted: set[str] | None,
        key_major: bool,
        packed: bool,
    ) -> ReadPlan:
        regions: list[tuple[Any, RegionRead]] = []
        bricks = self.cache.bricks
        if key_major:  # each key's regions side by side: one batch view
            for key in self.keys if wanted is None else [k for k in self.keys if k in wanted]:
                for t, item, w in zip(tags, items, windows):
                    regions += [(t, _region_of(e, w, bricks)) for e in self.entries(item) if e.key == key]
        else:  # per item, in the cache's order of its tensors
            for t, item, w in zip(tags, items, windows):
                ents = [e for e in self.cache.entries(item) if e.key in self._rank]
                regions += [(t, _region_of(e, w, bricks)) for e in ents if wanted is None or e.key in wanted]
        nbytes = sum(align_up(math.prod(r.shape) * r.entry.dtype.itemsize) for _, r in regions)
        return ReadPlan([], nbytes, [], [], regions=regions, packed=packed)

    # --- fetch ---
    def fetch(self, plan: ReadPlan, into: Slot | None = None, per_tensor: bool = False) -> Fetched:
        """Read `plan` with one backend call into `into` (a pinned slot, for a host backend feeding a GPU) or
        the reader's own memory; verify whole tensors (`verify`); a short read names its item and key.
        per_tensor: one call per tensor instead (DataLoader worker processes, where the workers are the
        parallelism: a warm read is then a copy on the calling thread)."""
        try:
            if plan.regions:
                return self._fetch_regions(plan, into)
            backend = self.backend
            buf = self._buffer(backend, plan.nbytes, into)
            if plan.small:
                backend.read_small(plan.requests, [buf[a:b] for a, b in plan.places])
            elif per_tensor:
                for _, e, at in plan.tensors:
                    backend.read_into([ReadRequest(e.shard, e.offset, e.nbytes)], [buf[at : at + e.nbytes]])
            else:
                backend.read_into(plan.requests, [buf[a:b] for a, b in plan.places])
        except BackendError as exc:
            raise short_read(self.cache.root, plan.entries, exc) from exc
        if self.verify:
            for _, e, at in plan.tensors:
                check(e, host_array(buf[at : at + e.nbytes]))
        return Fetched(plan, buf, plan.nbytes, backend.gpu, into if self.gpu and not backend.gpu else None)

    def mapped(self, plan: ReadPlan) -> list[np.ndarray] | None:
        """The whole tensors of `plan` (in `plan.tensors` order) as copy-on-write mappings of their bytes
        (`PosixBackend.mapped`: nothing copied, only the pages touched come in), or None where this reader does
        not read buffered on the host (another backend, a GPU, checksums to verify, regions) or a shard is
        short: then `fetch` reads them."""
        backend = self.backend
        if self.verify or self.gpu or plan.regions or not hasattr(backend, "mapped"):
            return None
        return backend.mapped([ReadRequest(e.shard, e.offset, e.nbytes) for _, e, _ in plan.tensors])

    def _fetch_regions(self, plan: ReadPlan, into: Slot | None) -> Fetched:
        reads = [r for _, r in plan.regions]
        if not plan.packed:
            allocate = self.pool().get if self.pooled else None
            arrays = read_regions(self.backend, reads, allocate=allocate)
            return Fetched(plan, None, 0, False, arrays=arrays)
        total = plan.nbytes
        backend = self.region_backend
        buf = self._buffer(backend, 2 * total, into)  # regions land in the first half; the second takes copies
        base = buf.ctypes.data
        cursor = [0]

        def allocate_in(nbytes: int) -> Any:
            at = cursor[0]
            if at + nbytes > total:  # scratch slabs of cold reads: ordinary memory
                return aligned_empty(nbytes)
            cursor[0] = at + align_up(nbytes)
            return buf[at : at + nbytes]

        arrays = read_regions(backend, reads, allocate=allocate_in, groups=self.copy_threads)
        places: list[Place] = []
        spare, end = total, 0
        for (tag, read), a in zip(plan.regions, arrays):
            at = a.ctypes.data - base
            if not (0 <= at < total and a.flags.c_contiguous):  # not in the buffer: one copy into it
                at, spare = spare, spare + align_up(a.nbytes)
                np.asarray(buf[at : at + a.nbytes]).view(a.dtype).reshape(a.shape)[...] = a
            places.append((tag, read.entry.key, at, a.dtype, tuple(a.shape)))
            end = max(end, at + a.nbytes)
        return Fetched(plan, buf, end, False, into if self.gpu else None, region_places=places)
