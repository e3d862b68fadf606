"""Region reads: fetch only the bytes a patch of a C-order tensor needs, in one backend batch.

A region `[start, start + shape)` of a C-order array is a set of contiguous byte runs. Reading every run
(one per row along the last axis) costs a request each; reading whole slabs costs bytes. `plan_region`
picks the axis at which to cut: each request covers the region along that axis and everything after it
(from the first needed byte to the last), so the request count is the product of the region's leading
extents. A cost model (per-request overhead against bandwidth) chooses the cut; when the region spans the
full trailing dims the runs merge for free. The bytes land in a buffer laid out like full slabs, so the
result is one strided numpy copy: exactly `full[slices]`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.backends.base import Backend, ReadRequest
from loaders.format import TensorEntry, align_up

# Cost model for choosing the cut axis: a request costs about this many seconds of overhead (syscall,
# queueing), bytes cost 1/bandwidth. Warm page-cache numbers; cold NVMe favours fewer, bigger requests too.
REQUEST_COST_S = 10e-6
BANDWIDTH_BPS = 5e9
# Buffered (posix) runs smaller than this on average are read in the calling thread, one after another.
SEQUENTIAL_BELOW = 1 << 20


@dataclass(frozen=True)
class RegionPlan:
    """How to read a region: `spans` requests (byte offset in the tensor, nbytes, offset inside its slab)."""

    axis: int  # requests are cut at this axis: one per index combination of the axes before it
    slab_shape: tuple[int, ...]  # shape of one request's slab: (region extent at axis, *full trailing dims)
    spans: list[tuple[int, int, int]]  # (tensor byte offset, nbytes, byte offset inside the slab)
    lead_shape: tuple[int, ...]  # region extents of the axes before `axis`

    @property
    def nbytes(self) -> int:
        """Bytes the plan reads."""
        return sum(n for _, n, _ in self.spans)


def _check(full: Sequence[int], start: Sequence[int], shape: Sequence[int], what: str) -> None:
    if len(start) != len(full) or len(shape) != len(full):
        raise ValueError(f"{what}: region start {tuple(start)} / shape {tuple(shape)} do not match {len(full)} dims")
    for s, n, f in zip(start, shape, full):
        if s < 0 or n < 1 or s + n > f:
            raise ValueError(f"{what}: region start {tuple(start)} shape {tuple(shape)} outside {tuple(full)}")


def _cost(full: Sequence[int], shape: Sequence[int], axis: int, itemsize: int) -> float:
    requests = int(np.prod(shape[:axis], dtype=np.int64))
    per = (shape[axis] - 1) * int(np.prod(full[axis + 1 :], dtype=np.int64)) + _tail_span(full, shape, axis)
    return requests * REQUEST_COST_S + requests * per * itemsize / BANDWIDTH_BPS


def _tail_span(full: Sequence[int], shape: Sequence[int], axis: int) -> int:
    """Elements from the first to the last needed one within one slab row at `axis` (inclusive)."""
    span = 1
    stride = 1
    for d in range(len(full) - 1, axis, -1):
        span += (shape[d] - 1) * stride
        stride *= full[d]
    return span


def plan_region(
    full: Sequence[int], itemsize: int, start: Sequence[int], shape: Sequence[int], axis: int | None = None
) -> RegionPlan:
    """Plan the requests for region `[start, start+shape)` of a C-order array of shape `full`."""
    full, start, shape = tuple(full), tuple(start), tuple(shape)
    _check(full, start, shape, "plan_region")
    if not full:
        return RegionPlan(0, (), [(0, itemsize, 0)], ())
    if axis is None:
        # Axes before the first partial one are free to cut at: cutting earlier reads the same bytes.
        axis = min(range(len(full)), key=lambda a: _cost(full, shape, a, itemsize))
    strides = [int(np.prod(full[d + 1 :], dtype=np.int64)) for d in range(len(full))]
    slab_stride = strides[axis]  # elements per index along `axis`
    slab_shape = (shape[axis], *full[axis + 1 :])
    inner = sum(start[d] * strides[d] for d in range(axis + 1, len(full)))  # first needed element in a slab row
    span = (shape[axis] - 1) * slab_stride + _tail_span(full, shape, axis)
    spans = []
    for lead in itertools.product(*(range(s, s + n) for s, n in zip(start[:axis], shape[:axis]))):
        base = sum(i * strides[d] for d, i in enumerate(lead)) + start[axis] * slab_stride
        spans.append(((base + inner) * itemsize, span * itemsize, inner * itemsize))
    return RegionPlan(axis, slab_shape, spans, tuple(shape[:axis]))


@dataclass(frozen=True)
class RegionRead:
    """The planned read of one tensor's region: its requests, and how the slabs become the region."""

    entry: TensorEntry
    start: tuple[int, ...]
    shape: tuple[int, ...]
    plan: RegionPlan

    @property
    def slab_bytes(self) -> int:
        """Bytes of one request's slab in the scratch buffer."""
        return int(np.prod(self.plan.slab_shape, dtype=np.int64)) * self.entry.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Scratch bytes this read needs (whole slabs; only the planned spans are read into them)."""
        return self.slab_bytes * len(self.plan.spans)

    def requests(self) -> list[ReadRequest]:
        """One request per span."""
        return [ReadRequest(self.entry.shard, self.entry.offset + off, n) for off, n, _ in self.plan.spans]

    def targets(self, buf: Any, at: int = 0) -> list[Any]:
        """Where each span lands in `buf` (whose slabs start at byte `at`)."""
        slab = self.slab_bytes
        return [buf[at + i * slab + pre : at + i * slab + pre + n] for i, (_, n, pre) in enumerate(self.plan.spans)]

    def assemble(self, host: np.ndarray, at: int = 0) -> np.ndarray:
        """The region from the slabs in host bytes `host[at:]`: one strided copy."""
        slabs = np.asarray(host[at : at + self.nbytes]).view(self.entry.dtype)
        slabs = slabs.reshape(*self.plan.lead_shape, *self.plan.slab_shape)
        axis = self.plan.axis
        trailing = tuple(slice(s, s + n) for s, n in zip(self.start[axis + 1 :], self.shape[axis + 1 :]))
        index: tuple[Any, ...] = (Ellipsis, *trailing)
        return np.ascontiguousarray(slabs[index] if trailing else slabs)


def plan_read(entry: TensorEntry, start: Sequence[int], shape: Sequence[int], axis: int | None = None) -> RegionRead:
    """Plan the read of region `[start, start+shape)` of one cached tensor (ValueError when outside it)."""
    _check(entry.shape, start, shape, f"{entry.shard}: item {entry.item} key '{entry.key}'")
    plan = plan_region(entry.shape, entry.dtype.itemsize, start, shape, axis)
    return RegionRead(entry, tuple(start), tuple(shape), plan)


def read_regions(
    backend: Backend, reads: Sequence[RegionRead], allocate: Callable[[int], Any] | None = None
) -> list[np.ndarray]:
    """Read several planned regions (e.g. the same patch of image and label) in one backend batch.

    `allocate(nbytes)` supplies the scratch buffer for the slabs (default: the backend's; PreparedDataset
    passes its pool of reused buffers, which saves the page faults of fresh memory)."""
    offsets = [0]
    for r in reads:
        offsets.append(offsets[-1] + align_up(r.nbytes))
    buf = (allocate if allocate is not None and not backend.gpu else backend.allocate)(max(offsets[-1], 1))
    requests = [q for r in reads for q in r.requests()]
    targets = [t for r, at in zip(reads, offsets) for t in r.targets(buf, at)]
    if backend.name == "posix" and sum(q.nbytes for q in requests) < SEQUENTIAL_BELOW * len(requests):
        # Buffered small runs are memcpy from the page cache: handing each to a pool thread costs more
        # than the copy (measured 2x slower on a warm 96^3 patch), so read them in this thread.
        for request, target in zip(requests, targets):
            backend.read_into([request], [target])
    else:
        backend.read_into(requests, targets)
    host: Any = buf
    if backend.gpu:  # device buffer: bring the slabs home once (region reads are for host pipelines)
        host = buf.get() if hasattr(buf, "get") else buf.cpu().numpy()  # cupy array or torch CUDA tensor
    return [r.assemble(host, at) for r, at in zip(reads, offsets)]


def read_region_entry(
    backend: Backend,
    entry: TensorEntry,
    start: Sequence[int],
    shape: Sequence[int],
    axis: int | None = None,
    allocate: Callable[[int], Any] | None = None,
) -> np.ndarray:
    """Read region `[start, start+shape)` of one cached tensor; equals `full[tuple(slices)]` exactly."""
    return read_regions(backend, [plan_read(entry, start, shape, axis)], allocate)[0]
