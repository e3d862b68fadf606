"""Buffered pread through the page cache, many requests in flight from a thread pool."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.backends.base import Backend, FdCache, ReadRequest, pread_full, short_read
from loaders.opener import safe_to_map
from loaders.reading.mappings import private_map


class PosixBackend(Backend):
    """Plain `pread` into host buffers. Fast on warm data (page cache); the portable fallback everywhere."""

    name = "posix"

    @property
    def page_cache_reads(self) -> bool:
        """Buffered reads: warm bytes are the page cache's bytes."""
        return True

    def __init__(self, threads: int = 8) -> None:
        super().__init__(threads)
        self._fds = FdCache(os.O_RDONLY)

    def _one(self, req: ReadRequest, buf: Any) -> None:
        fd = self._fds.get(req.path)
        got = pread_full(fd, memoryview(buf)[: req.nbytes].cast("B"), req.offset)
        if got < req.nbytes:
            raise short_read(req, got)

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        if len(requests) == 1 or self.threads <= 1:
            for req, buf in zip(requests, buffers):
                self._one(req, buf)
            return
        for fut in [self.pool.submit(self._one, r, b) for r, b in zip(requests, buffers)]:
            fut.result()

    def read_small(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        """One pread per request on the calling thread: buffered reads of a small item need no pool."""
        for req, buf in zip(requests, buffers):
            self._one(req, buf)

    def mapped(self, requests: Sequence[ReadRequest]) -> list[np.ndarray] | None:
        """Each request's bytes as a writable copy-on-write private mapping of the file (no copy: pages of the
        page cache come in as they are touched; a write makes this process's own copy of that page, never the
        file's), or None when a file is shorter than a request or the mapping fails (the read path then reads,
        or names the short read). A mapping holds no file descriptor and is unmapped when the array and every
        view of it (a tensor over it) are gone. A tensor that is cropped and then copied touches only the crop's
        pages (docs/benchmarks.md, the drop-in); a file truncated while mapped would fault (SIGBUS): a committed
        cache's shards are never truncated (`prep.commit` trims shards before the commit)."""
        out = []
        for req in requests:
            fd = self._fds.get(req.path)
            st = os.fstat(fd)
            if st.st_size < req.offset + req.nbytes or not safe_to_map(st):  # another user's shard: read, not mapped
                return None
            if req.nbytes == 0:
                out.append(np.empty(0, dtype=np.uint8))
                continue
            start = req.offset - req.offset % mmap.ALLOCATIONGRANULARITY
            array = private_map(fd, start, req.offset - start + req.nbytes)
            if array is None:
                return None
            out.append(array[req.offset - start :])
        return out

    def close(self) -> None:
        super().close()
        self._fds.close()
