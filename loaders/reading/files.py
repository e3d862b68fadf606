"""Whole files into numpy arrays with plain syscalls, and what the page cache holds of them: the reads and
probes of `loaders.faces.dali.FileSource` (its io_uring reads are `loaders.reading.uring`'s)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.opener import open_in
from loaders.tunables import HINT_BYTES, OPEN_AT_ONCE

__all__ = ["ask_limit", "cached_whole", "hint_files", "read_fd", "read_whole_files", "will_read"]

_FIX = "re-run `prep bmap` on the files as they are now"


def read_whole_files(paths: Sequence[str], root: str | None = None) -> list[np.ndarray]:
    """Whole files as uint8 arrays, OPEN_AT_ONCE files at a time: opened and fstat'd, each read into an array
    of its own (one buffer for a batch would be a large allocation, which the C library maps fresh and the
    kernel zeroes page by page, batch after batch), and closed. The size comes from the open file, so a file
    that changed between listing and reading is read whole; one that shrank while read gives what it holds.
    root: `paths` are names below it, opened by `loaders.opener.open_in` (no link followed, regular files only:
    a block map's files)."""
    out: list[np.ndarray] = []
    for i in range(0, len(paths), OPEN_AT_ONCE):
        out += _read_group(paths[i : i + OPEN_AT_ONCE], root)
    return out


def finish_read(fd: int, buf: np.ndarray, got: int, n: int) -> int:
    """Bytes of `buf[:n]` filled after a read of the file from offset 0 returned `got`: a short read
    (interrupted, or a file that shrank while read) is finished with plain reads, stopping at the file's end."""
    while 0 < got < n:
        k = os.preadv(fd, [buf.data[got:n]], got)
        if k == 0:
            break
        got += k
    return got


def read_fd(fd: int) -> np.ndarray:
    """A whole open file, as it is now."""
    buf = np.empty(os.fstat(fd).st_size, np.uint8)
    return buf[: finish_read(fd, buf, os.preadv(fd, [buf.data], 0) if len(buf) else 0, len(buf))]


def _read_group(paths: Sequence[str], root: str | None = None) -> list[np.ndarray]:
    open_, fstat, readv, close, empty = os.open, os.fstat, os.readv, os.close, np.empty
    fds: list[int] = []
    try:
        bufs = []
        for p in paths:
            fds.append(open_(p, os.O_RDONLY | os.O_CLOEXEC) if root is None else open_in(root, p, _FIX)[0])
            bufs.append(empty(fstat(fds[-1]).st_size, np.uint8))
        out = []
        for fd, buf in zip(fds, bufs):
            n = len(buf)
            got = finish_read(fd, buf, readv(fd, [buf.data]) if n else 0, n)
            out.append(buf if got == n else buf[:got])
        return out
    finally:
        for fd in fds:
            close(fd)


_probe: Any = None  # one cachestat(2) probe per process (a ctypes handle: not pickled with a source)
_ONE_BYTE = bytearray(1)  # where `_resident`'s probing reads land (their byte is not used)
_NOWAIT = getattr(os, "RWF_NOWAIT", 0x8)  # Linux's value; Python has the name on Linux since 3.7


def _page_probe() -> Any:
    """The process's one cachestat(2) probe (`PageCacheProbe`), made on first use."""
    global _probe
    if _probe is None:
        from loaders.backends.base import PageCacheProbe

        _probe = PageCacheProbe()
    return _probe


def _resident(path: str) -> bool:
    """Whether the file at `path` is in the page cache and readable now: a one-byte RWF_NOWAIT read of its
    first and last pages (EAGAIN: not there, or still being read in; a page not there is read in by that
    probe, so on a fast disk it may be there by the time the probe returns: True then). cachestat(2) counts a
    page whose read is still in flight as cached, so a hinted batch looked warm and its read waited on the
    pipeline's thread. Where the kernel has no RWF_NOWAIT for this file: cachestat; True where neither tells."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO never blocks a probe
    except OSError:
        return True  # read_whole_files says what is wrong with it
    try:
        n = os.fstat(fd).st_size
        if n == 0:
            return True
        try:
            os.preadv(fd, [_ONE_BYTE], n - 1, _NOWAIT)
            if n > 4096:
                os.preadv(fd, [_ONE_BYTE], 0, _NOWAIT)
            return True
        except BlockingIOError:
            return False
        except OSError:  # EOPNOTSUPP / EINVAL: no RWF_NOWAIT here
            pass
        probe = _page_probe()
        return not probe.available or bool(probe.resident(fd, 0, n))
    finally:
        os.close(fd)


def cached_whole(path: str) -> bool:
    """Whether every page of the file at `path` is in the page cache now, by cachestat(2): no I/O and no
    readahead (`_resident`'s probe reads a missing page in). False where it cannot be told (no cachestat, a
    file that cannot be opened); an empty file is cached."""
    probe = _page_probe()
    if not probe.available:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        n = os.fstat(fd).st_size
        return n == 0 or bool(probe.resident(fd, 0, n))
    finally:
        os.close(fd)


def hint_files(paths: Sequence[str], limit: int = HINT_BYTES) -> None:
    """posix_fadvise(WILLNEED) on each file, in order, up to `limit` bytes in all (the kernel starts reading
    each into the page cache and returns); a file that cannot be opened is left to the read that follows,
    which says what is wrong with it."""
    open_, close, fstat = os.open, os.close, os.fstat
    for p in paths:
        try:
            fd = open_(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            n = fstat(fd).st_size
            limit -= n
            will_read(fd, 0, n)
        except OSError:
            pass
        finally:
            close(fd)
        if limit <= 0:
            return


_ASK_LIMITS: dict[int, int] = {}  # st_dev -> ask_limit's answer
RA_DEFAULT = 128 << 10  # the kernel's readahead window where the device does not say (VM_READAHEAD_PAGES)


def ask_limit(fd: int) -> int:
    """The most bytes one WILLNEED (fadvise or madvise) reads of an open file: Linux reads at most the larger of
    the device's readahead window and its largest request (`read_ahead_kb`, `max_sectors_kb`) and drops the rest
    of the range unread. 128 KiB where sysfs does not say (not a block device, no sysfs)."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return RA_DEFAULT
    if dev not in _ASK_LIMITS:
        _ASK_LIMITS[dev] = _device_limit(os.major(dev), os.minor(dev))
    return _ASK_LIMITS[dev]


def _device_limit(major: int, minor: int) -> int:
    """max(read_ahead_kb, max_sectors_kb) of the device (a partition's: its disk's queue), in bytes; the
    kernel's default window where sysfs has neither."""
    block = f"/sys/dev/block/{major}:{minor}"
    places = {
        "read_ahead_kb": (f"/sys/class/bdi/{major}:{minor}", f"{block}/queue", f"{block}/../queue"),
        "max_sectors_kb": (f"{block}/queue", f"{block}/../queue"),
    }
    found = []
    for name, folders in places.items():
        for folder in folders:
            try:
                with open(os.path.join(folder, name), encoding="ascii") as f:
                    found.append(int(f.read().strip()) << 10)
                break
            except (OSError, ValueError):
                continue
    return max(max(found, default=RA_DEFAULT), mmap.PAGESIZE)


def will_read(fd: int, offset: int, nbytes: int) -> int:
    """posix_fadvise(WILLNEED) over [offset, offset + nbytes) of an open file, in pieces of at most `ask_limit`
    bytes (one call over more reads only its first piece). Returns the calls made."""
    step = ask_limit(fd)
    calls = 0
    for at in range(offset, offset + nbytes, step):
        os.posix_fadvise(fd, at, min(step, offset + nbytes - at), os.POSIX_FADV_WILLNEED)
        calls += 1
    return calls
