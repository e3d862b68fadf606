"""Staging: where a read's bytes land and how they become tensors on the reader's device.

- `BufferPool`: reused host read buffers (fresh memory costs a page fault and zeroing per 4 KiB);
- `PinnedStager`: pinned (up to `tunables.PIN_MAX_BYTES`), 4 KiB-aligned host slots and one copy stream, where
  host backends (`direct`, `posix`) feed a GPU: a slot is read into again only after the copy out of it
  finished, so reading batch k+1 overlaps copying batch k (double buffering);
- `Slot`: one slot of a `PinnedStager`, what a host backend reads into when a GPU is fed (one async copy up, on
  the stager's stream);
- `upload`: the one host-to-device step: a read buffer as one flat uint8 tensor on the device (a pinned
  slot: one async copy; a GPU backend's buffer: wrapped in place; host memory on the CPU: zero-copy);
- `host_array`: the one place that tells a device buffer (cupy, torch CUDA) from a host one;
- `view`, `packed_view`, `stack`: bytes of a flat buffer as typed tensors (`loaders.cache.dtypes`: which), and
  a batch's tensors stacked (or padded, or left a list when shapes differ).

`import loaders.reading.staging` imports no torch; the stager runs only where torch sees a GPU (its tests are
marked `gpu`).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.backends.base import aligned_empty, pinned_empty
from loaders.cache.dtypes import torch_dtype
from loaders.deps import require
from loaders.tunables import PIN_MAX_BYTES

Place = tuple[Any, str, int, np.dtype, tuple[int, ...]]  # (tag, key, byte offset in the buffer, dtype, shape)


class BufferPool:
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


class PinnedStager:
    """Pinned host slots (pageable beyond `tunables.PIN_MAX_BYTES`) and one copy stream for `device` ("cuda:N")."""

    def __init__(self, device: str, slots: int = 2) -> None:
        torch = require("torch", "GPU delivery")
        self.device = torch.device(device)
        self._slots: list[Any] = [None] * max(1, slots)  # pinned torch tensors, 4 KiB-aligned
        self._views: list[np.ndarray | None] = [None] * max(1, slots)
        self._events: list[Any] = [None] * max(1, slots)
        self.stream = torch.cuda.Stream(device=self.device)

    @property
    def slots(self) -> int:
        """Number of staging slots."""
        return len(self._slots)

    def host(self, slot: int, nbytes: int) -> np.ndarray:
        """A pinned, 4 KiB-aligned uint8 host buffer of `nbytes` for `slot`, free to overwrite (waits for
        its last copy)."""
        self.acquire(slot)
        view = self._views[slot]
        if view is None or view.nbytes < nbytes:
            # grow with headroom: batches of a dataset differ a little in size (the last one, padding)
            size = nbytes + nbytes // 8
            if size <= PIN_MAX_BYTES:
                self._slots[slot], self._views[slot] = pinned_empty(size)
            else:  # pageable (tunables.PIN_MAX_BYTES): its copy up returns once the bytes are out of it
                import torch

                view = aligned_empty(size)
                self._slots[slot], self._views[slot] = torch.from_numpy(view), view
            view = self._views[slot]
            assert view is not None
        return view[:nbytes]

    def acquire(self, slot: int) -> None:
        """Block until the last copy out of `slot` has finished."""
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None

    def upload(self, slot: int, nbytes: int) -> Any:
        """Copy the slot's first `nbytes` to a new device tensor, asynchronously on the copy stream.

        The caller's current stream waits for the copy, so using the result there is safe at once."""
        import torch

        src = self._slots[slot][:nbytes]
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[slot] = event
        current.wait_stream(self.stream)
        dst.record_stream(current)  # the allocator must not reuse dst before the consumer's stream is done
        return dst


def host_array(buf: Any) -> np.ndarray:
    """`buf`'s bytes as a host numpy array: a device buffer (cupy array, torch CUDA tensor) is copied down,
    host memory is viewed. The one place that tells the two apart."""
    if isinstance(buf, np.ndarray):
        return buf
    if hasattr(buf, "get"):  # cupy
        return np.asarray(buf.get())
    if hasattr(buf, "cpu"):  # torch
        return np.asarray(buf.cpu().numpy())
    return np.asarray(buf)


@dataclass(frozen=True)
class Slot:
    """Staging slot `index` (modulo its count) of a `PinnedStager`."""

    stager: Any
    index: int

    def host(self, nbytes: int) -> np.ndarray:
        """The slot's pinned host memory, free to overwrite (waits for the slot's last copy)."""
        return self.stager.host(self.index % self.stager.slots, nbytes)  # type: ignore[no-any-return]


def upload(buf: Any, nbytes: int, slot: Slot | None, on_device: bool, device: Any) -> Any:
    """The first `nbytes` of a read buffer as one flat uint8 tensor on `device`: from a pinned `slot` one async
    copy on its stream, a device buffer (`on_device`, a GPU backend's) wrapped, host memory viewed."""
    import torch

    if slot is not None:
        return slot.stager.upload(slot.index % slot.stager.slots, nbytes)
    if on_device:
        return torch.as_tensor(buf[:nbytes], device=device)
    return torch.from_numpy(np.asarray(buf[:nbytes]))


def values_to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """`batch` with its collated host tensors (class labels and other numbers of the head or the tail) on the
    GPU `device` too, copied from pinned memory on the current stream: a training loop's `.to(device)` of a
    pageable tensor would wait for every step queued before it. `_items` stays on the host."""
    import torch

    for key, value in batch.items():
        if key != "_items" and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            batch[key] = value.pin_memory().to(device, non_blocking=True)
    return batch


def view(flat: Any, at: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    """The tensor of `dtype` and `shape` at byte `at` of a flat uint8 tensor (a view)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return flat[at : at + nbytes].view(torch_dtype(dtype)).reshape(shape)


def packed_view(flat: Any, run: Sequence[Place]) -> Any:
    """The tensors of `run` (places: tag, key, byte offset, dtype, shape) as one (len(run), ...) view of `flat`
    when they are of one key, dtype and shape and lie back to back in order; None otherwise."""
    _, key, at, dtype, shape = run[0]
    nb = math.prod(shape) * np.dtype(dtype).itemsize
    if at % np.dtype(dtype).itemsize or any(
        p[1] != key or p[2] != at + i * nb or p[3] != dtype or p[4] != shape for i, p in enumerate(run)
    ):
        return None
    return flat[at : at + len(run) * nb].view(torch_dtype(dtype)).reshape(len(run), *shape)


def landed(
    flat: Any, places: Sequence[Place], packed: Sequence[str] = (), rows: int = 0
) -> tuple[dict[str, Any] | None, dict[Any, dict[str, Any]]]:
    """One read's tensors in its uploaded buffer `flat`. With `packed` keys: each key's `rows` crops as one
    (rows, ...) view where they lie back to back in batch order with equal shapes, as (batch, {}); otherwise
    (None, {tag: {key: view}}) from the read's places (tag, key, offset, dtype, shape)."""
    if packed:
        batch = _packed(flat, places, list(packed), rows)
        if batch is not None:
            return batch, {}
    by_tag: dict[Any, dict[str, Any]] = {}
    for tag, key, at, dtype, shape in places:
        by_tag.setdefault(tag, {})[key] = view(flat, at, dtype, shape)
    return None, by_tag


def _packed(flat: Any, places: Sequence[Place], keys: list[str], n: int) -> dict[str, Any] | None:
    """Each key's `n` crops as one (n, ...) view of `flat` when they lie back to back in batch order with
    equal shapes (key-major region reads of one batch); None otherwise."""
    if len(places) != n * len(keys):
        return None
    out = {}
    for j, key in enumerate(keys):
        run = places[j * n : (j + 1) * n]
        got = packed_view(flat, run) if run[0][1] == key else None
        if got is None:
            return None
        out[key] = got
    return out


def stack(tensors: list[Any], pad: bool = False, shapes: dict[str, Any] | None = None, key: str = "") -> Any:
    """Equal shapes: one stacked tensor. Unequal: the list, or with `pad` one tensor of the largest shape
    (each zero-padded at the end of every dim), the items' own shapes put in `shapes[key]` (B, ndim)."""
    import torch

    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # values the tail saw (names, labels) stay a list
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
