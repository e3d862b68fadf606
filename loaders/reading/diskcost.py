"""What a request costs against what a byte costs, on the disk a cold region read goes to.

A cold region read merges two runs of one file into one request where the gap between them is cheaper to read
than a request is to make (`CostModel.gap`). Which it is depends on the disk: node-local NVMe serves hundreds of
thousands of small requests a second, so reading a gap rarely pays and a crop's blocks are read alone (the
fewest bytes); a virtual disk that serves 20,000 (4 KiB) or 2,500 (64 KiB) a second reads faster in merged runs,
more bytes and fewer requests. So the model is measured, once per process and device, on the files about to be
read: O_DIRECT reads at random 4 KiB-aligned offsets, 64 KiB (about a crop's run: some virtual disks serve these at
a tenth of their sequential rate) then 1 MiB, as many in flight as cold reads use.
Where it cannot be measured (no O_DIRECT backend, files too small to say) it is `COLD_COST`.

Whether a cold crop is read from a cache's bricks (fewer bytes, more and smaller requests) or from the cache itself
is not left to the model: on the virtual disks measured here the model favoured the bricks where they were slower
(requests of a few hundred KB served at a fraction of the sequential rate, and the gathering on the host). So
`BrickTrial` times both on the first cold reads of a cache, in turn, and keeps the faster by seconds per crop byte.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.backends.base import Backend, ReadRequest
from loaders.cache.spec import ALIGN


@dataclass(frozen=True)
class CostModel:
    """What a request costs against what a byte costs: a gap between two runs shorter than
    `request_s * bandwidth_bps` bytes is cheaper to read (and discard) than to skip with a new request."""

    request_s: float  # seconds one request costs beyond its bytes (latency not hidden by the queue)
    bandwidth_bps: float  # bytes per second

    @property
    def gap(self) -> int:
        """The largest gap worth reading through."""
        return int(self.request_s * self.bandwidth_bps)


# Where the disk is not measured: a small VM's virtio disk (O_DIRECT into faulted-in aligned buffers, after
# eviction; docs/benchmarks.md, Loaders): ~40 us a request beyond its bytes, ~4.5 GB/s for large reads in flight
# together, so gaps up to ~180 KB are read through.
COLD_COST = CostModel(40e-6, 4.5e9)
MEASURE_FROM = 64 << 20  # files holding fewer bytes than this are not measured (too few places to read)
_SMALL, _LARGE = 64 << 10, 1 << 20

_MEASURED: dict[tuple[int, int], CostModel] = {}  # (pid, st_dev) -> the model measured there
_LOCK = threading.Lock()


def disk_cost(backend: Backend, paths: Sequence[str], inflight: int, run: Callable[..., None]) -> CostModel:
    """The cost model of the device holding `paths` (measured once per process and device, with `run(backend,
    requests, targets, inflight)`, the cold reads' own way of issuing requests), or COLD_COST."""
    if getattr(backend, "name", "") != "direct" or not paths:
        return COLD_COST
    try:
        key = (os.getpid(), os.stat(paths[0]).st_dev)  # one stat a cold read; the files' sizes only to measure
        with _LOCK:
            if key not in _MEASURED:
                sizes = [(p, os.stat(p)) for p in dict.fromkeys(paths)]
                files = [(p, st.st_size - st.st_size % ALIGN) for p, st in sizes if st.st_dev == key[1]]
                _MEASURED[key] = measure(backend, files, inflight, run) or COLD_COST
            return _MEASURED[key]
    except OSError:
        return COLD_COST


def measure(
    backend: Backend, files: Sequence[tuple[str, int]], inflight: int, run: Callable[..., None], seed: int = 0
) -> CostModel | None:
    """request_s and bandwidth_bps from reads at random aligned offsets of `files` ((path, usable bytes)): 4 per
    request in flight of 64 KiB (at most 128), 2 of 1 MiB (at most 32: about 0.05 s where a disk reads 1 GB/s).
    None where the files hold under MEASURE_FROM."""
    files = [(p, n) for p, n in files if n >= _LARGE]
    if sum(n for _, n in files) < MEASURE_FROM:
        return None
    rng = np.random.default_rng(seed)
    n_small, n_large = min(4 * inflight, 128), min(2 * inflight, 32)
    small = _timed(backend, _places(files, n_small, _SMALL, rng), inflight, run)
    large = _timed(backend, _places(files, n_large, _LARGE, rng), inflight, run)
    bandwidth = n_large * _LARGE / large
    request_s = max(small / n_small - _SMALL / bandwidth, 0.0)
    return CostModel(request_s, bandwidth)


class BrickTrial:
    """Cold reads of one cache from its bricks or from itself: each way timed on `rounds` reads, in turn (the
    first from the bricks), then the one with fewer seconds per crop byte (medians) kept for the process."""

    def __init__(self, rounds: int = 3) -> None:
        self.rounds = rounds
        self.seconds: dict[bool, list[float]] = {True: [], False: []}
        self.chosen: bool | None = None

    def pick(self) -> bool:
        """Whether the next cold read goes to the bricks."""
        if self.chosen is not None:
            return self.chosen
        return len(self.seconds[True]) <= len(self.seconds[False])

    def record(self, bricks: bool, seconds: float, nbytes: int) -> None:
        """One cold read's time for `nbytes` of crops, read the way `bricks` says."""
        if self.chosen is not None or nbytes <= 0:
            return
        self.seconds[bricks].append(seconds / nbytes)
        if min(len(v) for v in self.seconds.values()) >= self.rounds:
            median = {k: sorted(v)[len(v) // 2] for k, v in self.seconds.items()}
            self.chosen = median[True] < median[False]


_TRIALS: dict[tuple[int, str], BrickTrial] = {}  # (pid, the cache's bricks folder) -> its trial


def brick_trial(folder: str) -> BrickTrial:
    """The trial of the cache whose bricks lie in `folder`, in this process."""
    with _LOCK:
        return _TRIALS.setdefault((os.getpid(), folder), BrickTrial())


def _places(files: Sequence[tuple[str, int]], n: int, nbytes: int, rng: Any) -> list[ReadRequest]:
    """`n` requests of `nbytes` at random aligned offsets, each in a file drawn by its size."""
    sizes = np.array([s for _, s in files], dtype=np.float64)
    picks = rng.choice(len(files), size=n, p=sizes / sizes.sum())
    out = []
    for f in picks.tolist():
        path, size = files[f]
        out.append(ReadRequest(path, int(rng.integers(0, (size - nbytes) // ALIGN + 1)) * ALIGN, nbytes))
    return out


def _timed(backend: Backend, requests: list[ReadRequest], inflight: int, run: Callable[..., None]) -> float:
    """Seconds to read `requests`, `inflight` at a time, into one aligned buffer."""
    size = requests[0].nbytes
    buf = backend.allocate(size * len(requests))
    buf[:] = 0  # faulted in before the clock starts
    targets = [buf[k * size : (k + 1) * size] for k in range(len(requests))]
    start = time.perf_counter()
    run(backend, requests, targets, inflight)
    return max(time.perf_counter() - start, 1e-9)
