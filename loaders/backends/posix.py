"""Buffered pread through the page cache, many requests in flight from a thread pool."""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.backends.base import Backend, FdCache, ReadRequest, pread_full, short_read
from loaders.opener import safe_to_map

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LIVE: dict[int, int] = {}  # address -> length of every mapping `_private_map` made that is still mapped


def _unmap(addr: int, length: int) -> None:
    _LIVE.pop(addr, None)
    _libc.munmap(addr, length)


def _private_map(fd: int, offset: int, length: int) -> np.ndarray | None:
    """`length` bytes of `fd` from `offset` (page-aligned) as a uint8 array over a MAP_PRIVATE mapping, unmapped
    when the array's buffer is collected; None when mmap fails (too many mappings: the caller reads instead).
    Python's `mmap.mmap` would keep a duplicate descriptor open per mapping: items held in memory would use up
    the process's descriptors."""
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        return None
    buffer = (ctypes.c_ubyte * length).from_address(addr)
    _LIVE[addr] = length
    weakref.finalize(buffer, _unmap, addr, length)
    return np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]  # a ctypes array is a buffer


def _mapped_at(address: int) -> bool:
    return any(a <= address < a + n for a, n in list(_LIVE.items()))


def own_storage(obj: Any) -> Any:
    """`obj` (an item: tensors in dicts, lists and tuples) with every tensor that is a view of a mapping of
    `PosixBackend.mapped` replaced by a copy. An item leaves the dataset so: a mapping of a shard that its owner
    truncates later would kill the process with SIGBUS on the first touch of a page past the new end, wherever
    the item is then; copied, it is the reader's own memory. A tail that crops made new tensors already
    (nothing is copied then)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = own_storage(v)
        return obj
    if isinstance(obj, list):
        obj[:] = [own_storage(v) for v in obj]
        return obj
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(own_storage(v) for v in obj)
    storage = getattr(obj, "untyped_storage", None)
    if _LIVE and storage is not None and _mapped_at(storage().data_ptr()):
        return obj.clone()
    return obj


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
            array = _private_map(fd, start, req.offset - start + req.nbytes)
            if array is None:
                return None
            out.append(array[req.offset - start :])
        return out

    def close(self) -> None:
        super().close()
        self._fds.close()
