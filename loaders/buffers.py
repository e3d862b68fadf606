"""Host buffers that reads land in: a pool of reused buffers and pinned (page-locked) staging memory. Shared
by the `Reader` (`loaders.reads`), GPU staging (`loaders.gpu`) and kvikio."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from loaders.deps import require
from loaders.format import ALIGN


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


def pinned_empty(nbytes: int, align: int = ALIGN) -> tuple[Any, np.ndarray]:
    """(owner, view): a page-locked uint8 host buffer of `nbytes` starting at an `align` boundary.

    `owner` is the pinned torch tensor that host-to-device copies read from; `view` is the numpy view of
    the same memory that backends read into. Pinned allocations are usually page-aligned already;
    the slack guarantees it whatever allocator sits underneath."""
    torch = require("torch", "GPU delivery")
    raw = torch.empty(max(nbytes, 1) + align, dtype=torch.uint8, pin_memory=True)
    start = (-raw.data_ptr()) % align
    owner = raw[start : start + max(nbytes, 1)]
    return owner, owner.numpy()
