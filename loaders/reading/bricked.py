"""Region reads from a cache's bricks (`loaders.cache.bricks`): the blocks a region touches, in runs.

The blocks of a region `[start, start + shape)` form a box of the block grid, `lo = start // block` to
`hi = ceil((start + shape) / block)`. Along the grid's last axis the box's blocks lie side by side in the file, so
a read is one run per index of the other grid axes. The runs land in a compact buffer (the box's blocks in C
order), from which the region is one gather: blocks interleaved back into voxels, then sliced.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from loaders.backends.base import ReadRequest
from loaders.cache.bricks import BrickEntry
from loaders.cache.format import TensorEntry


@dataclass(frozen=True)
class BrickRead:
    """The planned read of one tensor's region from its blocks (the interface of `region.RegionRead`)."""

    entry: TensorEntry
    start: tuple[int, ...]
    shape: tuple[int, ...]
    brick: BrickEntry

    @cached_property
    def _lo(self) -> tuple[int, ...]:
        return tuple(s // b for s, b in zip(self.start, self.brick.block))

    @cached_property
    def _box(self) -> tuple[int, ...]:
        """Blocks of the region along each grid axis."""
        return tuple(-(-(s + n) // b) - lo for s, n, b, lo in zip(self.start, self.shape, self.brick.block, self._lo))

    @property
    def base(self) -> int:
        """Where the tensor's blocks begin in their file."""
        return self.brick.offset

    @property
    def count(self) -> int:
        """Requests this read makes: one per index of the box's grid axes but the last."""
        return math.prod(self._box[:-1]) if self._box else 1

    @property
    def nbytes(self) -> int:
        """Scratch bytes: the box's blocks."""
        return math.prod(self._box) * self.brick.block_bytes

    @cached_property
    def runs(self) -> list[tuple[int, int, int]]:
        """(offset in the file, nbytes, offset in the compact box) of each run (planned once a read)."""
        grid, box, lo, per = self.brick.grid, self._box, self._lo, self.brick.block_bytes
        if not grid:
            return [(self.brick.offset, per, 0)]
        strides = [math.prod(grid[d + 1 :]) for d in range(len(grid))]
        run = box[-1] * per
        out = []
        for k, lead in enumerate(itertools.product(*(range(a, a + n) for a, n in zip(lo[:-1], box[:-1])))):
            flat = sum(i * s for i, s in zip(lead, strides)) + lo[-1]
            out.append((self.brick.offset + flat * per, run, k * run))
        return out

    def requests(self) -> list[ReadRequest]:
        """One request per run of blocks."""
        return [ReadRequest(self.brick.path, off, n) for off, n, _ in self.runs]

    def targets(self, buf: Any, at: int = 0) -> list[Any]:
        """Where each run lands in `buf` (the compact box from byte `at`)."""
        return [buf[at + t : at + t + n] for _, n, t in self.runs]

    def assemble(self, host: np.ndarray, at: int = 0) -> np.ndarray:
        """The region from the compact box in `host[at:]`."""
        return self.gather(np.asarray(host), [at + t for _, _, t in self.runs])

    def gather(self, buf: np.ndarray, places: list[int]) -> np.ndarray:
        """The region out of `buf`, where run k of `runs` begins at byte `places[k]` (the compact box, or the
        runs as a cold read's merged requests left them). A group of runs (one index of every grid axis but the last
        two) spaced at one stride is one strided view: its blocks interleaved into voxels by one copy, and the part
        of the region it holds copied out of that."""
        box, n = self._box, len(self.brick.block)
        out = np.empty(self.shape, self.entry.dtype)
        if n == 1:
            self._put(out, buf, (), 1, places[0], 0)
            return out
        rows = box[-2]
        for g, lead in enumerate(itertools.product(*(range(k) for k in box[:-2]))):
            p = places[g * rows : (g + 1) * rows]
            stride = p[1] - p[0] if rows > 1 else 0
            if all(b - a == stride for a, b in zip(p, p[1:])):
                self._put(out, buf, (*lead, 0), rows, p[0], stride)
            else:  # runs of one group in two merged reads: one at a time
                for y, place in enumerate(p):
                    self._put(out, buf, (*lead, y), 1, place, 0)
        return out

    def _put(self, out: np.ndarray, buf: np.ndarray, at: tuple[int, ...], rows: int, place: int, stride: int) -> None:
        """Copy into `out` the part of the region held by `rows` runs from box index `at` (all grid axes but the
        last; the second-to-last counts up over the runs), the first at byte `place` of `buf`, the next `stride`
        bytes on."""
        block, lo, n = self.brick.block, self._lo, len(self.brick.block)
        bstrides = tuple(math.prod(block[d + 1 :]) * self.entry.dtype.itemsize for d in range(n))
        runs = (rows,) if n > 1 else ()
        view = np.ndarray((*runs, self._box[-1], *block), self.entry.dtype, buf, place,
                          ((stride,) if n > 1 else ()) + (self.brick.block_bytes, *bstrides))  # fmt: skip
        if n > 1:  # (runs, blocks, b0..) -> (b0..b(n-3), runs, b(n-2), blocks, b(n-1))
            view = view.transpose([*range(2, n), 0, n, 1, n + 1])
        sizes = [*block[: n - 2], *([rows * block[-2]] if n > 1 else []), self._box[-1] * block[-1]]
        voxels = view.reshape(sizes)
        first = [(lo[d] + at[d]) * block[d] for d in range(n - 1)] + [lo[-1] * block[-1]]
        src, dst = [], []
        for d in range(n):
            a = max(first[d], self.start[d])
            b = min(first[d] + sizes[d], self.start[d] + self.shape[d])
            src.append(slice(a - first[d], b - first[d]))
            dst.append(slice(a - self.start[d], b - self.start[d]))
        out[tuple(dst)] = voxels[tuple(src)]
