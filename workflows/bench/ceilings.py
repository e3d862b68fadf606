"""Ceilings: the same bytes every loader reads, moved as fast as this machine moves them.

Cold: O_DIRECT with many requests in flight (device-bound). Warm: `np.fromfile` (memory-copy-bound).
GPU: one bulk kvikio read per range into device memory. A loader's "ratio to ceiling" is its items/s over
the ceiling's on the same data set, measured in the same run.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from workflows.bench.core import Options, Result, Unavailable, cycle, evict, require_gpu

ALIGN = 4096


@dataclass(frozen=True)
class Span:
    """`nbytes` of file `path` at `offset` (offset a multiple of 4 KiB for O_DIRECT)."""

    path: str
    offset: int
    nbytes: int


def cache_items(cache_dir: str | os.PathLike[str]) -> list[list[Span]]:
    """Per item of a prepared cache, the byte ranges of its tensors in the shard files."""
    from loaders.format import PreparedCache

    cache = PreparedCache(cache_dir)
    return [[Span(e.shard, e.offset, e.nbytes) for e in cache.entries(i)] for i in range(len(cache))]


def file_items(paths: list[str]) -> list[list[Span]]:
    """One item per whole file."""
    return [[Span(p, 0, os.path.getsize(p))] for p in paths]


def _pick(items: list[list[Span]], opts: Options) -> list[Span]:
    return [span for i in cycle(len(items), opts.items) for span in items[i]]


def _files(spans: list[Span]) -> list[str]:
    return sorted({s.path for s in spans})


def direct(items: list[list[Span]], opts: Options, data: str, depth: int = 16) -> Result:
    """O_DIRECT reads of every range, `depth` requests in flight, into aligned reused buffers."""
    spans = _pick(items, opts)
    if not hasattr(os, "O_DIRECT"):
        raise Unavailable("O_DIRECT ceiling: this OS has no O_DIRECT")
    biggest = max(-(-s.nbytes // ALIGN) * ALIGN for s in spans)
    local = threading.local()
    fds: dict[str, int] = {}
    try:
        for path in _files(spans):
            fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise Unavailable(f"O_DIRECT ceiling: cannot open with O_DIRECT here ({exc.strerror})") from exc

    def one(span: Span) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            raw = np.empty(biggest + ALIGN, np.uint8)
            start = (-raw.ctypes.data) % ALIGN
            buf = local.buf = memoryview(raw[start : start + biggest])  # type: ignore[arg-type]
        want = -(-span.nbytes // ALIGN) * ALIGN
        got = os.preadv(fds[span.path], [buf[:want]], span.offset)
        return min(got, span.nbytes)

    how = evict(fds) if opts.cold else "warm"
    try:
        with ThreadPoolExecutor(depth) as pool:
            barrier = threading.Barrier(depth)  # start every thread before the clock: spawning is not reading
            list(pool.map(lambda _: barrier.wait(), range(depth)))
            start = time.perf_counter()
            nbytes = sum(pool.map(one, spans))
            seconds = time.perf_counter() - start
    except OSError as exc:
        raise Unavailable(f"O_DIRECT ceiling: reads fail here ({exc.strerror})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
    return Result(f"ceiling O_DIRECT x{depth}", data, opts.items, seconds, nbytes, "ceiling", how)


def fromfile(items: list[list[Span]], opts: Options, data: str) -> Result:
    """Warm ceiling: one `np.fromfile` per range after a pass that pulls every range into the page cache."""
    spans = _pick(items, opts)
    for s in spans:  # warm-up pass, untimed
        np.fromfile(s.path, np.uint8, count=s.nbytes, offset=s.offset)
    start = time.perf_counter()
    nbytes = sum(np.fromfile(s.path, np.uint8, count=s.nbytes, offset=s.offset).nbytes for s in spans)
    seconds = time.perf_counter() - start
    return Result("ceiling np.fromfile (warm)", data, opts.items, seconds, nbytes, "ceiling", "warm")


def kvikio_bulk(items: list[list[Span]], opts: Options, data: str) -> Result:
    """GPU ceiling: kvikio reads of every range straight into one device buffer each (GDS or compat mode)."""
    require_gpu(opts, "kvikio ceiling")
    from loaders._deps import require

    kvikio = require("kvikio", "the GPU ceiling")
    cupy = require("cupy", "the GPU ceiling")
    spans = _pick(items, opts)
    with cupy.cuda.Device(int(opts.device.partition(":")[2] or 0)):
        bufs = [cupy.empty(s.nbytes, dtype=cupy.uint8) for s in spans]
        how = evict(_files(spans)) if opts.cold else "warm"
        handles = {p: kvikio.CuFile(p, "r") for p in _files(spans)}
        try:
            start = time.perf_counter()
            futures = [handles[s.path].pread(b, s.nbytes, s.offset) for s, b in zip(spans, bufs)]
            nbytes = sum(int(f.get()) for f in futures)
            cupy.cuda.runtime.deviceSynchronize()
            seconds = time.perf_counter() - start
        finally:
            for h in handles.values():
                h.close()
    return Result("ceiling kvikio bulk", data, opts.items, seconds, nbytes, "ceiling", how)
