"""Batches of a PreparedDataset: one read of its `Reader` per batch (every tensor of every item in flight),
`prefetch` batches read ahead, collated into stacked tensors; and `PreparedBatches`, the IterableDataset that
hands them to a DataLoader.

`import loaders.faces.batches` imports no torch: `PreparedBatches` (a torch IterableDataset) lives in
`loaders.faces.torch_data`, loaded on first use of the name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from loaders import state
from loaders.args import check_batches, count
from loaders.cache.meta import line_meta
from loaders.cache.nesting import unflatten
from loaders.cache.order import epoch_batches, epoch_order
from loaders.deps import has
from loaders.errors import ArgumentValueError
from loaders.reading.ahead import InOrder
from loaders.reading.staging import Slot, packed_view, stack, view


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
    with InOrder(prefetch, "blockprep-prefetch") as ahead:
        for k, chunk in enumerate(chunks):
            slot = Slot(stager, k % (prefetch + 1)) if stager is not None else None
            ahead.submit(read, ds, [int(i) for i in ds.items[chunk]], slot)
            if len(ahead) > prefetch:
                items, got = ahead.take()
                yield _collate(ds, items, got, pad)
        while ahead:
            items, got = ahead.take()
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

    def _order(self) -> dict[str, Any]:
        """What a state must match: the cache and the epoch's order (no random transform: reads draw nothing)."""
        manifest = self.dataset.cache.manifest
        return {"fingerprint": state.fingerprint(manifest, []), "seed": self.options.get("seed"),
                "shuffle": self.options.get("shuffle"), "rank": 0, "world": 1, "batch_size": self.batch_size,
                "drop_last": self.options.get("drop_last"), "n_items": len(self.dataset)}  # fmt: skip

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """The epoch and the batches of it delivered, small JSON in the loader's state format (`loaders.state`;
        the reads draw nothing at random). batches_done: the batches the training loop took this epoch,
        needed where a DataLoader's worker processes iterate copies of this dataset; counted here when it is
        iterated in this process."""
        done = self._delivered if batches_done is None else count("batches_done", batches_done, 0)
        if done is None:
            raise ArgumentValueError("PreparedBatches.state_dict: pass batches_done= (DataLoader workers iterate it)")
        epoch, batch = self.epoch, done
        if batch and batch >= len(self):
            epoch, batch = epoch + 1, 0
        return {"format": "blockprep-loader-state", "version": state.VERSION, **self._order(), "epoch": epoch,
                "batch": batch, "transforms": [], "random": []}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on from `state_dict()`: the next pass is the saved epoch without the batches it delivered (in a
        DataLoader with workers too: batches are left out before the workers split them). Refused in one line
        (LoaderStateError) when the state belongs to another cache or order."""
        state.check(saved, self._order(), "PreparedBatches.load_state_dict")
        self.set_epoch(saved["epoch"])
        self._start = saved["batch"]

    def set_epoch(self, epoch: int) -> None:
        """Order the following passes as epoch `epoch` (`loaders.cache.order.epoch_order`, DistributedSampler's
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
