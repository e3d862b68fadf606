"""The one stale-file rule of every block-range reader (`blockdev`, `xnvme-bmap`): which files of a block map
may be read raw, decided once per file per backend, and the filesystem read for the others.

A file is read through the filesystem instead of raw, with one warning per file (or BackendError when
`fallback=False`), when its entry is not raw-readable (inline, unwritten, ... extents), when it changed
since it was mapped (size, inode or mtime differ, or it is gone), or when its blocks moved: its CURRENT
extents (one FIEMAP call on the first read, beside the stat) differ from the map's, as after `e4defrag`,
which keeps size, inode and times. The file is opened through the filesystem for that check, so a raw
read happens only for files the reader may open, at the extents the file owns now.

A block map is not trusted for where the filesystem lies on the raw source either: the offset of the
filesystem on the device, partition or loop image (`window`) comes from sysfs for the device the mapped
root is mounted from, and every raw extent must lie inside that filesystem's device.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from loaders.backends.base import FdCache, ReadRequest, pread_full, short_read
from loaders.blockmap.bmap import BlockMap, RawSource
from loaders.blockmap.fiemap import EXTENT_FLAGS, FiemapReader
from loaders.errors import BackendError, UnsafeFileError
from loaders.opener import open_in
from loaders.tunables import RECENT_CTIME_S

UNCHECKED = "?"  # verdict of a file whose check has not run (or is still running)
MOVED = "its blocks moved on the device: defragmented or rewritten in place"
_IGNORED_FLAGS = EXTENT_FLAGS["LAST"] | EXTENT_FLAGS["MERGED"]  # say nothing about where the bytes are
_FIX = "re-run `prep bmap` on the files as they are now"
_local = threading.local()  # one FIEMAP buffer per checking thread


class Window(NamedTuple):
    """Where the filesystem lies on the raw source: `base` bytes in, `size` bytes long (None: unknown)."""

    base: int
    size: int | None


def _sysfs(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def window(bmap: BlockMap, source: RawSource) -> Window:
    """The filesystem's place on `source`, from sysfs for the device that holds `bmap.root` now (the map's
    own partition start and loop offset count only where the system cannot tell). BackendError when
    `source` is neither that device, its whole disk, nor its loop image file."""
    try:
        dev = os.stat(bmap.root).st_dev
        src = os.stat(source.path)
    except OSError:
        return Window(source.base, None)
    sys_dir = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    blocks = _sysfs(f"{sys_dir}/size")
    if blocks is None:  # not a block device the system describes (overlay, network): the map decides
        return Window(source.base, None)
    size, start = int(blocks) * 512, int(_sysfs(f"{sys_dir}/start") or 0) * 512
    partition = os.path.exists(f"{sys_dir}/partition")
    parent = os.path.dirname(os.path.realpath(sys_dir)) if partition else None
    if stat.S_ISBLK(src.st_mode):
        if src.st_rdev == dev:
            return Window(0, size)
        if parent and _sysfs(f"{parent}/dev") == f"{os.major(src.st_rdev)}:{os.minor(src.st_rdev)}":
            return Window(start, size)
    elif stat.S_ISREG(src.st_mode):
        loop = f"{parent or os.path.realpath(sys_dir)}/loop"
        backing = _sysfs(f"{loop}/backing_file")
        if backing and os.path.exists(backing) and os.path.samefile(backing, source.path):
            return Window(int(_sysfs(f"{loop}/offset") or 0) + start, size)
    raise BackendError(
        f"{source.path}: not the device (nor its disk or loop image) that holds {bmap.root} now; "
        "pass that device as device_path or re-run `prep bmap` on this one"
    )


class WriteClock:
    """The write counters of the block device a filesystem lies on, from sysfs: sectors written and discarded
    (`stat`) and writes in flight (`inflight`). While they stand still and nothing is in flight, no byte on
    the device changed (a cache flush, as `sync` sends, is a write of no sectors: it moves nothing here), so
    a file whose blocks were checked at that reading still has its bytes there, even if the filesystem moved
    it in memory meanwhile (the old blocks are rewritten only by a later write, which moves the counters).
    `now()` is None where that cannot be told: not a block device sysfs describes (overlay, btrfs, network),
    a DAX device (persistent memory: writes are memory stores, not counted requests), I/O statistics off for
    its queue, or no write counted yet on a writable filesystem (a driver that does not count)."""

    def __init__(self, root: str) -> None:
        self._stat = self._inflight = self._iostats = ""
        try:
            dev = os.stat(root).st_dev
        except OSError:
            return
        sys_dir = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        queue = sys_dir if os.path.isdir(f"{sys_dir}/queue") else os.path.dirname(sys_dir)  # a partition's disk
        dax = _sysfs(f"{queue}/queue/dax") == "1"  # a DAX filesystem writes by memory stores: nothing is counted
        if os.path.isfile(f"{sys_dir}/stat") and os.path.isfile(f"{queue}/queue/iostats") and not dax:
            self._stat, self._inflight = f"{sys_dir}/stat", f"{sys_dir}/inflight"
            self._iostats = f"{queue}/queue/iostats"

    def now(self) -> tuple[int, ...] | None:
        """(sectors written, sectors discarded) now, or None: unknown, or writes in flight."""
        if not self._stat:
            return None
        try:
            if _read_small(self._iostats) != b"1\n":
                return None
            inflight = _read_small(self._inflight).split()
            fields = [int(x) for x in _read_small(self._stat).split()]
        except (OSError, ValueError):
            return None
        if len(inflight) != 2 or inflight[1] != b"0" or len(fields) < 7 or fields[4] == 0:
            return None
        return fields[6], *fields[13:14]


def _read_small(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def loop_image(device: str) -> str | None:
    """The image file behind loop device `device` (or a partition of it) when the loop driver reads that
    image through its page cache (`dio` off, the default), else None. Raw reads of the image itself then give
    the same bytes as the device (the driver copies them from that same page cache) without the driver's
    one worker thread per device in the way: it served O_DIRECT reads of a warm image at a fraction of the memory
    speed a plain read of the image runs at (docs/benchmarks.md, DALI sources)."""
    try:
        st = os.stat(device)
    except OSError:
        return None
    if not stat.S_ISBLK(st.st_mode):
        return None
    sys_dir = os.path.realpath(f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    if os.path.exists(f"{sys_dir}/partition"):
        sys_dir = os.path.dirname(sys_dir)
    backing = _sysfs(f"{sys_dir}/loop/backing_file")
    if not backing or _sysfs(f"{sys_dir}/loop/dio") != "0" or not os.path.isfile(backing):
        return None  # not a loop device, direct I/O to its image, or the image is gone ("... (deleted)")
    return backing if os.access(backing, os.R_OK) else None


def _read_only(root: str) -> bool:
    """Whether the filesystem holding `root` is read-only now: its superblock, not only this mount (a read-only
    bind mount of a writable filesystem does not count), from /proc/self/mountinfo's super options. False
    when it cannot be told."""
    try:
        if not os.statvfs(root).f_flag & os.ST_RDONLY:  # a read-only superblock makes every mount of it so
            return False
        st = os.stat(root)
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split(" ")
        if len(parts) > 2 and parts[2] == dev:  # fstype, source, super options
            supers = tail.split(" ")
            return len(supers) > 2 and "ro" in supers[2].split(",")
    return False


def _runs(extents: Sequence[Sequence[int]], size: int) -> list[tuple[int, int, int, int]]:
    """Extents holding file bytes, neighbours merged: the comparable form of a map's and FIEMAP's lists."""
    out: list[tuple[int, int, int, int]] = []
    for e in extents:
        lo, ph, n, fl = int(e[0]), int(e[1]), int(e[2]), int(e[3]) & ~_IGNORED_FLAGS
        if lo >= size:
            continue
        if out and out[-1][3] == fl and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ph:
            p = out[-1]
            out[-1] = (p[0], p[1], p[2] + n, fl)
        else:
            out.append((lo, ph, n, fl))
    return out


_SYNC_WRITE_AND_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER (linux/fs.h)


@functools.cache
def _sync_file_range() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def write_back(fd: int) -> None:
    """Write the file's dirty pages to its device and wait (sync_file_range, on a read-only descriptor too; no
    journal commit nor cache flush: a raw read needs the bytes on the device, not durable). A file rewritten and
    not yet written back has its new bytes only in the page cache; the device, which raw reads go to, still holds
    the old ones. Nothing dirty: one page-cache lookup (docs/security.md has the cost). OSError where it fails."""
    fn = _sync_file_range()
    if fn is None:  # not Linux's libc: the slower call that also writes metadata
        os.fdatasync(fd)
    elif fn(fd, 0, 0, _SYNC_WRITE_AND_WAIT) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def current_extents(fd: int, name: str) -> list[tuple[int, int, int, int]]:
    """The file's extents now (FIEMAP without SYNC: dirty data shows as delalloc, so it differs from a map)."""
    reader = getattr(_local, "fiemap", None)
    if reader is None:
        reader = _local.fiemap = FiemapReader(sync=False)
    return reader(fd, name)


STALE_OFF_WARNING = (
    "check_stale=False: raw reads go to the extents the map names without checking that each file still owns "
    "them, so an edited map or a changed file can return another file's blocks or filesystem metadata; use it "
    "only for a map you made of a read-only mount"
)


class MappedFiles:
    """Per-file verdicts for one backend: `why[key]` is None (read raw), a reason (read through the
    filesystem), or absent (not checked yet). `source` is where raw reads go; `self.source` is the same
    path with the base the system gives (see `window`). `check_stale=False` trusts the map's freshness
    (data that cannot change); the record's own checks (raw-readable, inside the device) still apply."""

    def __init__(self, bmap: BlockMap, source: RawSource, fallback: bool = True, check_stale: bool = True) -> None:
        self.bmap = bmap
        self.fallback = fallback
        self.check_stale = check_stale
        if not check_stale:
            warnings.warn(STALE_OFF_WARNING, RuntimeWarning, stacklevel=3)
        if bmap.flat and not bmap.doc["root"]:  # a flat map with nowhere to look: trusted as it is (it warned)
            self.window, self.check_stale = Window(source.base, None), False
        else:
            self.window = window(bmap, source)
        self.source = RawSource(source.path, self.window.base)
        self.why: dict[str, str | None] = {}
        self._expect: dict[str, tuple[int, int, int, int, list[tuple[int, int, int, int]] | None]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._fs = FdCache(os.O_RDONLY, root=bmap.root)  # below the root, no link followed
        self._clock = WriteClock(bmap.root) if self.check_stale else None
        self._seen: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # key -> (its lstat, clock) when checked

    def reason(self, key: str) -> str | None:
        """Why `key` must be read through the filesystem (None: raw), checked on first use."""
        why = self.why.get(key, UNCHECKED)
        if why is None:
            self.refresh([key])
            why = self.why.get(key, UNCHECKED)
        if why == UNCHECKED:
            self.check_many([key])
            why = self.why[key]
        return why

    def refresh(self, keys: Iterable[str]) -> None:
        """Forget the raw verdict of each file that is not now what its record says: inode, size, mtime and
        extents (one open, fstat and FIEMAP per file per read call), so its next use checks it again and reads
        it through the filesystem. A file rewritten or removed after its first read, or whose blocks moved
        (e4defrag keeps its inode, size and times), is noticed at the next call, not once per backend.
        While the filesystem is read-only (its superblock: `_read_only`, once per call) nothing in it can
        change or move, so the files are not opened again: on small files that check costs as much as reading
        them. (Only root can make it writable, change files and make it read-only again between two calls.)
        While nothing was written to the device since a file's last full check (`WriteClock`), one lstat
        stands for it: its device, inode, size, mtime and ctime as then (a write into the page cache changes
        mtime and ctime at once; a move leaves the old blocks as they were until a write reaches the device)."""
        if not self.check_stale or _read_only(self.bmap.root):
            return
        files, root, why, seen = self.bmap.files, self.bmap.root + "/", self.why, self._seen
        clock = self._clock.now() if self._clock is not None else None
        lstat = os.lstat
        for k in dict.fromkeys(keys):
            if k not in why or why[k] is not None:
                continue
            was = seen.get(k) if clock is not None else None
            if was is not None and was[1] == clock:
                try:
                    st = lstat(root + k)
                except OSError:
                    st = None
                if st is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == was[0]:
                    continue
            try:
                fd = open_in(self.bmap.root, k, _FIX)[0]
            except (OSError, UnsafeFileError):
                del why[k]
                continue
            try:
                if self._compare(k, files[k], fd, clock) is not None:
                    del why[k]
            finally:
                os.close(fd)

    def precheck(self, key: str) -> str | None:
        """What the record alone says against a raw read (not raw-readable; an extent outside the filesystem's
        device), without touching the file; stored as the verdict when it says something."""
        r = self.bmap.files[key]
        why = None
        size = r["size"]
        if not r["raw_readable"]:
            why = f"not raw-readable ({r.get('reason')})"
        elif self.window.size is not None:
            end = self.window.size
            if any(e[1] < 0 or e[1] + min(e[2], size - e[0]) > end for e in r["extents"] if e[0] < size):
                why = f"its map points outside the filesystem's device ({end} bytes): edited or not this device"
        if why is not None:
            self.why[key] = why
        return why

    def _stale(self, key: str) -> str | None:
        stale = self.bmap.stale_reason(key)
        return f"changed since it was mapped ({stale})" if stale else None

    def _expected(self, r: dict[str, Any]) -> tuple[int, int, int, int, list[tuple[int, int, int, int]] | None]:
        """(size, inode, mtime_ns, ctime_ns, runs of its extents) of a record: what a fresh file shows (runs:
        None for a flat map, whose one extent is compared on its own terms; ctime -1 for a map without it,
        which no file matches)."""
        runs = None if self.bmap.flat else _runs(r["extents"], r["size"])
        return r["size"], r["inode"], r["mtime_ns"], r.get("ctime_ns", -1), runs

    def _compare(self, key: str, r: dict[str, Any], fd: int, clock: tuple[int, ...] | None = None) -> str | None:
        """The verdict of an open file: its stat and its extents now against its record (the record's side
        made once per file: `refresh` compares every file of every read call). `clock`: the device's write
        counters read before this check, kept with the file's stat when it is fresh (see `refresh`)."""
        self._seen.pop(key, None)
        want = self._expect.get(key)
        if want is None:
            want = self._expect[key] = self._expected(r)
        try:
            t0 = time.time_ns()
            write_back(fd)  # a dirty page's new bytes are on the device now: a raw read returns them
            st = os.fstat(fd)
            if (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != want[:4]:
                return self._stale(key) or "changed since it was mapped (replaced while checked)"
            now = current_extents(fd, key)
        except OSError as exc:
            return f"changed since it was mapped (cannot map it now: {exc.strerror})"
        if want[4] is None:  # flat: one run of whole LBAs, the file's bytes must lie in one extent starting there
            runs, ph = _runs(now, r["size"]), r["extents"][0][1]
            same = len(runs) == 1 and runs[0][:2] == (0, ph) and runs[0][2] >= r["size"] and not runs[0][3]
        else:
            same = _runs(now, r["size"]) == want[4]
        if not same:
            return f"changed since it was mapped ({MOVED})"
        if clock is not None and st.st_ctime_ns < t0 - int(RECENT_CTIME_S * 1e9):
            self._seen[key] = ((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), clock)
        return None

    def check_many(self, keys: Iterable[str]) -> None:
        """Verdicts of `keys`: open through the filesystem, fstat, one FIEMAP, close (for batches: the
        blockdev backend runs this on a small pool beside its data reads)."""
        files, root, close = self.bmap.files, self.bmap.root, os.close
        clock = self._clock.now() if self._clock is not None else None
        for k in keys:
            if self.precheck(k) is not None:
                continue
            if not self.check_stale:
                self.why[k] = None
                continue
            try:  # below the root, no link followed, regular files only (loaders.opener)
                fd = open_in(root, k, _FIX)[0]
            except OSError as exc:
                self.why[k] = self._stale(k) or f"changed since it was mapped (cannot open it now: {exc.strerror})"
                continue
            except UnsafeFileError as exc:
                self.why[k] = f"changed since it was mapped ({str(exc).split(': ', 1)[-1]})"
                continue
            try:
                self.why[k] = self._compare(k, files[k], fd, clock)
            finally:
                close(fd)

    def changed(self, keys: Iterable[str]) -> set[str]:
        """The keys among `keys` whose files were found changed since mapping (none until checked)."""
        why = self.why.get
        return {k for k in keys if (w := why(k)) is not None and w.startswith("changed")}

    def fs_read(self, key: str, why: str, req: ReadRequest, buf: memoryview) -> None:
        """Read `req` through the filesystem into `buf` (warning once per file), or raise without fallback."""
        path = self.bmap.file_path(key)
        if not self.fallback:
            raise BackendError(f"{path}: {why}; re-run `prep bmap` or allow fallback=True")
        fd = self._fs.get(key)  # below the root, no link followed: UnsafeFileError before any warning
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            warnings.warn(f"{path}: {why}; reading it through the filesystem", RuntimeWarning, stacklevel=5)
        got = pread_full(fd, buf, req.offset)
        if got < req.nbytes:
            raise short_read(req, got)

    def close(self) -> None:
        """Close the descriptors of filesystem reads."""
        self._fs.close()

    def __getstate__(self) -> dict[str, Any]:
        # verdicts travel to worker processes; locks and descriptors are rebuilt there
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_fs")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._fs = FdCache(os.O_RDONLY, root=self.bmap.root)
