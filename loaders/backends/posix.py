"""Buffered pread through the page cache, many requests in flight from a thread pool."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from loaders.backends.base import Backend, FdCache, ReadRequest, pread_full, short_read


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

    def close(self) -> None:
        super().close()
        self._fds.close()
