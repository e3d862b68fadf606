"""Ceilings: the same bytes every loader reads, moved as fast as this machine moves them.

Cold: O_DIRECT with many requests in flight (device-bound). Warm: `np.fromfile` (memory-copy-bound).
GPU: one bulk kvikio read per range into device memory. A loader's "ratio to ceiling" is its items/s over
the ceiling's on the same data set, measured in the same run.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workflows.bench.core import Options, Result, Rows, Unavailable, cycle, optional, require_gpu, start_pass

ALIGN = 4096


@dataclass(frozen=True)
class Span:
    """`nbytes` of file `path` at `offset` (offset a multiple of 4 KiB for O_DIRECT)."""

    path: str
    offset: int
    nbytes: int


def cache_items(cache_dir: str | os.PathLike[str]) -> list[list[Span]]:
    """Per item of a prepared cache, the byte ranges of its tensors in the shard files."""
    from loaders.cache.format import PreparedCache

    cache = PreparedCache(cache_dir)
    return [[Span(e.shard, e.offset, e.nbytes) for e in cache.entries(i)] for i in range(len(cache))]


def file_items(paths: list[str]) -> list[list[Span]]:
    """One item per whole file."""
    return [[Span(p, 0, os.path.getsize(p))] for p in paths]


def _pick(items: list[list[Span]], opts: Options) -> list[Span]:
    return [span for i in cycle(len(items), opts.items) for span in items[i]]


def _files(spans: list[Span]) -> list[str]:
    return sorted({s.path for s in spans})


def read_direct(spans: list[Span], depth: int = 16, cold: bool = True) -> tuple[float, int, str]:
    """O_DIRECT reads of every span, `depth` requests in flight into aligned per-thread buffers; returns
    (seconds, bytes, how the page cache was evicted). Raises Unavailable where O_DIRECT does not work."""
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
        want = -(-span.nbytes // ALIGN) * ALIGN
        got = os.preadv(fds[span.path], [local.buf[:want]], span.offset)
        return min(got, span.nbytes)

    def setup(_: int) -> None:  # a touched buffer per thread, every thread started, before the clock
        raw = np.zeros(biggest + ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        local.buf = memoryview(raw[start : start + biggest])  # type: ignore[arg-type]
        barrier.wait()

    how = start_pass(fds, cold)
    barrier = threading.Barrier(depth)
    try:
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(setup, range(depth)))
            start = time.perf_counter()
            nbytes = sum(pool.map(one, spans, chunksize=max(1, len(spans) // (depth * 8))))
            seconds = time.perf_counter() - start
    except OSError as exc:
        raise Unavailable(f"O_DIRECT ceiling: reads fail here ({exc.strerror})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
    return seconds, nbytes, how


def direct(items: list[list[Span]], opts: Options, data: str, depth: int = 16) -> Result:
    """Cold reference: the tensors of `opts.items` items read with O_DIRECT, one request each, `depth` in flight."""
    seconds, nbytes, how = read_direct(_pick(items, opts), depth, opts.cold)
    # one request a tensor: a reader merging neighbours into larger requests passes it (a reference, no bound)
    return Result(f"O_DIRECT x{depth}, a request a tensor", data, opts.items, seconds, nbytes, "ceiling", how)


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
    kvikio = optional("kvikio", "the GPU ceiling")
    cupy = optional("cupy", "the GPU ceiling")
    spans = _pick(items, opts)
    with cupy.cuda.Device(int(opts.device.partition(":")[2] or 0)):
        bufs = [cupy.empty(s.nbytes, dtype=cupy.uint8) for s in spans]
        how = start_pass(_files(spans), opts.cold)
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


def _cache_items_or_skip(cache: Path) -> list[list[Span]]:
    if not (cache / "manifest.json").is_file():
        raise Unavailable(f"{cache}: no committed prepared cache, so no volume ceiling")
    return cache_items(cache)


def add_ceilings(rows: Rows, items: Callable[[], list[list[Span]]], opts: Options, data: str) -> None:
    """The three ceilings (O_DIRECT, np.fromfile, kvikio) of one data set, as rows (or reasons)."""
    rows.add(f"O_DIRECT reference ({data})", lambda: direct(items(), opts, data))
    rows.add(f"ceiling np.fromfile ({data})", lambda: fromfile(items(), opts, data))
    rows.add(f"ceiling kvikio ({data})", lambda: kvikio_bulk(items(), opts, data))


def volume_ceilings(rows: Rows, cache: Path, opts: Options) -> None:
    """Ceilings of a prepared cache's tensors."""
    add_ceilings(rows, lambda: _cache_items_or_skip(cache), opts, "volumes")


def image_ceilings(rows: Rows, files: Callable[[], list[str]], opts: Options) -> None:
    """Ceilings of whole image files."""
    add_ceilings(rows, lambda: file_items(files()), opts, "images")
