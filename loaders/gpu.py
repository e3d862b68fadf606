"""GPU delivery for host backends: pinned, 4 KiB-aligned staging buffers and asynchronous copies on a stream.

Where kvikio is missing (or the GPU is AMD under ROCm PyTorch, whose `torch.cuda` is HIP), host backends
(`auto`: `direct`, O_DIRECT for cold data, a buffered copy for cached data) read straight into page-locked
host memory, then one `non_blocking` host-to-device copy per batch goes on a side stream. Slots are reused
round-robin: a slot is read into again only after the copy out of it has finished (its event), so reading
batch k+1 overlaps copying batch k (double buffering).

Slots start at a 4 KiB boundary so that O_DIRECT reads land in them without a bounce buffer.

Runs only where torch sees a GPU: tests are marked `gpu`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loaders.buffers import pinned_empty
from loaders.deps import require

__all__ = ["PinnedStager", "pinned_empty"]


class PinnedStager:
    """Pinned host slots and one copy stream for `device` ("cuda:N")."""

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
            self._slots[slot], self._views[slot] = pinned_empty(nbytes + nbytes // 8)
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
