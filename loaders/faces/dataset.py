"""PreparedDataset: a map-style torch Dataset over a prepared cache, with a prefetching batch reader.

    >>> ds = PreparedDataset("cache/", backend="auto")            # doctest: +SKIP
    >>> ds[0]["image"].shape, ds[0]["image"].affine              # MetaTensor when MONAI is installed
    >>> for batch in ds.iter_batches(8, prefetch=2): ...         # many requests in flight per batch

`import loaders.faces.dataset` imports no torch: `PreparedDataset` (a torch Dataset) lives in
`loaders.faces.torch_data`, which `loaders` loads on first use of the name. Every read of an item or a batch
is one read of the dataset's `loaders.reading.reads.Reader`: all tensors of all items in flight together,
landing at aligned offsets of one buffer; tensors are zero-copy views of it. Batches live in
`loaders.faces.batches`, the meta format in `loaders.cache.meta`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args
from loaders.backends import Backend, check_backend
from loaders.cache.dtypes import torch_dtype
from loaders.cache.format import PreparedCache
from loaders.cache.meta import as_kind, key_meta, line_kinds, meta_template, values_from_text, values_text
from loaders.cache.nesting import unflatten
from loaders.cache.order import epoch_order
from loaders.deps import has
from loaders.faces import batches
from loaders.reading.mappings import own_storage
from loaders.reading.reads import PLAN_CACHE, Reader, ReadPlan, fits_in_memory
from loaders.reading.region import plan_read
from loaders.reading.staging import view
from loaders.tunables import SMALL_OWN

__all__ = ["DatasetCore", "fits_in_memory", "read_record", "shard_items"]


# (start, shape) over the trailing dims, or a callable (item, {key: shape}) -> (start, shape) | None
Roi = tuple[Sequence[int], Sequence[int]] | Callable[[int, dict[str, tuple[int, ...]]], Any]


@dataclass
class _ItemPlan:
    """Everything about reading one item alone that does not change: its read plan (`Reader.plan(alone=True)`:
    merged runs when small, pieces when large), where each tensor sits, and its meta made ready for
    MetaTensors."""

    read: ReadPlan
    views: list[tuple[str, int, int, Any, tuple[int, ...]]]  # key, offset, nbytes, torch dtype, shape
    templates: dict[str, Any] | None = None  # key -> MetaTensor template (built on first use)
    values: str | None = None  # the head's non-tensor outputs (`values_text`: decoded per item, each its own)
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
    """Rank `rank`'s items of `items` for `epoch`, in the one epoch order (`loaders.cache.order.epoch_order`)."""
    at = epoch_order(len(items), seed, epoch, rank, world_size, shuffle, pad=even, contiguous=contiguous)
    return np.asarray(items[at], dtype=np.int64)


def _own_storage(t: Any) -> Any:
    """A small tensor (a coordinate, a class label) as a copy with its own storage, not a view of the item's
    read buffer: `copy.deepcopy` copies a view's whole storage, and MONAI deep-copies the keys a label-driven
    crop leaves alone once per sample (CropForegroundd's two 24-byte coordinates cost 2 x 53 MB a sample)."""
    nbytes = t.numel() * t.element_size()
    return t.clone() if nbytes <= SMALL_OWN and t.untyped_storage().nbytes() > 2 * nbytes else t


class DatasetCore:
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
        cache = PreparedCache(self.root)
        check_backend(backend)
        chosen = args.check_dataset(cache, keys, backend, device, verify, meta)
        self.keys = chosen if chosen is not None else list(cache.keys)
        self._all_keys = keys is None
        self.device = str(device)
        self.verify = verify
        self.transform = transform
        self.roi = roi
        self.meta = meta and has("monai")
        self.leaf_types = leaf_types
        self.items = np.arange(len(cache), dtype=np.int64)
        self.reader = Reader(cache, self.keys, backend, self.device, verify=verify, backend_options=backend_options)
        self._plans: dict[int, _ItemPlan] = {}  # item -> its read plan (the cache is immutable)
        self._handed: dict[int, tuple[int, dict[str, Any]]] = {}  # thread -> (item, meta line): `hand_meta`
        self.epoch = 0
        self._shard = None  # (parent items, rank, world size, contiguous, even, shuffle, seed) of a shard view

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plans": {}, "_handed": {}}  # the Reader pickles without its threads and buffers

    @property
    def cache(self) -> PreparedCache:
        """The prepared cache read."""
        return self.reader.cache

    @property
    def backend(self) -> Backend:
        """The backend this process reads through (built on first use)."""
        return self.reader.backend

    @property
    def on_gpu(self) -> bool:
        """True when items are delivered to a GPU."""
        return self.device.startswith("cuda")

    def close(self) -> None:
        """Release the backend's threads and descriptors."""
        self.reader.close()

    def __len__(self) -> int:
        return len(self.items)

    # --- views ---
    def _view(self, items: np.ndarray) -> Any:
        view = self.__class__.__new__(self.__class__)
        view.__dict__.update(self.__dict__)
        view.items = np.asarray(items, dtype=np.int64)
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

    # --- items ---
    def _item_meta(self, item: int) -> dict[str, Any]:
        """The item's meta line: {"meta": {key: MetaTensor meta}, "applied_operations": {key: [...]},
        "values": {key: non-tensor output}, "source": datalist entry}; the one `hand_meta` gave this thread
        for this item, if any, else read."""
        handed = self._handed.pop(threading.get_ident(), None)
        if handed is not None and handed[0] == item:
            return dict(handed[1])
        return dict(self.cache.meta(item) or {})

    def hand_meta(self, item: int, line: dict[str, Any]) -> None:
        """The meta line of `item` its caller has just read (`cache.meta`), for this thread's next read of that
        item: the drop-in's first lookup of a position reads it to match the entry, and the item's first read
        would read it again (64x64 MedNIST items: 4,096 meta reads for 2,048 first reads)."""
        self._handed[threading.get_ident()] = (item, line)

    def _plan(self, item: int) -> _ItemPlan:
        """The item's read plan, built once (its reads, views; its meta when first wrapped)."""
        plan = self._plans.get(item)
        if plan is not None:
            self.cache.check_current()  # a stat: an item read before is not served once the cache was rebuilt
            return plan
        read = self.reader.plan([item], alone=True)  # key-major, as batches lay them out
        views = [(e.key, at, e.nbytes, torch_dtype(e.dtype), e.shape) for _, e, at in read.tensors]
        plan = _ItemPlan(read, views)
        if len(self._plans) >= PLAN_CACHE:
            self._plans.clear()
        self._plans[item] = plan
        return plan

    def _load_meta(self, item: int, plan: _ItemPlan) -> None:
        """Read the item's meta line once: MetaTensor templates (when meta) and its non-tensor values."""
        line = self._item_meta(item)
        if self.meta and plan.templates is None:
            plan.templates, plan.kinds = self._templates(line, {key: len(shape) for key, *_, shape in plan.views})
        plan.values = values_text(line)

    def _templates(self, line: Mapping[str, Any], ndims: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, str]]:
        """A meta line's MetaTensor templates of keys `ndims` (key -> ndim) and the kinds of its leaves."""
        return _templates(line, ndims, getattr(self, "leaf_types", False))

    def _assemble(self, item: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """Tensors (+ stored non-tensor outputs) -> the item's nested dict, MetaTensors restored."""
        plan = self._plan(item)
        if plan.values is None or (self.meta and plan.templates is None):
            self._load_meta(item, plan)
        return self._assembled(tensors, plan.templates, plan.kinds, plan.values)

    def _assembled(
        self, tensors: dict[str, Any], templates: dict[str, Any] | None, kinds: dict[str, str] | None, values: Any
    ) -> dict[str, Any]:
        return _assembled(tensors, templates, kinds, values, self.meta, self._all_keys)

    def read_record(self, tensors: dict[str, Any], line: Mapping[str, Any]) -> dict[str, Any]:
        """An item that is not (yet) in the committed index, from its {flat key: host tensor} and its meta line
        (the drop-in's journaled items, `loaders.faces.monai_fill`), assembled as `read` assembles a committed
        item: the same keys, device, types and meta."""
        keys = None if self._all_keys else self.keys
        return read_record(tensors, line, self.device, self.meta, getattr(self, "leaf_types", False), keys)

    def _read_item(self, item: int, mapped: bool) -> dict[str, Any]:
        """One item: {key: tensor}, views of copy-on-write mappings of its bytes where `mapped` and read buffered
        on the host (`Reader.mapped`), else of one host buffer read with one backend call."""
        import torch

        plan = self._plan(item)
        arrays = None if plan.read.small or not mapped else self.reader.mapped(plan.read)
        if arrays is not None:  # buffered reads: the page cache's pages, mapped, none copied
            return {k: torch.from_numpy(a).view(dt).reshape(shape) for (k, *_, dt, shape), a in zip(plan.views, arrays)}
        # In a DataLoader worker process the workers are the parallelism (torch gives each one intra-op
        # thread): a thread handoff per piece only costs CPU there, so one tensor per call.
        worker = not plan.read.small and torch.utils.data.get_worker_info() is not None
        got = self.reader.fetch(plan.read, per_tensor=worker)
        flat = torch.from_numpy(got.buf[: plan.read.nbytes])
        return {k: flat[o : o + n].view(dt).reshape(shape) for k, o, n, dt, shape in plan.views}

    def _read_device(self, item: int) -> dict[str, Any]:
        """One item to the GPU: a GPU backend's buffer, or this thread's pinned slot and one async copy."""
        reader = self.reader
        got = reader.fetch(reader.plan([item]), reader.thread_slot() if reader.staged else None)
        flat = reader.upload(got)
        return {key: view(flat, at, dtype, shape) for _, key, at, dtype, shape in got.places}

    def __getitem__(self, index: int) -> Any:
        transform = self.transform
        out = self.read(index, mapped=transform is not None)
        return own_storage(transform(out)) if transform is not None else out

    def read(self, index: int, mapped: bool = False) -> dict[str, Any]:
        """`self[index]` before `transform`: its nested dict. mapped: its tensors may be views of mappings of the shards
        (`Reader.mapped`: for a transform that crops, only the crop's pages come in); the caller then hands the
        transform's output on through `loaders.reading.mappings.own_storage` (a mapping held past that is killed
        with SIGBUS when its shard is truncated)."""
        item = int(self.items[args.index(index, len(self.items))])
        if self.roi is not None:
            flat = self._read_roi(item)
        elif self.reader.staged or self.backend.gpu:
            flat = self._read_device(item)
        else:
            flat = self._read_item(item, mapped)
        return self._assemble(item, flat)

    # --- batches (loaders.faces.batches) ---
    def iter_batches(
        self,
        batch_size: int,
        prefetch: int = 2,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = False,
        epoch: int = 0,
        start: int = 0,
    ) -> Iterator[dict[str, Any]]:
        """Batches of stacked tensors, `prefetch` batches read ahead (each one backend call, all in flight).

        Yields {key: tensor (B, ...), "_items": item numbers, "_meta": [per-item meta] (when meta)}; keys of
        equal-shaped, 4 KiB-multiple tensors are zero-copy views of the read buffer. A key whose tensors
        differ in shape within the batch is a list of B tensors; with `pad=True` it is instead one
        (B, *largest) tensor, each item zero-padded at the end of every dim, and `_shapes[key]` (B, ndim)
        holds the items' own shapes. With `roi`, only each item's region is read (one region read per
        batch, every request in flight). Inside a DataLoader worker, batches are split across workers
        (worker k takes batches k, k+n, ...). On a GPU without a GPU backend, batches go through
        `prefetch + 1` pinned slots and async copies (double buffering). shuffle orders the epoch as
        `loaders.cache.order.epoch_order(n, seed, epoch)` does (DistributedSampler's rule). start: the epoch's
        batches to leave out (those a stopped run delivered: `PreparedBatches.state_dict`)."""
        return batches.iter_batches(self, batch_size, prefetch, shuffle, seed, drop_last, pad, epoch, start)

    # --- region reads ---
    def read_region(self, index: int, key: str, start: Sequence[int], shape: Sequence[int]) -> Any:
        """Region `[start, start+shape)` of one tensor (all dims), reading only the bytes it needs.

        Returns a tensor on the dataset's device equal to `full[slices]`. Checksums cover whole tensors,
        so `verify` does not apply to region reads."""
        item = int(self.items[index])
        entry = next((e for e in self.cache.entries(item) if e.key == key), None)
        if entry is None:
            raise KeyError(f"{self.root}: item {item} has no key '{key}'")
        read = plan_read(entry, start, shape)
        got = self.reader.fetch(ReadPlan([], 0, [], [], regions=[(item, read)]))
        return self.reader.region_tensors(got)[0]

    def roi_window(self, item: int) -> Any:
        """The window `roi` gives `item`: (start, shape) over the trailing dims, or None (whole)."""
        roi = self.roi
        if callable(roi):
            roi = roi(item, {e.key: e.shape for e in self.cache.entries(item) if e.key in self.keys})
        return roi

    def _read_roi(self, item: int) -> dict[str, Any]:
        reader = self.reader
        got = reader.fetch(reader.plan([item], [self.roi_window(item)], key_major=False))
        return {r.entry.key: t for (_, r), t in zip(got.plan.regions, reader.region_tensors(got))}


def _templates(
    line: Mapping[str, Any], ndims: Mapping[str, int], leaf_types: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """A meta line's MetaTensor templates of keys `ndims` (key -> ndim) and, with `leaf_types`, the kinds of its
    leaves."""
    templates = {key: meta_template(key_meta(line, key), ndim) for key, ndim in ndims.items()}
    return templates, line_kinds(line) if leaf_types else {}


def _assembled(
    tensors: dict[str, Any], templates: dict[str, Any] | None, kinds: dict[str, str] | None, values: Any, meta: bool,
    all_keys: bool,
) -> dict[str, Any]:  # fmt: skip
    """{flat key: tensor} -> the item's nested dict: MetaTensors stamped from `templates` (when meta), leaves
    made the kinds the head gave (`kinds`), its non-tensor `values` (`values_text`) added (with `all_keys`)."""
    flat = {k: _own_storage(t) for k, t in tensors.items()}
    if meta and templates:
        kinds = kinds or {}
        flat = {k: as_kind(t, kinds.get(k), templates.get(k)) for k, t in tensors.items()}
    if all_keys and values and values[1:] != "{}":  # the head's non-tensor outputs, as they were
        flat.update(values_from_text(values))
    return unflatten(flat)


def read_record(
    tensors: dict[str, Any], line: Mapping[str, Any], device: str, meta: bool, leaf_types: bool,
    keys: Sequence[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """An item from its {flat key: host tensor} and its meta line (a drop-in record, `loaders.faces.monai_fill`),
    assembled as a committed item is read: on `device`, MetaTensors restored with `meta`, each leaf the type the
    head gave with `leaf_types`; only `keys` (None: all, with the head's non-tensor outputs)."""
    tensors = {k: t.to(device) for k, t in tensors.items() if keys is None or k in keys}
    templates, kinds = _templates(line, {k: t.ndim for k, t in tensors.items()}, leaf_types) if meta else ({}, {})
    return _assembled(tensors, templates, kinds, values_text(line), meta, keys is None)
