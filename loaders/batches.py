"""Batches of a PreparedDataset: one backend call per batch (every tensor of every item in flight), read
`prefetch` batches ahead, collated into stacked tensors; and `PreparedBatches`, the IterableDataset that
hands them to a DataLoader.

`import loaders.batches` imports no torch: `PreparedBatches` is built on first use of the name.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from loaders.args import check_batches, count
from loaders.backends import Backend, ReadRequest
from loaders.buffers import BufferPool, torch_dtype
from loaders.deps import require
from loaders.errors import ArgumentValueError, BackendError, LoaderStateError
from loaders.format import PreparedCache, TensorEntry, align_up, check, unflatten
from loaders.meta import line_meta
from loaders.order import epoch_batches, epoch_order


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


def name_short_read(entries: list[list[TensorEntry]], exc: BackendError) -> BackendError:
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


class BatchReads:
    """The batch side of PreparedDataset (a mixin): reading many items in one call, and `iter_batches`."""

    # provided by the dataset
    cache: PreparedCache
    keys: list[str]
    items: np.ndarray
    device: str
    verify: bool
    meta: bool
    transform: Any

    @property
    def backend(self) -> Backend:  # pragma: no cover - the dataset defines it
        raise NotImplementedError

    def _pool(self) -> BufferPool:  # pragma: no cover - the dataset defines it
        raise NotImplementedError

    def _staged(self) -> bool:  # pragma: no cover - the dataset defines it
        raise NotImplementedError

    def _roi_reads(self, item: int) -> list[Any]:  # pragma: no cover - the dataset defines it
        raise NotImplementedError

    def _regions(self, reads: list[Any]) -> list[Any]:  # pragma: no cover - the dataset defines it
        raise NotImplementedError

    roi: Any

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
            raise name_short_read(entries, exc) from exc
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

    def _flat_tensor(self, batch: _Batch) -> Any:
        """The batch buffer as one uint8 torch tensor on the target device (one H2D copy when staged)."""
        import torch

        if batch.stager is not None:
            return batch.stager.upload(batch.slot, batch.nbytes)
        if self.backend.gpu:
            return torch.as_tensor(batch.buffer[: batch.nbytes], device=self.device)
        return torch.from_numpy(batch.buffer[: batch.nbytes])

    @staticmethod
    def _tensor(flat: Any, entry: TensorEntry, offset: int) -> Any:
        view = flat[offset : offset + entry.nbytes]
        return view.view(torch_dtype(entry.dtype)).reshape(entry.shape)

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
        `loaders.order.epoch_order(n, seed, epoch)` does (DistributedSampler's rule). start: the epoch's
        batches to leave out (those a stopped run delivered: `PreparedBatches.state_dict`)."""
        import torch

        check_batches(batch_size, prefetch, shuffle, seed, drop_last, pad, epoch)
        count("start", start, 0)
        self.cache.check_current()  # per epoch: a rebuilt cache is refused, not served from old descriptors
        order = epoch_order(len(self.items), seed, epoch, shuffle=shuffle)
        chunks = epoch_batches(order, batch_size, drop_last, start)
        info = torch.utils.data.get_worker_info()
        if info is not None:
            chunks = chunks[info.id :: info.num_workers]
        stager = None
        if self._staged() and self.roi is None:
            from loaders.gpu import PinnedStager

            stager = PinnedStager(self.device, slots=prefetch + 1)
        yield from self._pipeline(chunks, max(1, prefetch), stager, pad)

    def _pipeline(self, chunks: list[np.ndarray], prefetch: int, stager: Any, pad: bool) -> Iterator[dict[str, Any]]:
        # Slot k % (prefetch + 1) is read into only after batch k - prefetch - 1 was uploaded out of it.
        read = self._read_roi_batch if self.roi is not None else self._read
        with ThreadPoolExecutor(prefetch, thread_name_prefix="blockprep-prefetch") as pool:
            pending: deque[Future[Any]] = deque()
            for k, chunk in enumerate(chunks):
                slot = k % (prefetch + 1) if stager is not None else -1
                pending.append(pool.submit(read, self.items[chunk], stager, slot))
                if len(pending) > prefetch:
                    yield self._collate(pending.popleft().result(), pad)
            while pending:
                yield self._collate(pending.popleft().result(), pad)

    def _read_roi_batch(self, items: Sequence[int], stager: Any = None, slot: int = -1) -> tuple[list[int], dict]:
        """The regions of every item of a batch in one region read: (items, {key: [tensor per item]})."""
        items = [int(i) for i in items]
        per_item = [self._roi_reads(i) for i in items]
        tensors = self._regions([r for reads in per_item for r in reads])
        out: dict[str, list[Any]] = {}
        at = 0
        for reads in per_item:
            for r in reads:
                out.setdefault(r.entry.key, []).append(tensors[at])
                at += 1
        return items, out

    def _collate(self, batch: _Batch | tuple[list[int], dict], pad: bool = False) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        shapes: dict[str, Any] = {}
        if isinstance(batch, _Batch):
            items = batch.items
            flat = self._flat_tensor(batch)
            for key in self.keys:
                found = [
                    (e, o)
                    for ents, offs in zip(batch.entries, batch.offsets)
                    for e, o in zip(ents, offs)
                    if e.key == key
                ]
                if not found:
                    continue
                e0, o0 = found[0]
                same = all(e.shape == e0.shape for e, _ in found) and e0.nbytes == align_up(e0.nbytes)
                if same and len(found) == len(items):  # back to back in the buffer: a zero-copy view
                    view = flat[o0 : o0 + e0.nbytes * len(found)]
                    out[key] = view.view(torch_dtype(e0.dtype)).reshape(len(found), *e0.shape)
                else:
                    out[key] = stack([self._tensor(flat, e, o) for e, o in found], pad, shapes, key)
        else:
            items, found_roi = batch
            for key in self.keys:
                if key in found_roi:
                    out[key] = stack(found_roi[key], pad, shapes, key)
        result = unflatten(out)
        result["_items"] = torch.as_tensor(items)
        if shapes:
            result["_shapes"] = shapes
        if self.meta:
            result["_meta"] = [line_meta(self.cache.meta(i)) for i in items]
        return self.transform(result) if self.transform is not None else result


def stack(tensors: list[Any], pad: bool, shapes: dict[str, Any] | None = None, key: str = "") -> Any:
    """Equal shapes: one stacked tensor. Unequal: the list, or with `pad` one tensor of the largest shape
    (each zero-padded at the end of every dim), the items' own shapes put in `shapes[key]` (B, ndim)."""
    import torch

    first = tensors[0]
    if all(t.shape == first.shape for t in tensors):
        return torch.stack(tensors)
    if not pad or any(t.dim() != first.dim() for t in tensors):
        return list(tensors)
    size = [max(t.shape[d] for t in tensors) for d in range(first.dim())]
    out = torch.zeros((len(tensors), *size), dtype=first.dtype, device=first.device)
    for b, t in enumerate(tensors):
        index: tuple[Any, ...] = (b, *(slice(0, n) for n in t.shape))
        out[index] = t
    if shapes is not None:
        shapes[key] = torch.tensor([list(t.shape) for t in tensors])
    return out


def collate(batch: Sequence[Any], pad: bool = False) -> Any:
    """A DataLoader `collate_fn` for items of unequal shapes (what `ds[i]` gives over real scans): the batch
    form of `iter_batches` — equal shapes stacked, unequal ones a list of tensors, or with `pad` one
    zero-padded tensor and `_shapes[key]`. Everything else goes through MONAI's `list_data_collate` (torch's
    `default_collate` without MONAI), so MetaTensors and their meta collate as MONAI does."""
    from torch.utils.data import default_collate

    from loaders.deps import has

    base = default_collate
    if has("monai"):
        from monai.data import list_data_collate

        base = list_data_collate
    first = batch[0]
    if not isinstance(first, dict):
        return base(list(batch))
    out: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    rest = [{k: v for k, v in item.items() if not _unequal(batch, k)} for item in batch]
    for key in first:
        if _unequal(batch, key):
            out[key] = stack([item[key] for item in batch], pad, shapes, key)
    out.update(base(rest))
    if shapes:
        out["_shapes"] = shapes
    return out


def pad_collate(batch: Sequence[Any]) -> Any:
    """`collate(batch, pad=True)`: unequal shapes zero-padded to the largest, their shapes in `_shapes`."""
    return collate(batch, pad=True)


def _unequal(batch: Sequence[Any], key: str) -> bool:
    values = [item.get(key) for item in batch]
    if not all(hasattr(v, "shape") and hasattr(v, "dim") for v in values):
        return False
    return any(v.shape != values[0].shape for v in values)


class _BatchesCore:
    """An IterableDataset of batches from `dataset.iter_batches(batch_size, **options)`.

    Give it to `DataLoader(..., batch_size=None, num_workers=n)`: each worker reads its share of batches."""

    def __init__(self, dataset: Any, batch_size: int, **options: Any) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.options = options
        self.epoch = 0
        self._start = 0  # batches of self.epoch a stopped run delivered (load_state_dict)
        self._delivered: int | None = None  # counted while iterated in this process

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """The epoch and the batches of it delivered, small JSON (the reads draw nothing at random).
        batches_done: the batches the training loop took this epoch, needed where a DataLoader's worker
        processes iterate copies of this dataset; counted here when it is iterated in this process."""
        done = self._delivered if batches_done is None else count("batches_done", batches_done, 0)
        if done is None:
            raise ArgumentValueError("PreparedBatches.state_dict: pass batches_done= (DataLoader workers iterate it)")
        epoch, batch = self.epoch, done
        if batch and batch >= len(self):
            epoch, batch = epoch + 1, 0
        return {"format": "blockprep-batches-state", "version": 1, "epoch": epoch, "batch": batch,
                "batch_size": self.batch_size, "n_items": len(self.dataset),
                "order": {k: self.options.get(k) for k in ("shuffle", "seed", "drop_last")}}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on from `state_dict()`: the next pass is the saved epoch without the batches it delivered (in a
        DataLoader with workers too: batches are left out before the workers split them)."""
        want = self.state_dict(0)
        for name in ("format", "version", "batch_size", "n_items", "order"):
            if not isinstance(saved, dict) or saved.get(name) != want[name]:
                got = saved.get(name) if isinstance(saved, dict) else saved
                raise LoaderStateError(
                    f"PreparedBatches.load_state_dict: the state has {name}={got!r}, this dataset "
                    f"{want[name]!r}; resume with the dataset it was saved from"
                )
        self.set_epoch(count("epoch", saved.get("epoch"), 0))
        self._start = count("batch", saved.get("batch"), 0)

    def set_epoch(self, epoch: int) -> None:
        """Order the following passes as epoch `epoch` (`loaders.order.epoch_order`, DistributedSampler's
        rule: the epoch changes only by set_epoch) when shuffle=True; a dataset made by
        `shard(..., shuffle=True)` takes that epoch's split too. After `load_state_dict`, the saved epoch
        keeps its saved place."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        options = dict(self.options)
        options["epoch"], options["start"], self._start = self.epoch, self._start, 0
        self._delivered = options["start"]
        for batch in self.dataset.iter_batches(self.batch_size, **options):
            self._delivered += 1
            yield batch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.options.get("drop_last") else -(-n // self.batch_size)


def _build() -> type:
    tud = require("torch", "PreparedBatches").utils.data
    cls = type(
        "PreparedBatches",
        (_BatchesCore, tud.IterableDataset),
        {"__module__": __name__, "__doc__": _BatchesCore.__doc__},
    )
    globals()["PreparedBatches"] = cls
    return cls


if TYPE_CHECKING:
    PreparedBatches = _BatchesCore
else:

    def __getattr__(name: str) -> Any:
        # Built on first use (a torch IterableDataset subclass), so importing this module imports no torch.
        if name == "PreparedBatches":
            return _build()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
