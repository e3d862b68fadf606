"""Batches of a PreparedDataset: one read of its `Reader` per batch (every tensor of every item in flight),
`prefetch` batches read ahead, collated into stacked tensors; and `PreparedBatches`, the IterableDataset that
hands them to a DataLoader.

`import loaders.batches` imports no torch: `PreparedBatches` (a torch IterableDataset) lives in
`loaders.torch_data`, loaded on first use of the name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from loaders.args import check_batches, count
from loaders.deps import has, require
from loaders.errors import ArgumentValueError, LoaderStateError
from loaders.meta import line_meta
from loaders.nesting import unflatten
from loaders.order import epoch_batches, epoch_order
from loaders.staging import Slot, packed_view, stack, view


def iter_batches(
    ds: Any,
    batch_size: int,
    prefetch: int = 2,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    pad: bool = False,
    epoch: int = 0,
    start: int = 0,
) -> Iterator[dict[str, Any]]:
    """`PreparedDataset.iter_batches` (see there): batches of `ds`, each one read of its `Reader`."""
    import torch

    check_batches(batch_size, prefetch, shuffle, seed, drop_last, pad, epoch)
    count("start", start, 0)
    ds.cache.check_current()  # per epoch: a rebuilt cache is refused, not served from old descriptors
    order = epoch_order(len(ds.items), seed, epoch, shuffle=shuffle)
    chunks = epoch_batches(order, batch_size, drop_last, start)
    info = torch.utils.data.get_worker_info()
    if info is not None:
        chunks = chunks[info.id :: info.num_workers]
    stager = None
    if ds.reader.staged and ds.roi is None:
        stager = ds.reader.stager(prefetch + 1)
    yield from _pipeline(ds, chunks, max(1, prefetch), stager, pad)


def _pipeline(ds: Any, chunks: list[np.ndarray], prefetch: int, stager: Any, pad: bool) -> Iterator[dict[str, Any]]:
    # Slot k % (prefetch + 1) is read into only after batch k - prefetch - 1 was uploaded out of it.
    read = _read_roi if ds.roi is not None else _read
    with ThreadPoolExecutor(prefetch, thread_name_prefix="blockprep-prefetch") as pool:
        pending: deque[Future[Any]] = deque()
        for k, chunk in enumerate(chunks):
            slot = Slot(stager, k % (prefetch + 1)) if stager is not None else None
            pending.append(pool.submit(read, ds, [int(i) for i in ds.items[chunk]], slot))
            if len(pending) > prefetch:
                items, got = pending.popleft().result()
                yield _collate(ds, items, got, pad)
        while pending:
            items, got = pending.popleft().result()
            yield _collate(ds, items, got, pad)


def _read(ds: Any, items: list[int], slot: Slot | None) -> tuple[list[int], Any]:
    """Every selected tensor of `items` in one backend call, key-major (all items' "image", then all
    "label"): a key's tensors of equal aligned size sit back to back, so a batch of them is a zero-copy view."""
    reader = ds.reader
    return items, reader.fetch(reader.plan(items, tags=range(len(items))), slot)


def _read_roi(ds: Any, items: list[int], slot: Slot | None) -> tuple[list[int], Any]:
    """The regions of every item of a batch in one region read: (items, {key: [tensor per item]})."""
    reader = ds.reader
    got = reader.fetch(reader.plan(items, [ds.roi_window(i) for i in items], key_major=False))
    out: dict[str, list[Any]] = {}
    for (_, read), t in zip(got.plan.regions, reader.region_tensors(got)):
        out.setdefault(read.entry.key, []).append(t)
    return items, out


def _collate(ds: Any, items: list[int], got: Any, pad: bool = False) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    if isinstance(got, dict):  # regions, per key
        out = {key: stack(got[key], pad, shapes, key) for key in ds.keys if key in got}
    else:
        flat = ds.reader.upload(got)
        places = got.places
        for key in ds.keys:
            run = [p for p in places if p[1] == key]
            if not run:
                continue
            one = packed_view(flat, run) if len(run) == len(items) else None  # back to back: a zero-copy view
            out[key] = one if one is not None else stack([view(flat, *p[2:]) for p in run], pad, shapes, key)
    result = unflatten(out)
    result["_items"] = torch.as_tensor(items)
    if shapes:
        result["_shapes"] = shapes
    if ds.meta:
        result["_meta"] = [line_meta(ds.cache.meta(i)) for i in items]
    return ds.transform(result) if ds.transform is not None else result


def collate(batch: Sequence[Any], pad: bool = False) -> Any:
    """A DataLoader `collate_fn` for items of unequal shapes (what `ds[i]` gives over real scans): the batch
    form of `iter_batches` — equal shapes stacked, unequal ones a list of tensors, or with `pad` one
    zero-padded tensor and `_shapes[key]`. Everything else goes through MONAI's `list_data_collate` (torch's
    `default_collate` without MONAI), so MetaTensors and their meta collate as MONAI does."""
    from torch.utils.data import default_collate

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


class BatchesCore:
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


if TYPE_CHECKING:
    pass
else:

    def __getattr__(name: str) -> Any:
        # the torch IterableDataset lives in loaders.torch_data, so importing this module imports no torch
        if name == "PreparedBatches":
            require("torch", "PreparedBatches")
            from loaders.torch_data import PreparedBatches

            return PreparedBatches
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
