"""The device tier: whole items kept on the GPU, up to a budget of bytes, so later epochs slice them there.

`PreparedLoader(gpu_budget=...)` fills it lazily during the first epoch: the read thread reserves an item's
bytes when it plans a batch (`reserve`: the item is then read whole), and the batch's assembly admits the
items' tensors (`admit_all`: copies, not views of the batch's staging buffer; a batch's items in one buffer a
dtype). A crop of a resident item is a slice of it, a fresh crop every epoch; items beyond the budget stream from
the page cache or the disk.
`auto_budget` is `gpu_budget="auto"`: the whole dataset (`dataset_bytes`) when it fits in half the device's
free memory, else that half; none on the CPU. Byte sizes ("8GiB") are parsed by `loaders.args.parse_bytes`.
"""

from __future__ import annotations

import math
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
        self.admit_all({item: tensors}, {item: nbytes})

    def admit_all(self, got: dict[int, dict[str, Any]], nbytes: dict[int, int]) -> None:
        """Keep copies of the items' tensors (not views of a batch buffer), those of one dtype and device copied
        at once (`packed_copies`: a few kernels for a batch's items, not one copy each: on a GPU each copy is a
        launch, and in the feeder's child a turn on the GPU beside the training's; `mednist` admits 512 a batch)."""
        new = {item: tensors for item, tensors in got.items() if item not in self.items}
        groups: dict[tuple[Any, Any], list[tuple[int, str, Any]]] = {}
        for item, tensors in new.items():
            for key, t in tensors.items():
                groups.setdefault((t.dtype, t.device), []).append((item, key, t))
        copies: dict[tuple[int, str], Any] = {}
        for members in groups.values():
            for (item, key, _), copy in zip(members, packed_copies([t for _, _, t in members])):
                copies[item, key] = copy
        for item, tensors in new.items():
            self.items[item] = {k: copies[item, k] for k in tensors}
            self.nbytes += nbytes[item]

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


ALIGN = 64  # bytes: where each copy starts in its buffer (vectorised kernels read 16-byte-aligned data)


def packed_copies(tensors: list[Any]) -> list[Any]:
    """Copies of `tensors` (plain tensors of one dtype and device), each a view of one new buffer at an `ALIGN`-byte
    boundary, made by one `torch.cat` (a few kernels on a GPU) where they are plain; a tensor subclass is cloned on
    its own (a cat of subclasses would run their own logic)."""
    import torch

    plain = [t for t in tensors if type(t) is torch.Tensor]
    if len(plain) < 2:
        return [t.clone() for t in tensors]
    first = plain[0]
    step = max(1, ALIGN // first.element_size())
    pad = torch.empty(step, dtype=first.dtype, device=first.device)  # never read: the gaps between copies
    parts, spans, at = [], [], 0
    for t in plain:
        parts.append(t.reshape(-1))
        spans.append((at, t.shape))
        at += t.numel()
        gap = -at % step
        if gap:
            parts.append(pad[:gap])
            at += gap
    buffer = torch.cat(parts)
    views = iter([buffer[a : a + math.prod(shape)].view(shape) for a, shape in spans])
    return [next(views) if type(t) is torch.Tensor else t.clone() for t in tensors]
