"""PreparedDataset: a map-style torch Dataset over a prepared cache, with a prefetching batch reader.

    >>> ds = PreparedDataset("cache/", backend="auto")            # doctest: +SKIP
    >>> ds[0]["image"].shape, ds[0]["image"].affine              # MetaTensor when MONAI is installed
    >>> for batch in ds.iter_batches(8, prefetch=2): ...         # many requests in flight per batch

`import loaders.dataset` imports no torch: the class is built (as a torch Dataset subclass) on first use of
the name `PreparedDataset`. Every read of an item or a batch is one backend call: all tensors of all items
in flight together, landing at aligned offsets of one buffer; tensors are zero-copy views of it.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loaders._deps import has, require
from loaders.backends import Backend, ReadRequest, get_backend
from loaders.errors import BackendError
from loaders.format import PreparedCache, TensorEntry, align_up, check, unflatten
from loaders.monai import from_template, meta_template
from loaders.region import RegionRead, plan_read, read_regions

# Requests of an item read alone are cut into pieces of at least this many bytes when the item has fewer
# tensors than the backend has threads: a warm read is a memory copy, and one core copies ~10 GB/s.
SPLIT_BYTES = 2 << 20
# Items whose read plan and meta are kept (immutable for a committed cache); beyond it the cache restarts.
PLAN_CACHE = 1 << 16

# (start, shape) over the trailing dims, or a callable (item, {key: shape}) -> (start, shape) | None
Roi = tuple[Sequence[int], Sequence[int]] | Callable[[int, dict[str, tuple[int, ...]]], Any]


class _BufferPool:
    """Reuses host read buffers once nothing references them any more (tensors are views of them).

    Fresh memory costs a page fault and zeroing per 4 KiB on first touch, as much as the copy from the page
    cache itself; reusing faulted-in buffers is what lets a warm read run at memory speed. A buffer is free
    when the reference counts of it and of its owning array are back to what they were at allocation: no
    view, tensor or pending batch holds it."""

    def __init__(self, allocate: Callable[[int], Any], keep: int = 8) -> None:
        self._allocate = allocate
        self._keep = keep
        self._bufs: list[list[Any]] = []  # [buffer, owning array, reference counts when free]
        self._lock = threading.Lock()

    @staticmethod
    def _counts(entry: list[Any]) -> tuple[int, int]:
        return sys.getrefcount(entry[0]), sys.getrefcount(entry[1])

    def get(self, nbytes: int) -> np.ndarray:
        """A host uint8 buffer of at least `nbytes` (aligned as the backend allocates)."""
        with self._lock:
            # No local names for buffers here or below: the counts must be taken in the same state.
            for entry in self._bufs:
                if nbytes <= entry[0].nbytes <= 2 * nbytes + 65536 and self._counts(entry) == entry[2]:
                    return entry[0]  # type: ignore[no-any-return]
            entry = [self._allocate(nbytes), None, None]
            entry[1] = entry[0].base if isinstance(entry[0].base, np.ndarray) else entry[0]
            self._bufs.append(entry)
            entry[2] = self._counts(entry)
            if len(self._bufs) > self._keep:  # forget the oldest (freed when its last view goes)
                del self._bufs[0]
            return entry[0]  # type: ignore[no-any-return]


@dataclass
class _Batch:
    """One backend call's result: entries per item and the buffer they were read into."""

    items: list[int]
    entries: list[list[TensorEntry]]
    offsets: list[list[int]]  # byte offset of each entry in `buffer`
    buffer: Any  # host numpy uint8 (possibly pinned) or a device array
    nbytes: int
    stager: Any = None  # PinnedStager when staged to the GPU through pinned memory
    slot: int = -1  # its slot


@dataclass
class _ItemPlan:
    """Everything about reading one item alone that does not change: requests (split into pieces) and
    where each lands, where each tensor sits, and its meta made ready for MetaTensors."""

    entries: list[TensorEntry]
    offsets: list[int]  # byte offset of each entry in the buffer
    requests: list[ReadRequest]
    places: list[tuple[int, int]]  # [start, end) of each request in the buffer
    nbytes: int
    views: list[tuple[str, int, int, Any, tuple[int, ...]]]  # key, offset, nbytes, torch dtype, shape
    templates: dict[str, Any] | None = None  # key -> MetaTensor template (built on first use)
    values: str | None = None  # JSON of the head's non-tensor outputs (parsed per item: each gets its own)


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


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy dtype the cache stores."""
    import torch

    return {
        "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "uint16": torch.uint16,
        "int16": torch.int16, "uint32": torch.uint32, "int32": torch.int32, "uint64": torch.uint64,
        "int64": torch.int64, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    }[np.dtype(dtype).name]  # fmt: skip


class _DatasetCore:
    """Map-style dataset over a prepared cache: `ds[i]` is a dict of tensors (MetaTensors with MONAI).

    cache_dir: a committed cache. keys: which tensors (default all). backend: a name ("auto", "posix",
    "direct", "kvikio", ...) or a Backend. device: "cpu" or "cuda:N" (kvikio reads into GPU memory; host
    backends stage through pinned memory). verify: check xxh3 of every tensor read. transform: applied to
    each item (or batch, in iter_batches). roi: read only a region (see README). meta: restore MetaTensors.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        backend: str | Backend = "auto",
        device: str = "cpu",
        verify: bool = False,
        transform: Callable[[Any], Any] | None = None,
        roi: Roi | None = None,
        meta: bool = True,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.root = Path(cache_dir)
        self.cache = PreparedCache(self.root)
        known = self.cache.keys
        self.keys = list(keys) if keys is not None else list(known)
        self._all_keys = keys is None
        missing = [k for k in self.keys if k not in known]
        if missing:
            raise KeyError(f"{self.root}: keys {missing} are not in the cache (it has {known})")
        self.device = str(device)
        self.verify = verify
        self.transform = transform
        self.roi = roi
        self.meta = meta and has("monai")
        self.items = np.arange(len(self.cache), dtype=np.int64)
        self._backend_spec = backend
        self._backend_options = dict(backend_options or {})
        self._backend: Backend | None = backend if isinstance(backend, Backend) else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._plans: dict[int, _ItemPlan] = {}  # item -> its read plan (the cache is immutable)

    # --- process-local state (rebuilt after pickling into DataLoader workers) ---
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(cache=None, _local=None, _lock=None, _buffers=None, _plans={})
        if not isinstance(self._backend_spec, Backend):
            state["_backend"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.cache = PreparedCache(self.root)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        # A forked DataLoader worker inherits the dataset without pickling: the backend's thread pool has
        # no threads in the child (a submit would wait forever) and locks may be held. Rebuild them here.
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._local = threading.local()
        self.__dict__["_buffers"] = None
        if self._backend is not None:
            self._backend = pickle.loads(pickle.dumps(self._backend))  # Backend.__getstate__ drops the pool

    @property
    def backend(self) -> Backend:
        """The backend this process reads through (built on first use)."""
        self._after_fork()
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    name = self._backend_spec if isinstance(self._backend_spec, str) else "auto"
                    self._backend = get_backend(name, device=self.device, **self._backend_options)
        return self._backend

    @property
    def on_gpu(self) -> bool:
        """True when items are delivered to a GPU."""
        return self.device.startswith("cuda")

    def close(self) -> None:
        """Release the backend's threads and descriptors."""
        if self._backend is not None:
            self._backend.close()

    def __len__(self) -> int:
        return len(self.items)

    # --- views ---
    def _view(self, items: np.ndarray) -> Any:
        view = self.__class__.__new__(self.__class__)
        view.__dict__.update(self.__dict__)
        view.items = np.asarray(items, dtype=np.int64)
        view._local = threading.local()
        return view

    def shard(self, rank: int, world_size: int, contiguous: bool = False, even: bool = True) -> Any:
        """The part of this dataset for DDP rank `rank` of `world_size`: strided (default) or contiguous.

        even=True pads by wrapping around so every rank gets the same count (as DistributedSampler does);
        otherwise DDP ranks would step a different number of times and hang."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        items = self.items
        per = -(-len(items) // world_size)
        if even and len(items):
            items = np.resize(items, per * world_size)  # np.resize repeats from the start
        if contiguous:
            return self._view(items[rank * per : (rank + 1) * per])
        return self._view(items[rank::world_size])

    def subset(self, indices: Sequence[int] | np.ndarray) -> Any:
        """A view over positions `indices` of this dataset."""
        return self._view(self.items[np.asarray(indices, dtype=np.int64)])

    # --- reading ---
    def _read(self, items: Sequence[int], stager: Any = None, slot: int = -1) -> _Batch:
        """One backend call for every selected tensor of `items`, into one buffer at aligned offsets.

        Key-major layout (all items' "image", then all "label"): a key's tensors of equal aligned size sit
        back to back, so a batch of them is a zero-copy view."""
        entries = [[e for e in self.cache.entries(int(i)) if e.key in self.keys] for i in items]
        offsets: list[list[int]] = [[0] * len(ents) for ents in entries]
        requests: list[ReadRequest] = []
        places: list[tuple[int, int]] = []
        pos = 0
        for key in self.keys:
            for ii, ents in enumerate(entries):
                for ei, e in enumerate(ents):
                    if e.key == key:
                        offsets[ii][ei] = pos
                        requests.append(ReadRequest(e.shard, e.offset, e.nbytes))
                        places.append((ii, ei))
                        pos += align_up(e.nbytes)
        backend = self.backend
        if stager is not None:
            buf = stager.host(slot, pos)
        elif backend.gpu:
            buf = backend.allocate(pos)
        else:
            buf = self._pool().get(pos)
        targets = [buf[offsets[ii][ei] : offsets[ii][ei] + r.nbytes] for (ii, ei), r in zip(places, requests)]
        try:
            backend.read_into(requests, targets)
        except BackendError as exc:
            raise _name_short_read(entries, exc) from exc
        batch = _Batch(list(map(int, items)), entries, offsets, buf, pos, stager, slot)
        if self.verify:
            self._verify(batch)
        return batch

    def _verify(self, batch: _Batch) -> None:
        for ents, offs in zip(batch.entries, batch.offsets):
            for e, o in zip(ents, offs):
                data = batch.buffer[o : o + e.nbytes]
                if self.backend.gpu:
                    data = data.get() if hasattr(data, "get") else np.asarray(data.cpu())
                check(e, np.asarray(data))

    def _pool(self) -> _BufferPool:
        self._after_fork()
        pool = self.__dict__.get("_buffers")
        if pool is None:
            backend = self.backend  # built outside the lock (it takes the same lock)
            with self._lock:
                pool = self.__dict__.get("_buffers")
                if pool is None:
                    pool = self.__dict__["_buffers"] = _BufferPool(backend.allocate)
        return pool  # type: ignore[no-any-return]

    def _stager(self) -> Any:
        """This thread's pinned stager for item reads (threads of a ThreadDataLoader each get their own)."""
        self._after_fork()
        stager = getattr(self._local, "stager", None)
        if stager is None:
            from loaders.gpu import PinnedStager

            stager = PinnedStager(self.device, slots=1)
            self._local.stager = stager
        return stager

    def _staged(self) -> bool:
        """True when host reads are staged through pinned memory to the GPU."""
        return self.on_gpu and not self.backend.gpu

    def _flat_tensor(self, batch: _Batch) -> Any:
        """The batch buffer as one uint8 torch tensor on the target device (one H2D copy when staged)."""
        import torch

        if batch.stager is not None:
            return batch.stager.upload(batch.slot, batch.nbytes)
        if self.backend.gpu:
            return torch.as_tensor(batch.buffer[: batch.nbytes], device=self.device)
        return torch.from_numpy(batch.buffer[: batch.nbytes])

    def _tensor(self, flat: Any, entry: TensorEntry, offset: int) -> Any:
        view = flat[offset : offset + entry.nbytes]
        return view.view(torch_dtype(entry.dtype)).reshape(entry.shape)

    def _item_meta(self, item: int) -> dict[str, Any]:
        """The item's meta line: {"meta": {key: MetaTensor meta}, "applied_operations": {key: [...]},
        "values": {key: non-tensor output}, "source": datalist entry}."""
        return dict(self.cache.meta(item) or {})

    def _plan(self, item: int) -> _ItemPlan:
        """The item's read plan, built once (entries, requests, views; its meta when first wrapped)."""
        plan = self._plans.get(item)
        if plan is not None:
            return plan
        entries = [e for e in self.cache.entries(item) if e.key in self.keys]
        entries.sort(key=lambda e: self.keys.index(e.key))  # key-major, as batches lay them out
        offsets, requests, places, pos = [], [], [], 0
        for e in entries:
            offsets.append(pos)
            requests.append(ReadRequest(e.shard, e.offset, e.nbytes))
            places.append((pos, pos + e.nbytes))
            pos += align_up(e.nbytes)
        threads = getattr(self.backend, "threads", 1)
        if len(requests) < threads and not self.backend.gpu:
            requests, places = _split(requests, places, threads)
        views = [(e.key, o, e.nbytes, torch_dtype(e.dtype), tuple(e.shape)) for e, o in zip(entries, offsets)]
        plan = _ItemPlan(entries, offsets, requests, places, pos, views)
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[item] = plan
        return plan

    def _load_meta(self, item: int, plan: _ItemPlan) -> None:
        """Read the item's meta line once: MetaTensor templates (when meta) and its non-tensor values."""
        line = self._item_meta(item)
        if self.meta and plan.templates is None:
            metas = line.get("meta") or {}
            all_ops = line.get("applied_operations") or {}
            templates = {}
            for key, _, _, _, shape in plan.views:
                meta = dict(metas.get(key, metas.get(key.split("/")[0])) or {})
                if all_ops.get(key) is not None:
                    meta["applied_operations"] = all_ops[key]
                templates[key] = meta_template(meta, len(shape))
            plan.templates = templates
        plan.values = json.dumps(line.get("values") or {})

    def _assemble(self, item: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """Tensors (+ stored non-tensor outputs) -> the item's nested dict, MetaTensors restored."""
        plan = self._plan(item)
        if plan.values is None or (self.meta and plan.templates is None):
            self._load_meta(item, plan)
        flat = tensors
        if self.meta and plan.templates:
            flat = {k: from_template(t, plan.templates[k]) if k in plan.templates else t for k, t in tensors.items()}
        if self._all_keys and plan.values != "{}":  # non-tensor outputs of the head come back as they were
            flat.update(json.loads(plan.values or "{}"))
        return unflatten(flat)

    def _read_item(self, item: int) -> dict[str, Any]:
        """One item into a reused host buffer with one backend call: {key: tensor view of the buffer}."""
        import torch

        plan = self._plan(item)
        buf = self._pool().get(plan.nbytes)
        try:
            self.backend.read_into(plan.requests, [buf[a:b] for a, b in plan.places])
        except BackendError as exc:
            raise _name_short_read([plan.entries], exc) from exc
        if self.verify:
            self._verify(_Batch([item], [plan.entries], [plan.offsets], buf, plan.nbytes))
        flat = torch.from_numpy(buf[: plan.nbytes])
        return {k: flat[o : o + n].view(dt).reshape(shape) for k, o, n, dt, shape in plan.views}

    def __getitem__(self, index: int) -> Any:
        item = int(self.items[index])
        if self.roi is not None:
            flat = self._read_roi(item)
        elif self._staged() or self.backend.gpu:
            batch = self._read([item], self._stager(), 0) if self._staged() else self._read([item])
            buf = self._flat_tensor(batch)
            flat = {e.key: self._tensor(buf, e, o) for e, o in zip(batch.entries[0], batch.offsets[0])}
        else:
            flat = self._read_item(item)
        out = self._assemble(item, flat)
        return self.transform(out) if self.transform is not None else out

    # --- region reads ---
    def read_region(self, index: int, key: str, start: Sequence[int], shape: Sequence[int]) -> Any:
        """Region `[start, start+shape)` of one tensor (all dims), reading only the bytes it needs.

        Returns a tensor on the dataset's device equal to `full[slices]`. Checksums cover whole tensors,
        so `verify` does not apply to region reads."""
        return self._region(int(self.items[index]), key, start, shape)

    def _region(self, item: int, key: str, start: Sequence[int], shape: Sequence[int]) -> Any:
        entry = next((e for e in self.cache.entries(item) if e.key == key), None)
        if entry is None:
            raise KeyError(f"{self.root}: item {item} has no key '{key}'")
        return self._regions([plan_read(entry, start, shape)])[0]

    def _regions(self, reads: list[RegionRead]) -> list[Any]:
        """Planned regions of one item, read in one backend batch, as tensors on the dataset's device."""
        import torch

        try:
            arrays = read_regions(self.backend, reads, allocate=self._pool().get)
        except BackendError as exc:
            raise _name_short_read([[r.entry for r in reads]], exc) from exc
        tensors = [torch.from_numpy(a) for a in arrays]
        return [t.to(self.device, non_blocking=True) for t in tensors] if self.on_gpu else tensors

    def _read_roi(self, item: int) -> dict[str, Any]:
        entries = [e for e in self.cache.entries(item) if e.key in self.keys]
        roi = self.roi
        if callable(roi):
            roi = roi(item, {e.key: e.shape for e in entries})
        reads = []
        for e in entries:
            if roi is None or len(roi[0]) > len(e.shape):  # keys with fewer dims than the roi: whole
                start, shape = [0] * len(e.shape), list(e.shape)
            else:
                lead = len(e.shape) - len(roi[0])
                start = [0] * lead + list(roi[0])
                shape = list(e.shape[:lead]) + list(roi[1])
            reads.append(plan_read(e, start, shape))
        return {r.entry.key: t for r, t in zip(reads, self._regions(reads))}

    # --- batches ---
    def iter_batches(
        self, batch_size: int, prefetch: int = 2, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> Iterator[dict[str, Any]]:
        """Batches of stacked tensors, `prefetch` batches read ahead (each one backend call, all in flight).

        Yields {key: tensor (B, ...), "_items": item numbers, "_meta": [per-item meta] (when meta)}; keys of
        equal-shaped, 4 KiB-multiple tensors are zero-copy views of the read buffer. Inside a DataLoader
        worker, batches are split across workers (worker k takes batches k, k+n, ...). On a GPU without a
        GPU backend, batches go through `prefetch + 1` pinned slots and async copies (double buffering)."""
        import torch

        order = np.arange(len(self.items))
        if shuffle:
            order = np.random.default_rng(seed).permutation(order)
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if drop_last and chunks and len(chunks[-1]) < batch_size:
            chunks.pop()
        info = torch.utils.data.get_worker_info()
        if info is not None:
            chunks = chunks[info.id :: info.num_workers]
        stager = None
        if self._staged():
            from loaders.gpu import PinnedStager

            stager = PinnedStager(self.device, slots=prefetch + 1)
        yield from self._pipeline(chunks, max(1, prefetch), stager)

    def _pipeline(self, chunks: list[np.ndarray], prefetch: int, stager: Any) -> Iterator[dict[str, Any]]:
        # Slot k % (prefetch + 1) is read into only after batch k - prefetch - 1 was uploaded out of it.
        with ThreadPoolExecutor(prefetch, thread_name_prefix="blockprep-prefetch") as pool:
            pending: deque[Future[_Batch]] = deque()
            for k, chunk in enumerate(chunks):
                slot = k % (prefetch + 1) if stager is not None else -1
                pending.append(pool.submit(self._read, self.items[chunk], stager, slot))
                if len(pending) > prefetch:
                    yield self._collate(pending.popleft().result())
            while pending:
                yield self._collate(pending.popleft().result())

    def _collate(self, batch: _Batch) -> dict[str, Any]:
        import torch

        flat = self._flat_tensor(batch)
        out: dict[str, Any] = {}
        for key in self.keys:
            found = [
                (e, o) for ents, offs in zip(batch.entries, batch.offsets) for e, o in zip(ents, offs) if e.key == key
            ]
            if not found:
                continue
            e0, o0 = found[0]
            same = all(e.shape == e0.shape for e, _ in found) and e0.nbytes == align_up(e0.nbytes)
            if same and len(found) == len(batch.items):
                view = flat[o0 : o0 + e0.nbytes * len(found)]
                out[key] = view.view(torch_dtype(e0.dtype)).reshape(len(found), *e0.shape)
            elif all(e.shape == e0.shape for e, _ in found):
                out[key] = torch.stack([self._tensor(flat, e, o) for e, o in found])
            else:
                out[key] = [self._tensor(flat, e, o) for e, o in found]
        result = unflatten(out)
        result["_items"] = torch.as_tensor(batch.items)
        if self.meta:
            result["_meta"] = [self._item_meta(i).get("meta") or {} for i in batch.items]
        return self.transform(result) if self.transform is not None else result


def _name_short_read(entries: list[list[TensorEntry]], exc: BackendError) -> BackendError:
    """Name the item and key behind a short read: the first entry its shard no longer holds."""
    sizes: dict[str, int] = {}
    for ents in entries:
        for e in ents:
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
    return exc


class _BatchesCore:
    """An IterableDataset of batches from `dataset.iter_batches(batch_size, **options)`.

    Give it to `DataLoader(..., batch_size=None, num_workers=n)`: each worker reads its share of batches."""

    def __init__(self, dataset: _DatasetCore, batch_size: int, **options: Any) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.options = options
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle differently each epoch (seed + epoch) when shuffle=True."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        options = dict(self.options)
        options["seed"] = options.get("seed", 0) + self.epoch
        return self.dataset.iter_batches(self.batch_size, **options)

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.options.get("drop_last") else -(-n // self.batch_size)


def _build(name: str) -> type:
    tud = require("torch", "PreparedDataset").utils.data

    if name == "PreparedDataset":
        cls = type(name, (_DatasetCore, tud.Dataset), {"__module__": __name__, "__doc__": _DatasetCore.__doc__})
    else:
        cls = type(name, (_BatchesCore, tud.IterableDataset), {"__module__": __name__, "__doc__": _BatchesCore.__doc__})
    globals()[name] = cls
    return cls


if TYPE_CHECKING:
    PreparedDataset = _DatasetCore
    PreparedBatches = _BatchesCore
else:

    def __getattr__(name: str) -> Any:
        # Build the torch Dataset subclasses on first use, so `import loaders.dataset` imports no torch.
        if name in ("PreparedDataset", "PreparedBatches"):
            return _build(name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
