"""The Linux FIEMAP ioctl through `fcntl.ioctl`: where a file's bytes lie on its filesystem's device.

`prep bmap` maps with it; raw readers (`loaders.backends.mapped`) check a file's current extents with it.

Structures follow linux/fiemap.h: a 32-byte `struct fiemap` header followed by `fm_extent_count`
56-byte `struct fiemap_extent` records. The kernel fills at most that many extents per call, so
`fiemap` pages, restarting at the end of the last extent returned, until an extent carries
FIEMAP_EXTENT_LAST (or none are left).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterable
from typing import NamedTuple

from loaders.errors import UnsupportedFilesystemError
from loaders.tunables import DEFAULT_BATCH

FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
FIEMAP_MAX_OFFSET = (1 << 64) - 1

FIEMAP_FLAG_SYNC = 0x1  # flush dirty data first, so delayed allocations get real addresses
FIEMAP_FLAG_XATTR = 0x2
FIEMAP_FLAG_CACHE = 0x4

# Extent flags (fe_flags), every one the kernel header defines.
EXTENT_FLAGS: dict[str, int] = {
    "LAST": 0x1,
    "UNKNOWN": 0x2,
    "DELALLOC": 0x4,
    "ENCODED": 0x8,
    "DATA_ENCRYPTED": 0x80,
    "NOT_ALIGNED": 0x100,
    "DATA_INLINE": 0x200,
    "DATA_TAIL": 0x400,
    "UNWRITTEN": 0x800,
    "MERGED": 0x1000,
    "SHARED": 0x2000,
}
FIEMAP_EXTENT_LAST = EXTENT_FLAGS["LAST"]

# Flags whose extents must never be read from the raw device; the value is the reason recorded.
UNSAFE_FLAGS: dict[int, str] = {
    EXTENT_FLAGS["UNKNOWN"]: "unknown",
    EXTENT_FLAGS["DELALLOC"]: "delalloc",
    EXTENT_FLAGS["ENCODED"]: "encoded",
    EXTENT_FLAGS["DATA_ENCRYPTED"]: "encrypted",
    EXTENT_FLAGS["NOT_ALIGNED"]: "not_aligned",
    EXTENT_FLAGS["DATA_INLINE"]: "inline",
    EXTENT_FLAGS["DATA_TAIL"]: "tail",
    EXTENT_FLAGS["UNWRITTEN"]: "unwritten",
}
# Flags that say nothing against a raw read: LAST, MERGED (the fs merged its own records), SHARED (reflink).
SAFE_FLAGS = EXTENT_FLAGS["LAST"] | EXTENT_FLAGS["MERGED"] | EXTENT_FLAGS["SHARED"]

_HEADER = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXTENT = struct.Struct("=QQQ16xI12x")  # logical, physical, length, (reserved64[2]), flags, (reserved[3])
_MAPPED = struct.Struct("=I")  # fm_mapped_extents, at byte 20 of the header
_FIRST = struct.Struct("=20xI8xQQQ16xI12x")  # fm_mapped_extents and the first extent, in one unpack
assert _HEADER.size == 32 and _EXTENT.size == 56
_local = threading.local()  # one ioctl buffer per thread, reused: allocation is a visible cost per file


class Extent(NamedTuple):
    """One extent: `length` bytes of the file at `logical` lie at byte `physical` of the filesystem's device.

    A NamedTuple, not a dataclass: a million-file walk builds one per file, and it serialises as a JSON array.
    """

    logical: int
    physical: int
    length: int
    flags: int

    @property
    def flag_names(self) -> list[str]:
        """Names of the flags set (unknown bits as hex)."""
        return flag_names(self.flags)

    @property
    def end(self) -> int:
        """Logical end (exclusive)."""
        return self.logical + self.length


def flag_names(flags: int) -> list[str]:
    """Decode fe_flags into names; bits the header does not define appear as '0x...'."""
    names = [name for name, bit in EXTENT_FLAGS.items() if flags & bit]
    rest = flags & ~sum(EXTENT_FLAGS.values())
    if rest:
        names.append(hex(rest))
    return names


# The kernel sets a general flag together with the specific one (linux/fiemap.h): report the specific one.
_IMPLIES = {
    EXTENT_FLAGS["DELALLOC"]: EXTENT_FLAGS["UNKNOWN"],
    EXTENT_FLAGS["DATA_ENCRYPTED"]: EXTENT_FLAGS["ENCODED"],
    EXTENT_FLAGS["DATA_INLINE"]: EXTENT_FLAGS["NOT_ALIGNED"],
    EXTENT_FLAGS["DATA_TAIL"]: EXTENT_FLAGS["NOT_ALIGNED"],
}


def unsafe_reasons(flags: int) -> list[str]:
    """Why an extent with these flags must not be read raw ([] when it may), the specific reason rather than
    the general flag the kernel sets with it (inline, not inline+not_aligned). Undefined bits count as unsafe."""
    shown = flags
    for specific, general in _IMPLIES.items():
        if flags & specific:
            shown &= ~general
    reasons = [reason for bit, reason in UNSAFE_FLAGS.items() if shown & bit]
    rest = flags & ~(SAFE_FLAGS | sum(UNSAFE_FLAGS))
    if rest:
        reasons.append(f"flag_{rest:#x}")
    return reasons


def _ioctl(fd: int, buf: bytearray, name: str) -> None:
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)  # releases the GIL
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY):
            raise UnsupportedFilesystemError(
                f"{name}: the filesystem does not support FIEMAP ({exc.strerror}); "
                "block maps need ext4, xfs or another FIEMAP filesystem on a block device"
            ) from exc
        raise


class FiemapReader:
    """FIEMAP with one reusable buffer (use one per thread) and a fast path for the common file of one extent:
    one ioctl, one unpack, plain (logical, physical, length, flags) tuples. Mapping a million files is a
    million of these calls, so the Python around the ioctl is the cost that matters."""

    def __init__(self, sync: bool = True, batch: int = DEFAULT_BATCH) -> None:
        self.sync, self.batch = sync, batch
        self.buffer = bytearray(_HEADER.size + batch * _EXTENT.size)
        # the request header, copied into the buffer before each call (the kernel writes into it)
        self.header = _HEADER.pack(0, FIEMAP_MAX_OFFSET, FIEMAP_FLAG_SYNC if sync else 0, 0, batch, 0)
        # buffer -> (fm_mapped_extents, first extent's logical, physical, length, flags)
        self.unpack_first = _FIRST.unpack_from

    def __call__(self, fd: int, name: str = "?") -> list[tuple[int, int, int, int]]:
        """All extents of `fd` (paging through `fiemap_fd` when there are more than fit in one call)."""
        buf = self.buffer
        buf[: _HEADER.size] = self.header
        _ioctl(fd, buf, name)
        mapped, logical, physical, length, flags = _FIRST.unpack_from(buf)
        if mapped == 1 and flags & FIEMAP_EXTENT_LAST:
            return [(logical, physical, length, flags)]
        if mapped == 0:
            return []
        return [(e[0], e[1], e[2], e[3]) for e in fiemap_fd(fd, sync=self.sync, batch=self.batch, name=name)]


def fiemap_fd(fd: int, *, sync: bool = True, batch: int = DEFAULT_BATCH, name: str = "?") -> list[Extent]:
    """All extents of the open file `fd`, paging until the LAST extent. Raises UnsupportedFilesystemError."""
    flags = FIEMAP_FLAG_SYNC if sync else 0
    size = _HEADER.size + batch * _EXTENT.size
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) != size:
        buf = _local.buf = bytearray(size)
    extents: list[Extent] = []
    start = 0
    while True:
        _HEADER.pack_into(buf, 0, start, FIEMAP_MAX_OFFSET - start, flags, 0, batch, 0)
        _ioctl(fd, buf, name)
        mapped = _MAPPED.unpack_from(buf, 20)[0]
        for i in range(mapped):
            extents.append(Extent._make(_EXTENT.unpack_from(buf, _HEADER.size + i * _EXTENT.size)))
        if mapped < batch or not mapped or extents[-1].flags & FIEMAP_EXTENT_LAST:
            return extents
        start = extents[-1].logical + extents[-1].length


def fiemap(path: str | os.PathLike[str], *, sync: bool = True, batch: int = DEFAULT_BATCH) -> list[Extent]:
    """All extents of the file at `path` (FIEMAP_FLAG_SYNC by default)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fiemap_fd(fd, sync=sync, batch=batch, name=os.fspath(path))
    finally:
        os.close(fd)


def merge_adjacent(extents: Iterable[Extent]) -> list[Extent]:
    """Join extents that continue each other both logically and physically with the same flags (LAST aside).

    Filesystems split long runs into several records (ext4 at 128 MiB); for contiguity they are one range.
    """
    out: list[Extent] = []
    for e in extents:
        if out:
            p = out[-1]
            same = (p.flags & ~FIEMAP_EXTENT_LAST) == (e.flags & ~FIEMAP_EXTENT_LAST)
            if same and p.end == e.logical and p.physical + p.length == e.physical:
                out[-1] = Extent(p.logical, p.physical, p.length + e.length, e.flags)
                continue
        out.append(e)
    return out
