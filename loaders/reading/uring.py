"""Whole-file reads submitted together through Linux's io_uring, so the kernel merges adjacent files' reads.

A batch of small files read one `read()` at a time reaches the block device as one request a file. Submitted
as one io_uring batch, every read's readahead is issued under the same block-layer plug, and reads of files
that lie next to each other on the disk merge into one request: a fraction of the requests, and more files a
second than one reader thread with a WILLNEED hint a file (docs/benchmarks.md, DALI sources).

Pure Python: the two syscalls through ctypes (which releases the interpreter lock while the kernel works), the
rings mapped with `mmap` and filled with numpy, so a batch costs a few vectorised writes and one syscall.

`available()` says whether it can be used: Linux on x86-64 (the rings are read without memory barriers, which
only x86's ordering makes safe), kernel 5.6+ (IORING_OP_READ), io_uring not disabled (the sysctl
`kernel.io_uring_disabled`, a container's seccomp profile), and `BLOCKPREP_IO_URING` not `0`. Where it cannot,
callers read with plain syscalls.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
from collections.abc import Sequence

import numpy as np

from loaders.reading.files import finish_read, read_fd

_SETUP, _ENTER, _REGISTER = 425, 426, 427  # the same numbers on every architecture since Linux 5.1
_OP_OPENAT, _OP_READ = 18, 22
_AT_FDCWD = -100
_ENTER_GETEVENTS = 1
_REGISTER_PROBE = 8
_OP_SUPPORTED = 1
_FEAT_SINGLE_MMAP = 1
_OFF_CQ_RING, _OFF_SQES = 0x8000000, 0x10000000
ENV = "BLOCKPREP_IO_URING"  # "0": never use io_uring (plain reads)

_SQE = np.dtype(
    {
        "names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data", "rest"],
        "formats": [np.uint8, np.uint8, np.uint16, np.int32, np.uint64, np.uint64, np.uint32, np.uint32,
                    np.uint64, (np.uint8, 24)],
        "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32, 40],
        "itemsize": 64,
    }
)  # fmt: skip
_CQE = np.dtype({"names": ["user_data", "res"], "formats": [np.uint64, np.int32], "offsets": [0, 8], "itemsize": 16})

_libc: ctypes.CDLL | None = None
_usable: bool | None = None


def _syscall(*args: object) -> int:
    assert _libc is not None
    while True:
        got = int(_libc.syscall(*args))
        if got >= 0:
            return got
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def available() -> bool:
    """Whether io_uring reads can be used in this process (checked once: a ring is made and probed)."""
    global _libc, _usable
    if _usable is None:
        _usable = False
        if sys.platform == "linux" and platform.machine() == "x86_64" and os.environ.get(ENV, "1") != "0":
            try:
                _libc = ctypes.CDLL(None, use_errno=True)
                _libc.syscall.restype = ctypes.c_long
                Ring(8).close()
                _usable = True
            except (OSError, AttributeError):
                _usable = False
    return _usable


class Ring:
    """One io_uring instance: submit reads, wait for their completions by tag. Not shared between threads
    (callers serialise) and not between processes (a forked child makes its own: see `ring_for`)."""

    def __init__(self, entries: int = 256) -> None:
        params = ctypes.create_string_buffer(120)  # struct io_uring_params
        self.fd = _syscall(_SETUP, ctypes.c_uint(entries), params)
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params.raw)
            self._probe()
        except BaseException:
            self.close()
            raise
        self.pid = os.getpid()
        self.done: dict[int, int] = {}  # tag: result, reaped and not yet taken
        self.inflight = 0
        self._tag = 0

    def _map(self, raw: bytes) -> None:
        sq_entries, cq_entries, _flags, _cpu, _idle, features = struct.unpack_from("6I", raw, 0)
        sq = struct.unpack_from("7I", raw, 40)  # head, tail, ring_mask, ring_entries, flags, dropped, array
        cq = struct.unpack_from("6I", raw, 80)  # head, tail, ring_mask, ring_entries, overflow, cqes
        sq_size, cq_size = sq[6] + sq_entries * 4, cq[5] + cq_entries * 16
        if features & _FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        sq_map = mmap.mmap(self.fd, sq_size, flags, offset=0)
        cq_map = sq_map if features & _FEAT_SINGLE_MMAP else mmap.mmap(self.fd, cq_size, flags, offset=_OFF_CQ_RING)
        sqe_map = mmap.mmap(self.fd, sq_entries * 64, flags, offset=_OFF_SQES)
        self._maps = [m for m in (sq_map, cq_map, sqe_map) if m is not None]
        self.entries = sq_entries
        self._sq_tail = np.frombuffer(sq_map, np.uint32, 1, sq[1])
        self._sq_mask = int(np.frombuffer(sq_map, np.uint32, 1, sq[2])[0])
        np.frombuffer(sq_map, np.uint32, sq_entries, sq[6])[:] = np.arange(sq_entries, dtype=np.uint32)
        self._cq_head = np.frombuffer(cq_map, np.uint32, 1, cq[0])
        self._cq_tail = np.frombuffer(cq_map, np.uint32, 1, cq[1])
        self._cq_mask = int(np.frombuffer(cq_map, np.uint32, 1, cq[2])[0])
        self._cqes = np.frombuffer(cq_map, _CQE, cq_entries, cq[5])
        self._sqes = np.frombuffer(sqe_map, _SQE, sq_entries)

    def _probe(self) -> None:
        """IORING_OP_READ must be supported (5.6+); the probe itself is 5.6+ too."""
        buf = ctypes.create_string_buffer(16 + 8 * 64)
        _syscall(_REGISTER, self.fd, _REGISTER_PROBE, buf, 64)
        ops_len = buf.raw[1]
        for code in (_OP_OPENAT, _OP_READ):
            op = buf.raw[16 + 8 * code : 16 + 8 * code + 4] if ops_len > code else b"\0" * 4
            if not struct.unpack_from("H", op, 2)[0] & _OP_SUPPORTED:
                raise OSError(errno.EINVAL, f"io_uring: operation {code} is not supported by this kernel")

    def submit_reads(self, fds: np.ndarray, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Queue reads of lens[i] bytes at offset 0 of fds[i] into addrs[i]; see `submit`."""
        sqes = np.zeros(len(fds), _SQE)
        sqes["opcode"], sqes["fd"], sqes["addr"], sqes["len"] = _OP_READ, fds, addrs, lens
        return self.submit(sqes)

    def submit(self, sqes: np.ndarray) -> np.ndarray:
        """Submit these SQEs (their user_data set here) in one syscall (more than the ring holds: in
        slices). Returns their tags. What they point to must stay alive until `wait` has returned them."""
        n = len(sqes)
        tags = np.arange(self._tag, self._tag + n, dtype=np.uint64)
        self._tag += n
        sqes["user_data"] = tags
        for at in range(0, n, self.entries):
            part = sqes[at : at + self.entries]
            while self.inflight + len(part) > self.entries:  # completions must fit the ring
                self._reap(1)
            self._push(part)
        return tags

    def _push(self, sqes: np.ndarray) -> None:
        n = len(sqes)
        tail = int(self._sq_tail[0])
        self._sqes[(tail + np.arange(n, dtype=np.int64)) & self._sq_mask] = sqes
        self._sq_tail[0] = (tail + n) & 0xFFFFFFFF
        self.inflight += n
        sent = 0
        while sent < n:  # the kernel may take fewer than asked (it then says why, or takes the rest next time)
            sent += _syscall(_ENTER, self.fd, ctypes.c_uint(n - sent), 0, 0, None, 0)

    def _reap(self, want: int) -> None:
        """Move completions into `done`, waiting in the kernel until at least `want` are there."""
        want = min(want, self.inflight)
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        while (tail - head) & 0xFFFFFFFF < want:
            _syscall(_ENTER, self.fd, 0, ctypes.c_uint(want - ((tail - head) & 0xFFFFFFFF)), _ENTER_GETEVENTS, None, 0)
            tail = int(self._cq_tail[0])
        count = (tail - head) & 0xFFFFFFFF
        cqes = self._cqes[(head + np.arange(count, dtype=np.int64)) & self._cq_mask]
        self.done.update(zip(cqes["user_data"].tolist(), cqes["res"].tolist()))
        self._cq_head[0] = tail
        self.inflight -= count

    def wait(self, tags: np.ndarray) -> list[int]:
        """The results of these reads (bytes read, or -errno), waiting for those not yet complete."""
        wanted = tags.tolist()
        missing = sum(1 for t in wanted if t not in self.done)
        while missing:
            if missing > self.inflight:
                raise RuntimeError("io_uring: waiting for reads that were never submitted")
            self._reap(missing)
            missing = sum(1 for t in wanted if t not in self.done)
        return [self.done.pop(t) for t in wanted]

    def close(self) -> None:
        """Wait for every read in flight (their buffers may be freed after), then release the ring."""
        if getattr(self, "pid", None) == os.getpid():
            while self.inflight > 0:
                self._reap(self.inflight)
        self.done = {}
        # numpy views of the maps first: a map with views cannot be closed
        for name in ("_sq_tail", "_cq_head", "_cq_tail", "_cqes", "_sqes"):
            self.__dict__.pop(name, None)
        for m in getattr(self, "_maps", []):
            m.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BatchReader:
    """Whole files read through one ring: `start(paths)` opens, sizes and submits a batch's reads and returns
    at once; `finish(handle)` waits for them and gives the files as uint8 arrays, one a file (a file that
    shrank while read gives what it holds; one that grew, its size when opened). Thread-safe;
    a forked child makes its own ring."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self._ring: Ring | None = None
        self._lock = threading.Lock()
        self._open: list[_Batch] = []

    def _ring_here(self) -> Ring:
        if self._ring is None or self._ring.pid != os.getpid():
            if not available():
                raise OSError(errno.ENOSYS, "io_uring is not available here (loaders.reading.uring.available())")
            self._ring, self._open = Ring(self.entries), []  # a parent's reads are not this process's
        return self._ring

    def start(self, paths: Sequence[str], sizes: np.ndarray | None = None) -> _Batch:
        """Open the files, size them and submit their reads; returns without waiting for the reads. With
        `sizes` (what the files held when last read), the opens go through the ring too (one syscall, no
        fstat) and each read asks for one byte more than its size: a read that gets it found a file that
        grew, which `finish` reads again whole."""
        if sizes is not None and len(paths):
            return self._start_sized(paths, np.asarray(sizes, np.int64))
        fds: list[int] = []
        try:
            open_, fstat = os.open, os.fstat
            found = []
            for p in paths:
                fds.append(open_(p, os.O_RDONLY | os.O_CLOEXEC))
                found.append(fstat(fds[-1]).st_size)
            size = np.array(found, dtype=np.int64)
            return self._submit(list(paths), fds, size, size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _start_sized(self, paths: Sequence[str], size: np.ndarray) -> _Batch:
        names = [os.fsencode(p) for p in paths]
        blob = np.frombuffer(b"\0".join(names) + b"\0", np.uint8)
        at = np.concatenate(([0], np.cumsum([len(b) + 1 for b in names])[:-1])).astype(np.int64)
        opens = np.zeros(len(names), _SQE)
        opens["opcode"], opens["fd"], opens["addr"] = _OP_OPENAT, _AT_FDCWD, blob.ctypes.data + at
        opens["rw_flags"] = os.O_RDONLY | os.O_CLOEXEC
        with self._lock:
            ring = self._ring_here()
            fds = ring.wait(ring.submit(opens))
        bad = next((i for i, fd in enumerate(fds) if fd < 0), None)
        if bad is not None:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            raise OSError(-fds[bad], os.strerror(-fds[bad]), paths[bad])
        try:
            return self._submit(list(paths), fds, size, size + 1)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _submit(self, paths: list[str], fds: list[int], size: np.ndarray, room: np.ndarray) -> _Batch:
        if (room >= 1 << 31).any():
            raise OSError(errno.EFBIG, "over 2 GiB, too large for one read", paths[int(np.argmax(room))])
        # one array a file: a buffer for the whole batch would be a large allocation, which the C library
        # maps fresh (and the kernel zeroes page by page) batch after batch
        empty = np.empty
        bufs = [empty(n, np.uint8) for n in room.tolist()]
        addrs = np.fromiter((b.__array_interface__["data"][0] for b in bufs), np.uint64, len(bufs))
        batch = _Batch(paths, fds, size, bufs)
        with self._lock:
            batch.tags = self._ring_here().submit_reads(np.array(fds, np.int32), addrs, room.astype(np.uint32))
            batch.ring = self._ring
            self._open.append(batch)
        return batch

    def finish(self, batch: _Batch) -> list[np.ndarray]:
        with self._lock:
            if batch.ring is None or batch.ring is not self._ring or batch.ring.pid != os.getpid():
                raise RuntimeError("io_uring batch of another process or of a closed reader")
            try:
                results = batch.ring.wait(batch.tags)
            finally:
                self._open.remove(batch)
        return batch.arrays(results)

    def __del__(self) -> None:  # the kernel may still be writing into buffers that would be freed with it
        self.close()

    def close(self) -> None:
        """Wait for every batch in flight, close their files and the ring."""
        with self._lock:
            ring, self._ring = self._ring, None
            if ring is not None:
                ring.close()  # waits for the kernel to finish writing into the buffers
            for batch in self._open:
                batch.close()
            self._open = []


class _Batch:
    """A batch's files in flight: descriptors, sizes, the arrays the kernel writes into, the reads' tags."""

    def __init__(self, paths: list[str], fds: list[int], size: np.ndarray, bufs: list[np.ndarray]) -> None:
        self.paths, self.fds, self.size, self.bufs = paths, fds, size, bufs
        self.tags = np.empty(0, np.uint64)
        self.ring: Ring | None = None

    def arrays(self, results: list[int]) -> list[np.ndarray]:
        """Each file's bytes; a read that came back short is finished with plain reads (a file that
        shrank stops at its end), one that got more than the file's known size (it grew) is read again
        whole, a failed one raises OSError naming its file. The files are closed."""
        try:
            out = []
            for path, fd, n, buf, got in zip(self.paths, self.fds, self.size.tolist(), self.bufs, results):
                if got < 0:
                    raise OSError(-got, f"{path}: {os.strerror(-got)}")
                if got > n:
                    out.append(read_fd(fd))
                    continue
                got = finish_read(fd, buf, got, n)
                out.append(buf if got == len(buf) else buf[:got])
            return out
        finally:
            self.close()

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
