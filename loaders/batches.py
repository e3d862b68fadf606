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

from loaders.backends import Backend, ReadRequest
from loaders.buffers import BufferPool, torch_dtype
from loaders.deps import require
from loaders.errors import BackendError
from loaders.format import PreparedCache, TensorEntry, align_up, check, unflatten
from loaders.meta import line_meta


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
            result["_meta"] = [line_meta(self.cache.meta(i)) for i in batch.items]
        return self.transform(result) if self.transform is not None else result


class _BatchesCore:
    """An IterableDataset of batches from `dataset.iter_batches(batch_size, **options)`.

    Give it to `DataLoader(..., batch_size=None, num_workers=n)`: each worker reads its share of batches."""

    def __init__(self, dataset: Any, batch_size: int, **options: Any) -> None:
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
        return self.dataset.iter_batches(self.batch_size, **options)  # type: ignore[no-any-return]

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
