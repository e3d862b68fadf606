"""PreparedDataset: a map-style torch Dataset over a prepared cache, with a prefetching batch reader.

    >>> ds = PreparedDataset("cache/", backend="auto")            # doctest: +SKIP
    >>> ds[0]["image"].shape, ds[0]["image"].affine              # MetaTensor when MONAI is installed
    >>> for batch in ds.iter_batches(8, prefetch=2): ...         # many requests in flight per batch

`import loaders.dataset` imports no torch: the class is built (as a torch Dataset subclass) on first use of
the name `PreparedDataset`. Every read of an item or a batch is one backend call: all tensors of all items
in flight together, landing at aligned offsets of one buffer; tensors are zero-copy views of it. Batches
live in `loaders.batches`, buffers in `loaders.buffers`, the meta format in `loaders.meta`.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loaders import args
from loaders.backends import Backend, ReadRequest, get_backend
from loaders.batches import BatchReads, _Batch, name_short_read
from loaders.buffers import BufferPool, torch_dtype
from loaders.deps import has, require
from loaders.errors import BackendError
from loaders.format import PreparedCache, TensorEntry, align_up, unflatten
from loaders.meta import as_kind, key_meta, line_kinds, line_values, meta_template
from loaders.order import epoch_order
from loaders.region import RegionRead, plan_read, read_regions

# Requests of an item read alone are cut into pieces of at least this many bytes when the item has fewer
# tensors than the backend has threads: a warm read is a memory copy, and one core copies ~10 GB/s.
SPLIT_BYTES = 2 << 20
# An item read alone up to this size goes through `Backend.read_small` (on the calling thread for posix, and
# for direct when warm): handing a few KB to the pool and waiting for it costs more than the copy itself.
INLINE_BYTES = 256 << 10
# Items whose read plan and meta are kept (immutable for a committed cache); beyond it the cache restarts.
PLAN_CACHE = 1 << 16
# tensors up to this size get their own storage when read (`_own_storage`)
SMALL_OWN = 1 << 20

# (start, shape) over the trailing dims, or a callable (item, {key: shape}) -> (start, shape) | None
Roi = tuple[Sequence[int], Sequence[int]] | Callable[[int, dict[str, tuple[int, ...]]], Any]


@dataclass
class _ItemPlan:
    """Everything about reading one item alone that does not change: requests (one per tensor, and split
    into pieces) and where each lands, where each tensor sits, and its meta made ready for MetaTensors."""

    entries: list[TensorEntry]
    offsets: list[int]  # byte offset of each entry in the buffer
    requests: list[ReadRequest]  # cut into pieces for the backend's threads
    places: list[tuple[int, int]]  # [start, end) of each request in the buffer
    whole: tuple[list[ReadRequest], list[tuple[int, int]]]  # requests and places, one per tensor
    runs: tuple[list[ReadRequest], list[tuple[int, int]]]  # tensors adjacent in file and buffer, merged
    nbytes: int
    views: list[tuple[str, int, int, Any, tuple[int, ...]]]  # key, offset, nbytes, torch dtype, shape
    templates: dict[str, Any] | None = None  # key -> MetaTensor template (built on first use)
    values: str | None = None  # JSON of the head's non-tensor outputs (parsed per item: each gets its own)
    kinds: dict[str, str] | None = None  # key -> "ndarray" | "numpy" | "tensor": leaves that were no MetaTensor


def shard_items(
    items: np.ndarray,
    rank: int,
    world_size: int,
    contiguous: bool,
    even: bool,
    shuffle: bool,
    seed: int,
    epoch: int = 0,
) -> np.ndarray:
    """Rank `rank`'s items of `items` for `epoch`, in the one epoch order (`loaders.order.epoch_order`)."""
    at = epoch_order(len(items), seed, epoch, rank, world_size, shuffle, pad=even, contiguous=contiguous)
    return np.asarray(items[at], dtype=np.int64)


def fits_in_memory(nbytes: int, share: float = 0.5) -> bool:
    """True when `nbytes` is at most `share` of the memory Linux says is available (MemAvailable).

    A cache that fits is read buffered on CPU (`auto` -> posix): the first epoch fills the page cache and
    later epochs are memory copies. O_DIRECT (`direct`) never fills it, so every epoch would go to the
    device: it is for caches larger than memory, where the page cache would only thrash."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    return nbytes <= share * avail


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


_DTYPES: dict[np.dtype, Any] = {}


def _torch_dtype(dtype: np.dtype) -> Any:
    """torch_dtype, memoised: plans are built per item, the dtypes are few."""
    got = _DTYPES.get(dtype)
    if got is None:
        got = _DTYPES[dtype] = torch_dtype(dtype)
    return got


def _own_storage(t: Any) -> Any:
    """A small tensor (a coordinate, a class label) as a copy with its own storage, not a view of the item's
    read buffer: `copy.deepcopy` copies a view's whole storage, and MONAI deep-copies the keys a label-driven
    crop leaves alone once per sample (CropForegroundd's two 24-byte coordinates cost 2 x 53 MB a sample)."""
    nbytes = t.numel() * t.element_size()
    return t.clone() if nbytes <= SMALL_OWN and t.untyped_storage().nbytes() > 2 * nbytes else t


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


class _DatasetCore(BatchReads):
    """Map-style dataset over a prepared cache: `ds[i]` is a dict of tensors (MetaTensors with MONAI).

    cache_dir: a committed cache. keys: which tensors (default all). backend: a name ("auto", "posix",
    "direct", "kvikio", ...) or a Backend. device: "cpu" or "cuda:N" (kvikio reads into GPU memory; host
    backends stage through pinned memory). verify: check xxh3 of every tensor read. transform: applied to
    each item (or batch, in iter_batches). roi: read only a region (see README). meta: restore MetaTensors.
    leaf_types (with meta): give each array back as the type the head gave it (numpy array with its
    dtype, plain tensor, MetaTensor: MONAI 1.4's PersistentDataset); False: every one a MetaTensor.
    """

    # defaults for objects unpickled from before these existed (DataLoader workers of an older release)
    epoch = 0
    _shard: tuple[np.ndarray, int, int, bool, bool, bool, int] | None = None

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
        leaf_types: bool = False,
    ) -> None:
        args.cache_dir(cache_dir)
        self.root = Path(cache_dir)
        self.cache = PreparedCache(self.root)
        chosen = args.check_dataset(self.cache, keys, backend, device, verify, meta)
        self.keys = chosen if chosen is not None else list(self.cache.keys)
        self._all_keys = keys is None
        self._rank = {k: i for i, k in enumerate(self.keys)}
        self.device = str(device)
        self.verify = verify
        self.transform = transform
        self.roi = roi
        self.meta = meta and has("monai")
        self.leaf_types = leaf_types
        self.items = np.arange(len(self.cache), dtype=np.int64)
        self._backend_spec = backend
        self._backend_options = dict(backend_options or {})
        self._backend: Backend | None = backend if isinstance(backend, Backend) else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._plans: dict[int, _ItemPlan] = {}  # item -> its read plan (the cache is immutable)
        self.epoch = 0
        self._shard = None  # (parent items, rank, world size, contiguous, even, shuffle, seed) of a shard view

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
                    if name == "auto" and not self.on_gpu and not self._backend_options:
                        name = "posix" if fits_in_memory(int(self.cache.index["nbytes"].sum())) else "auto"
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
        view._shard = None
        return view

    def shard(
        self,
        rank: int,
        world_size: int,
        contiguous: bool = False,
        even: bool = True,
        shuffle: bool = False,
        seed: int = 0,
    ) -> Any:
        """The part of this dataset for DDP rank `rank` of `world_size`: strided (default) or contiguous.

        even=True pads by wrapping around so every rank gets the same count (as DistributedSampler does);
        otherwise DDP ranks would step a different number of times and hang. shuffle=True splits a
        permutation drawn from (seed, epoch) instead of the dataset order, and `set_epoch(e)` draws the
        next one, as DistributedSampler does: every rank computes the same permutation (pass the same
        seed everywhere), so each epoch every item goes to exactly one rank (plus the padding), and the
        split differs from epoch to epoch."""
        args.shard(rank, world_size)
        args.seed(seed)
        for name, value in (("contiguous", contiguous), ("even", even), ("shuffle", shuffle)):
            args.flag(name, value)
        spec = (self.items, rank, world_size, contiguous, even, shuffle, seed)
        view = self._view(shard_items(*spec, epoch=0))
        view._shard, view.epoch = spec, 0
        return view

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a shard made with shuffle=True takes that epoch's part of the split. Refuses in
        one line when the cache was rebuilt since it was opened."""
        self.cache.check_current()
        self.epoch = args.count("epoch", epoch, 0)
        if self._shard is not None:
            self.items = shard_items(*self._shard, epoch=epoch)

    def subset(self, indices: Sequence[int] | np.ndarray) -> Any:
        """A view over positions `indices` of this dataset."""
        return self._view(self.items[args.indices(indices, len(self.items))])

    # --- reading ---
    def _pool(self) -> BufferPool:
        self._after_fork()
        pool = self.__dict__.get("_buffers")
        if pool is None:
            backend = self.backend  # built outside the lock (it takes the same lock)
            with self._lock:
                pool = self.__dict__.get("_buffers")
                if pool is None:
                    pool = self.__dict__["_buffers"] = BufferPool(backend.allocate)
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

    def _item_meta(self, item: int) -> dict[str, Any]:
        """The item's meta line: {"meta": {key: MetaTensor meta}, "applied_operations": {key: [...]},
        "values": {key: non-tensor output}, "source": datalist entry}."""
        return dict(self.cache.meta(item) or {})

    def _plan(self, item: int) -> _ItemPlan:
        """The item's read plan, built once (entries, requests, views; its meta when first wrapped)."""
        plan = self._plans.get(item)
        if plan is not None:
            self.cache.check_current()  # a stat: an item read before is not served once the cache was rebuilt
            return plan
        rank = self._rank
        entries = sorted((e for e in self.cache.entries(item) if e.key in rank), key=lambda e: rank[e.key])
        offsets, requests, places, pos = [], [], [], 0  # key-major, as batches lay them out
        for e in entries:
            offsets.append(pos)
            requests.append(ReadRequest(e.shard, e.offset, e.nbytes))
            places.append((pos, pos + e.nbytes))
            pos += align_up(e.nbytes)
        whole = runs = split = (requests, places)
        if pos <= INLINE_BYTES:  # read alone through read_small: merged runs, never split
            runs = _merge(requests, places)
        elif len(requests) < getattr(self.backend, "threads", 1) and not self.backend.gpu:
            split = _split(requests, places, self.backend.threads)
        views = [(e.key, o, e.nbytes, _torch_dtype(e.dtype), e.shape) for e, o in zip(entries, offsets)]
        plan = _ItemPlan(entries, offsets, *split, whole, runs, pos, views)
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[item] = plan
        return plan

    def _load_meta(self, item: int, plan: _ItemPlan) -> None:
        """Read the item's meta line once: MetaTensor templates (when meta) and its non-tensor values."""
        line = self._item_meta(item)
        if self.meta and plan.templates is None:
            plan.templates = {key: meta_template(key_meta(line, key), len(shape)) for key, *_, shape in plan.views}
            plan.kinds = line_kinds(line) if getattr(self, "leaf_types", False) else {}
        plan.values = json.dumps(line_values(line))

    def _assemble(self, item: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """Tensors (+ stored non-tensor outputs) -> the item's nested dict, MetaTensors restored."""
        plan = self._plan(item)
        if plan.values is None or (self.meta and plan.templates is None):
            self._load_meta(item, plan)
        flat = {k: _own_storage(t) for k, t in tensors.items()}
        if self.meta and plan.templates:
            kinds = plan.kinds or {}
            flat = {k: as_kind(t, kinds.get(k), plan.templates.get(k)) for k, t in tensors.items()}
        if self._all_keys and plan.values != "{}":  # non-tensor outputs of the head come back as they were
            flat.update(json.loads(plan.values or "{}"))
        return unflatten(flat)

    def _read_item(self, item: int) -> dict[str, Any]:
        """One item into a reused host buffer with one backend call: {key: tensor view of the buffer}."""
        import torch

        plan = self._plan(item)
        buf = self._pool().get(plan.nbytes)
        try:
            if plan.nbytes <= INLINE_BYTES:  # small: one pread per run, on this thread where the backend can
                requests, places = plan.runs
                self.backend.read_small(requests, [buf[a:b] for a, b in places])
            elif torch.utils.data.get_worker_info() is None:  # many pieces in flight on the backend's threads
                self.backend.read_into(plan.requests, [buf[a:b] for a, b in plan.places])
            else:
                # In a DataLoader worker process the workers are the parallelism (torch gives each one
                # intra-op thread): a thread handoff per piece only costs CPU there. One tensor per call,
                # so a warm read is a copy on this thread; a cold O_DIRECT one still keeps its chunks in flight.
                for r, (a, b) in zip(*plan.whole):
                    self.backend.read_into([r], [buf[a:b]])
        except BackendError as exc:
            raise name_short_read([plan.entries], exc) from exc
        if self.verify:
            self._verify(_Batch([item], [plan.entries], [plan.offsets], buf, plan.nbytes))
        flat = torch.from_numpy(buf[: plan.nbytes])
        return {k: flat[o : o + n].view(dt).reshape(shape) for k, o, n, dt, shape in plan.views}

    def __getitem__(self, index: int) -> Any:
        item = int(self.items[args.index(index, len(self.items))])
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
            raise name_short_read([[r.entry for r in reads]], exc) from exc
        tensors = [torch.from_numpy(a) for a in arrays]
        return [t.to(self.device, non_blocking=True) for t in tensors] if self.on_gpu else tensors

    def _roi_reads(self, item: int) -> list[RegionRead]:
        """The planned region reads of one item under `roi` (keys with fewer dims than the roi: whole)."""
        entries = [e for e in self.cache.entries(item) if e.key in self.keys]
        roi = self.roi
        if callable(roi):
            roi = roi(item, {e.key: e.shape for e in entries})
        reads = []
        for e in entries:
            if roi is None or len(roi[0]) > len(e.shape):
                start, shape = [0] * len(e.shape), list(e.shape)
            else:
                lead = len(e.shape) - len(roi[0])
                start = [0] * lead + list(roi[0])
                shape = list(e.shape[:lead]) + list(roi[1])
            reads.append(plan_read(e, start, shape))
        return reads

    def _read_roi(self, item: int) -> dict[str, Any]:
        reads = self._roi_reads(item)
        return {r.entry.key: t for r, t in zip(reads, self._regions(reads))}


def _build() -> type:
    tud = require("torch", "PreparedDataset").utils.data
    cls = type(
        "PreparedDataset", (_DatasetCore, tud.Dataset), {"__module__": __name__, "__doc__": _DatasetCore.__doc__}
    )
    globals()["PreparedDataset"] = cls
    return cls


if TYPE_CHECKING:
    PreparedDataset = _DatasetCore
else:

    def __getattr__(name: str) -> Any:
        # Built on first use (a torch Dataset subclass), so `import loaders.dataset` imports no torch.
        if name == "PreparedDataset":
            return _build()
        if name == "PreparedBatches":  # its home is loaders.batches; kept importable from here
            from loaders import batches

            return batches.PreparedBatches
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
