"""The one interface every backend implements: read a batch of (source, offset, nbytes) into buffers."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from loaders.cache.layout import open_read
from loaders.cache.spec import ALIGN
from loaders.deps import require
from loaders.errors import BackendError
from loaders.opener import open_in


@dataclass(frozen=True)
class ReadRequest:
    """Read `nbytes` of file `path` starting at byte `offset`."""

    path: str
    offset: int
    nbytes: int


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 host buffer whose address and length are multiples of `align` (what O_DIRECT needs)."""
    size = -(-max(nbytes, 1) // align) * align
    raw = np.empty(size + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + size]


def pinned_empty(nbytes: int, align: int = ALIGN) -> tuple[Any, np.ndarray]:
    """(owner, view): a page-locked uint8 host buffer of `nbytes` starting at an `align` boundary.

    `owner` is the pinned torch tensor that host-to-device copies read from; `view` is the numpy view of
    the same memory that backends read into. Pinned allocations are usually page-aligned already;
    the slack guarantees it whatever allocator sits underneath."""
    torch = require("torch", "GPU delivery")
    raw = torch.empty(max(nbytes, 1) + align, dtype=torch.uint8, pin_memory=True)
    start = (-raw.data_ptr()) % align
    owner = raw[start : start + max(nbytes, 1)]
    return owner, owner.numpy()


class FdCache:
    """A small thread-safe LRU of open file descriptors, so a batch of reads does not reopen files."""

    def __init__(self, flags: int = os.O_RDONLY, capacity: int = 256, root: str | None = None) -> None:
        """root: paths are names below this folder, opened by `loaders.opener.open_in` (no link followed,
        regular files only): the filesystem reads of a block map's files."""
        self.flags = flags
        self.capacity = capacity
        self.root = root
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        # the descriptors close with their cache: a dropped dataset (and its backend) never keeps its shards open
        weakref.finalize(self, _close_fds, self._fds)

    def get(self, path: str) -> int:
        """Open (or reuse) a descriptor for `path`."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                self._fds.move_to_end(path)
                return fd
        try:
            if self.root is not None:
                fd = open_in(self.root, path, "re-run `prep bmap` on the files as they are now")[0]
            else:
                fd = open_read(path, self.flags)  # a cache shard: only the file checked when its cache opened
        except OSError as exc:
            raise BackendError(f"{path}: cannot open ({exc.strerror}); check the path and permissions") from exc
        with self._lock:
            if path in self._fds:  # another thread won the race
                os.close(fd)
                return self._fds[path]
            self._fds[path] = fd
            while len(self._fds) > self.capacity:
                _, old = self._fds.popitem(last=False)
                os.close(old)
        return fd

    def __getstate__(self) -> dict[str, Any]:
        # Descriptors and locks do not cross processes: a DataLoader worker reopens what it reads.
        return {"flags": self.flags, "capacity": self.capacity, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["flags"], state["capacity"], state.get("root"))  # type: ignore[misc]

    def close(self) -> None:
        """Close every cached descriptor."""
        with self._lock:
            _close_fds(self._fds)


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):  # already gone (a forked child's copy closed it): nothing to release
            os.close(fd)
    fds.clear()


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """pread until `buf` is full or end of file; returns bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(k, ctypes.c_uint64) for k in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


class PageCacheProbe:
    """How much of a file range sits in the page cache, through Linux's cachestat(2) (6.5+).

    One syscall, no I/O and no readahead (unlike a buffered read with RWF_NOWAIT, which starts
    readahead on a miss). `available` is False where the kernel or platform lacks it.
    """

    NR = {"x86_64": 451, "aarch64": 451}.get(platform.machine())

    def __init__(self) -> None:
        self.available = self.NR is not None and sys.platform == "linux"
        self._libc = ctypes.CDLL(None, use_errno=True) if self.available else None

    def counts(self, fd: int, offset: int, nbytes: int) -> _Stat | None:
        """cachestat's page counts of [offset, offset + nbytes): cache, dirty, writeback, ... (None when unknown)."""
        if not self.available or self._libc is None:
            return None
        rng, st = _Range(offset, nbytes), _Stat()
        if self._libc.syscall(self.NR, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
                self.available = False  # old kernel or seccomp: always read with O_DIRECT
            return None
        return st

    def resident(self, fd: int, offset: int, nbytes: int) -> bool:
        """True when every page of [offset, offset + nbytes) is cached (False when unknown)."""
        st = self.counts(fd, offset, nbytes)
        return st is not None and st.cache * mmap.PAGESIZE >= nbytes


class Backend(ABC):
    """Moves bytes from storage into buffers. Subclasses set `name` and implement `read_into`.

    Buffers are host numpy uint8 arrays for CPU backends; GPU backends (device="cuda:N") fill device arrays.
    """

    name: ClassVar[str] = "?"
    gpu: ClassVar[bool] = False  # True: buffers are device arrays and __init__ takes device="cuda:N"
    device: str = "cpu"

    def __init__(self, threads: int = 16) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Thread pool for requests in flight (created on first use, and again in a forked child, such as a
        DataLoader worker: the parent's threads are not there, and its pool would queue work no thread runs)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"blockprep-{self.name}")
            self._pool_pid = os.getpid()
        return self._pool

    @abstractmethod
    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        """Fill buffers[i] with requests[i] (buffers at least nbytes long). Raise BackendError on short reads."""

    @property
    def page_cache_reads(self) -> bool:
        """True when this backend reads plain files through the page cache when their bytes are warm there:
        a region reader may then copy warm bytes straight out of a mapping of the file (same bytes)."""
        return False

    def warm_reader(self) -> Backend:
        """The backend that reads small warm runs one request at a time (default: this one)."""
        return self

    def read_small(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        """Read the few requests of one small item. Backends that can do it cheaply read them on the calling
        thread (a pool hand-off costs more than copying a few warm KB); the default is `read_into`."""
        self.read_into(requests, buffers)

    def allocate(self, nbytes: int) -> Any:
        """A buffer this backend reads into best (aligned host memory by default)."""
        return aligned_empty(nbytes)

    def read(self, requests: Sequence[ReadRequest]) -> list[Any]:
        """Read requests into new buffers, each trimmed to its nbytes."""
        buffers = [self.allocate(r.nbytes) for r in requests]
        self.read_into(requests, buffers)
        return [b[: r.nbytes] for b, r in zip(buffers, requests)]

    def close(self) -> None:
        """Release threads and descriptors."""
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # A backend travels to DataLoader worker processes: pools and descriptors are rebuilt there.
        state = self.__dict__.copy()
        state["_pool"] = None
        return state


def short_read(req: ReadRequest, got: int) -> BackendError:
    """The error for a read that ended early (file shorter than the index says)."""
    return BackendError(
        f"{req.path}: short read at offset {req.offset} ({got} of {req.nbytes} bytes); the file is truncated "
        "or changed since it was indexed: re-run `prep verify`/`prep cache`"
    )
