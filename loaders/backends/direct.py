"""O_DIRECT reads into aligned host buffers, bypassing the page cache, with many requests in flight.

Cold data is bound by how many requests the device sees at once, so every request is split into
`chunk`-sized aligned pieces and all pieces of a batch go to the thread pool together: even one large
read keeps `threads` requests in flight.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.backends.base import (
    Backend,
    FdCache,
    PageCacheProbe,
    ReadRequest,
    aligned_empty,
    pread_full,
    short_read,
)
from loaders.cache.spec import ALIGN
from loaders.errors import BackendError
from loaders.tunables import WARM_CHUNK

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _as_bytes(buf: Any) -> np.ndarray:
    """A writable 1-D uint8 view of a caller's buffer (numpy array or anything with the buffer protocol)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise BackendError("direct: buffers must be C-contiguous; pass a contiguous array")
    return arr.reshape(-1).view(np.uint8)


@dataclass
class _Job:
    """One request mapped onto an aligned target: `target[skip : skip + nbytes]` receives the bytes."""

    req: ReadRequest
    target: np.ndarray  # aligned memory that the aligned file range [start, end) is read into
    start: int  # aligned file offset of target[0]
    end: int  # aligned end of the covering range
    copy_to: np.ndarray | None  # caller's buffer when target is a bounce buffer
    skip: int = 0
    warm: bool = False  # wholly in the page cache: [start, end) is the exact request, read buffered
    whole: ReadRequest | None = None  # the caller's request when this job is its unaligned tail (for errors)


class DirectBackend(Backend):
    """O_DIRECT `pread` into 4 KiB-aligned buffers; the cold-data path on CPU.

    Unaligned offsets and lengths read the covering aligned range (into a bounce buffer, or into a larger
    buffer whose view is returned by `read`). A read may end short only at end of file. A file whose
    filesystem refuses O_DIRECT (EINVAL at open or at the first read) falls back to buffered reads for
    that file, logged once per file as a warning: the data are still correct, only not page-cache-free.

    With `page_cache=True` (default) a request (or a chunk) already wholly in the page cache (asked through
    cachestat(2), without I/O) is copied from there with buffered preads straight into the destination:
    warm data at memory speed, cold data at device speed, no double caching. `page_cache=False` always
    reads with O_DIRECT.
    """

    name = "direct"

    def __init__(self, threads: int = 16, chunk: int = 1 << 20, page_cache: bool = True) -> None:
        if not _O_DIRECT:
            raise BackendError("direct: this platform has no O_DIRECT; use backend='posix'")
        if chunk <= 0 or chunk % ALIGN:
            raise BackendError(f"direct: chunk={chunk} must be a positive multiple of {ALIGN}")
        super().__init__(threads)
        self.chunk = chunk
        self.page_cache = page_cache
        self._init_fds()

    def _init_fds(self) -> None:
        self._direct = FdCache(os.O_RDONLY | _O_DIRECT)
        self._buffered = FdCache(os.O_RDONLY)
        self._fallback: set[str] = set()
        self._probe = PageCacheProbe()
        self._buffered_reader: tuple[int, Backend] | None = None  # (pid, buffered reader for warm runs)

    def _fall_back(self, path: str, why: str) -> None:
        if path not in self._fallback:
            self._fallback.add(path)
            log.warning("%s: O_DIRECT refused (%s); reading this file buffered", path, why)

    def _fd(self, path: str) -> tuple[int, bool]:
        """(descriptor, is_direct) for `path`."""
        if path not in self._fallback:
            try:
                return self._direct.get(path), True
            except BackendError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and cause.errno == errno.EINVAL):
                    raise
                self._fall_back(path, "open")
        return self._buffered.get(path), False

    def _piece(self, path: str, view: memoryview, offset: int, warm: bool = False) -> int:
        """Read one aligned piece (any piece when `warm`); returns bytes read (short only at end of file)."""
        if warm:
            return pread_full(self._buffered.get(path), view, offset)
        fd, direct = self._fd(path)
        if not direct:
            return pread_full(fd, view, offset)
        if self.page_cache and self._probe.resident(fd, offset, len(view)):
            return pread_full(self._buffered.get(path), view, offset)  # warm: a memory copy
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise BackendError(f"{path}: read failed at offset {offset + done} ({exc.strerror})") from exc
                self._fall_back(path, "read")
                return done + pread_full(self._buffered.get(path), view[done:], offset + done)
            if n == 0 or n % ALIGN:  # an unaligned count means end of file; the next pread would be EINVAL
                return done + n
            done += n
        return done

    def _warm(self, req: ReadRequest) -> bool:
        if not self.page_cache or req.nbytes == 0:
            return False
        fd, direct = self._fd(req.path)
        return direct and self._probe.resident(fd, req.offset - req.offset % ALIGN, req.nbytes + req.offset % ALIGN)

    def _plan(self, req: ReadRequest, buf: Any | None) -> list[_Job]:
        """Map a request onto aligned targets: the caller's buffer where alignment allows, else a bounce."""
        out = None if buf is None else _as_bytes(buf)
        if out is not None and len(out) < req.nbytes:
            raise BackendError(f"{req.path}: buffer of {len(out)} bytes is smaller than the read ({req.nbytes})")
        end_exact = req.offset + req.nbytes
        if self._warm(req):  # buffered reads need no alignment: straight into the caller's buffer
            target = aligned_empty(req.nbytes) if out is None else out
            return [_Job(req, target, req.offset, end_exact, None, warm=True)]
        start = req.offset - req.offset % ALIGN
        end = -(-end_exact // ALIGN) * ALIGN
        skip = req.offset - start
        if out is None:
            return [_Job(req, aligned_empty(end - start), start, end, None, skip)]
        if skip or out.ctypes.data % ALIGN:
            return [_Job(req, aligned_empty(end - start), start, end, out, skip)]
        if len(out) >= end - start:
            return [_Job(req, out, start, end, None)]
        # aligned start, unaligned length: the bulk straight into the caller's buffer, the last block bounced
        bulk = req.nbytes - req.nbytes % ALIGN
        tail = ReadRequest(req.path, start + bulk, req.nbytes - bulk)
        jobs = [_Job(ReadRequest(req.path, req.offset, bulk), out[:bulk], start, start + bulk, None)] if bulk else []
        return [*jobs, _Job(tail, aligned_empty(ALIGN), tail.offset, tail.offset + ALIGN, out[bulk:], whole=req)]

    def _run(self, jobs: list[_Job]) -> None:
        # warm pieces are memory copies: larger pieces, fewer Python round trips
        step = {False: self.chunk, True: max(self.chunk, WARM_CHUNK)}
        pieces = [(job, off, step[job.warm]) for job in jobs for off in range(job.start, job.end, step[job.warm])]

        def one(job: _Job, off: int, size: int) -> int:
            n = min(size, job.end - off)
            view = job.target.data[off - job.start : off - job.start + n]
            return self._piece(job.req.path, view, off, job.warm)

        if len(pieces) == 1 or self.threads <= 1:
            got = [one(*p) for p in pieces]
        else:
            futs: list[Future[int]] = [self.pool.submit(one, *p) for p in pieces]
            got = [f.result() for f in futs]
        for (job, off, size), n in zip(pieces, got):
            need = min(off + size, job.req.offset + job.req.nbytes) - off
            if n < need:
                whole = job.whole or job.req
                raise short_read(whole, max(0, off + n - whole.offset))
        for job in jobs:
            if job.copy_to is not None:
                job.copy_to[: job.req.nbytes] = job.target[job.skip : job.skip + job.req.nbytes]

    def read_small(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        """A small item wholly in the page cache: buffered preads on the calling thread (`warm_reader`, no
        planning, no pool). Anything cold keeps the O_DIRECT path (alignment, bounce buffers, the pool)."""
        if self.page_cache and all(self._warm(r) for r in requests):
            self.warm_reader().read_small(requests, buffers)
        else:
            self.read_into(requests, buffers)

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        self._run([job for r, b in zip(requests, buffers) for job in self._plan(r, b)])

    def read(self, requests: Sequence[ReadRequest]) -> list[Any]:
        """Read into new aligned buffers covering each request; returns views trimmed to each request."""
        jobs = [job for r in requests for job in self._plan(r, None)]
        self._run(jobs)
        return [j.target[j.skip : j.skip + j.req.nbytes] for j in jobs]

    def close(self) -> None:
        super().close()
        if self._buffered_reader is not None and self._buffered_reader[0] == os.getpid():
            self._buffered_reader[1].close()
        self._buffered_reader = None
        self._direct.close()
        self._buffered.close()

    @property
    def page_cache_reads(self) -> bool:
        """Warm data is read buffered (page_cache=True): copying it out of a mapping gives the same bytes."""
        return bool(self.page_cache)

    def warm_reader(self) -> Backend:
        """With page_cache=True, warm runs go through one plain buffered reader of this process: this
        backend's per-request planning (probe, alignment, job) costs more than a small run's copy."""
        if not self.page_cache:
            return self
        if self._buffered_reader is None or self._buffered_reader[0] != os.getpid():
            from loaders.backends.posix import PosixBackend

            self._buffered_reader = (os.getpid(), PosixBackend(threads=1))  # single requests only: no pool of its own
        return self._buffered_reader[1]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # descriptors do not travel; reopened there
        for key in ("_direct", "_buffered", "_fallback", "_probe", "_buffered_reader"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_fds()
