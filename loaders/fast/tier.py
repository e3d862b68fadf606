"""The device tier: whole items kept on the GPU, up to a budget of bytes, so later epochs slice them there.

`PreparedLoader(gpu_budget=...)` fills it lazily during the first epoch: the read thread reserves an item's
bytes when it plans a batch (`reserve`: the item is then read whole), and the batch's assembly admits the
item's tensors (`admit`: a copy, not a view of the batch's staging buffer). A crop of a resident item is a
slice of it, a fresh crop every epoch; items beyond the budget stream from the page cache or the disk.
`auto_budget` is `gpu_budget="auto"`: the whole dataset (`dataset_bytes`) when it fits in half the device's
free memory, else that half; none on the CPU. Byte sizes ("8GiB") are parsed by `loaders.args.parse_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.format import PreparedCache

__all__ = ["DeviceTier", "auto_budget", "dataset_bytes"]


class DeviceTier:
    """Items' whole tensors on the device, up to `budget` bytes (item -> {key: tensor})."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.items: dict[int, dict[str, Any]] = {}
        self.nbytes = 0  # bytes held
        self._reserved = 0  # bytes held plus those promised to reads in flight
        self._promised: set[int] = set()

    def __contains__(self, item: object) -> bool:
        return item in self.items

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.items[item]

    def __len__(self) -> int:
        return len(self.items)

    def reserve(self, item: int, nbytes: int) -> bool:
        """Promise `item`'s `nbytes` to the tier when they fit and it was not promised yet: True means read it
        whole and `admit` it."""
        if self._reserved + nbytes <= self.budget and item not in self._promised:
            self._reserved += nbytes
            self._promised.add(item)
            return True
        return False

    def admit(self, item: int, tensors: dict[str, Any], nbytes: int) -> None:
        """Keep copies of `item`'s tensors (not views of a batch buffer)."""
        if item not in self.items:
            self.items[item] = {k: t.clone() for k, t in tensors.items()}
            self.nbytes += nbytes

    def settle(self) -> None:
        """Forget the promises of reads that never finished (an epoch left early): what is held stays."""
        self._promised, self._reserved = set(self.items), self.nbytes

    def adopt(self, items: dict[int, dict[str, Any]]) -> None:
        """Hold `items` as they are (the training process's tier, opened here through CUDA IPC: the feeder's
        child starts with the tier already filled, not a second copy of it)."""
        for item, tensors in items.items():
            if item not in self.items:
                self.items[item] = tensors
                self.nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.settle()

    def shareable(self, most: int) -> bool:
        """Whether the tier is worth sending to the feeder's child: held, and at most `most` tensors (each is one
        IPC handle sent and opened)."""
        return 0 < sum(len(t) for t in self.items.values()) <= most

    def clear(self) -> None:
        """Drop every item."""
        self.items.clear()
        self._promised.clear()
        self.nbytes = self._reserved = 0


def dataset_bytes(cache_dir: str | Path, keys: Sequence[str] | None = None) -> int:
    """Bytes of every tensor (of `keys`) in a cache: what holding it whole on a device costs."""
    cache = PreparedCache(cache_dir)
    if not len(cache.index):
        return 0
    wanted = [i for i, k in enumerate(cache.keys) if keys is None or k in keys]
    return int(np.asarray(cache.index["nbytes"])[np.isin(cache.index["key"], wanted)].sum())


def auto_budget(device: Any, cache_dir: str | Path, keys: Sequence[str] | None) -> int:
    """gpu_budget="auto": the dataset when it fits in half the device's free memory, else that half; 0 on
    the CPU, where the page cache is the tier: the kernel reclaims it under memory pressure (a memory cgroup's
    limit included), while items held in the process would be a second copy nothing can reclaim."""
    if device.type != "cuda":
        return 0
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return min(dataset_bytes(cache_dir, keys), free // 2)
