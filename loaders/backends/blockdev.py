"""Read files through a block map from the raw block device (or the loop image file standing in for it).

Each request (file path or key, offset, nbytes) becomes device segments (`BlockMap.segments`); data
segments are read with O_DIRECT into aligned buffers (the covering aligned range, then sliced when the
file offset is unaligned), holes are zero-filled, many requests in flight on the thread pool. Entries that
must not be read raw (inline, unwritten, ... extents), that changed since mapping or whose blocks moved
are read through the filesystem instead, with one warning per file, unless `fallback=False`: the rule is
`loaders.backends.mapped.MappedFiles`, shared with the `xnvme-bmap` backend.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from loaders.backends.base import Backend, PageCacheProbe, ReadRequest, aligned_empty, pread_full, short_read
from loaders.backends.mapped import MappedFiles, loop_image
from loaders.blockmap.bmap import BlockMap, RawSource
from loaders.cache.spec import ALIGN
from loaders.errors import BackendError, FormatError


class RawDevice:
    """An O_DIRECT reader of a block device or image file at any byte offset (buffered where O_DIRECT is
    refused, or with `direct=False`: a loop image its driver reads through the page cache)."""

    def __init__(self, path: str, align: int = ALIGN, direct: bool = True) -> None:
        self.path = path
        self.align = align
        self._fd: int | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self.direct = direct

    def direct_capable(self) -> bool:
        """Whether reads go O_DIRECT (opens the descriptor to find out)."""
        self.fd()
        return self.direct

    def fd(self) -> int:
        """The descriptor, opened on first use (and again after a fork)."""
        if self._fd is None or self._pid != os.getpid():
            with self._lock:
                if self._fd is None or self._pid != os.getpid():
                    self._fd = self._open()
                    self._pid = os.getpid()
        return self._fd

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | (getattr(os, "O_DIRECT", 0) if self.direct else 0))
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # the filesystem holding an image may not do O_DIRECT
                self.direct = False
                return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            raise BackendError(f"{self.path}: cannot open for raw reads ({exc.strerror}); {_open_hint()}") from None

    def read_into(self, offset: int, out: memoryview, nbytes: int | None = None) -> None:
        """Fill out[:nbytes] with the bytes at `offset`. Bytes of `out` past `nbytes` (default len(out)) may be
        overwritten: given that room, an aligned read with an unaligned end lands in place, with no copy."""
        n = len(out) if nbytes is None else nbytes
        if n == 0:
            return
        a = self.align
        lo, hi = offset - offset % a, -(-(offset + n) // a) * a
        fd = self.fd()
        if not self.direct or (lo == offset and hi - lo <= len(out) and _address(out) % a == 0):
            got = pread_full(fd, out[: n if not self.direct else hi - lo], offset)
            if got < n:
                raise BackendError(f"{self.path}: short read at byte {offset} ({got} of {n}); wrong device?")
            return
        scratch = aligned_empty(hi - lo, a)
        got = pread_full(fd, scratch.data, lo)
        if got < offset - lo + n:
            raise BackendError(f"{self.path}: short read at byte {offset} ({got} of {hi - lo}); wrong device?")
        out[:n] = scratch.data[offset - lo : offset - lo + n]

    def __getstate__(self) -> dict[str, Any]:
        # descriptors and locks do not travel to worker processes: reopened there on first use
        return {"path": self.path, "align": self.align, "direct": self.direct}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["align"], state.get("direct", True))  # type: ignore[misc]

    def close(self) -> None:
        """Close the descriptor."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def _open_hint() -> str:
    """The fix for a raw source that cannot be opened (root is never told to become root)."""
    if os.geteuid() == 0:
        return "check that the device (or the loop image file) exists, or pass it as device_path"
    return "run as a user who may read the device (root or the disk group), or pass the loop image file"


_PLAN_SLICE = 256  # requests planned before their reads are submitted (planning overlaps reading)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _address(view: memoryview) -> int:

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class BlockdevBackend(Backend):
    """Raw block-range reads of mapped files. `bmap` is a BlockMap or a bmap.json path; `device_path` picks the
    device, its whole disk, or the loop image file (default: the device when readable, else the image; a loop
    device whose driver reads its image through the page cache is read as that image, through the same page
    cache: the same bytes, without the driver's worker in the way, `loaders.backends.mapped.loop_image`).

    On its first read, each file is opened through the filesystem, fstat()ed and FIEMAPped to catch a stale
    map or moved blocks (on a small pool beside the data reads), and again (open, fstat, FIEMAP) on every later
    read call after a write reached the device, since defragmentation moves blocks without changing a stat
    field (in between, one lstat a file: `MappedFiles.refresh`);
    `check_stale=False` skips that for data that cannot change (a read-only mount). `fallback=False`
    raises instead of reading through the filesystem."""

    name = "blockdev"

    def __init__(
        self,
        bmap: BlockMap | str | os.PathLike[str],
        device_path: str | os.PathLike[str] | None = None,
        threads: int = 16,
        fallback: bool = True,
        check_stale: bool = True,
        coalesce: int = 1 << 20,
        max_gap: int = 64 << 10,
        stat_threads: int = 2,
    ) -> None:
        super().__init__(threads)
        self.stat_threads = max(1, stat_threads)
        self._stat_pool: ThreadPoolExecutor | None = None
        self._stat_pid = 0
        self.coalesce = coalesce
        self.max_gap = max_gap
        self.bmap = bmap if isinstance(bmap, BlockMap) else BlockMap.load(bmap)
        source = self.bmap.source(device_path)
        image = loop_image(source.path) if device_path is None else None
        self.guard = MappedFiles(self.bmap, RawSource(image, 0) if image else source, fallback, check_stale)
        self.source: RawSource = self.guard.source  # the base from the system, not from the map
        self._why = self.guard.why  # key -> why it must go through the filesystem (checked once)
        self._raw = RawDevice(self.source.path, direct=image is None)
        self._probe = PageCacheProbe()
        self._fast: dict[str, tuple[int, int, int] | None] = {}  # key -> its one extent (see _fast_entry)

    def cached(self, key: str) -> bool:
        """Whether a raw read of `key` would now come from the page cache, with no disk wait: a loop image read
        through its page cache, the file in one extent and all of it resident (cachestat). False for O_DIRECT
        reads and where it cannot be told."""
        f = None if self._raw.direct else self._fast_entry(key)
        return f is not None and f[2] > f[1] and self._probe.resident(self._raw.fd(), f[0] + f[1], f[2] - f[1])

    def changed(self, keys: Iterable[str]) -> set[str]:
        """The keys among `keys` whose files were found changed since mapping (none until checked)."""
        return self.guard.changed(keys)

    def _one(self, req: ReadRequest, buf: Any, room: int = 0) -> None:
        # room: bytes of buf past nbytes that this backend allocated itself and may overwrite
        try:
            key = self.bmap.key_for(req.path)
        except FormatError as exc:
            raise BackendError(str(exc)) from None
        view = memoryview(buf).cast("B")[: req.nbytes + room]
        why = self.guard.reason(key)
        if why:
            self.guard.fs_read(key, why, req, view[: req.nbytes])
            return
        try:
            segments = self.bmap.segments(key, req.offset, req.nbytes)
        except ValueError:
            raise short_read(req, max(0, self.bmap.entry(key).size - req.offset)) from None
        base = self.source.base
        for seg in segments:  # in file order: a segment's overrun is overwritten by the ones after it
            at = seg.file_offset - req.offset
            if seg.device_offset is None:
                view[at : at + seg.nbytes] = bytes(seg.nbytes)  # a hole reads as zeros
            else:
                # a segment may spill into the next segment's place or the room, never past them
                self._raw.read_into(base + seg.device_offset, view[at:], seg.nbytes)

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        self._run(requests, buffers, [0] * len(requests))

    def read(self, requests: Sequence[ReadRequest]) -> list[Any]:
        # One aligned arena for the batch; each request gets an aligned slot padded to the alignment, so an
        # unaligned file end lands in place (no bounce copy) and there is one allocation, not one per file.
        a = self._raw.align
        n = len(requests)
        nbytes = [r.nbytes for r in requests]
        sizes = [-(-max(k, 1) // a) * a for k in nbytes]
        starts = list(itertools.accumulate(sizes[:-1], initial=0))
        arena = aligned_empty(sum(sizes), a)
        if n > 1 and self.threads > 1 and self.coalesce > 0:
            self._read_arena(requests, arena, starts, sizes)
        else:
            buffers = [arena[s : s + k] for s, k in zip(starts, sizes)]
            self._run(requests, buffers, [k - r for k, r in zip(sizes, nbytes)])
        return [arena[s : s + k] for s, k in zip(starts, nbytes)]

    def _fast_entry(self, key: str) -> tuple[int, int, int] | None:
        """(device offset of file byte 0, first and end file byte) of a raw-readable file whose bytes lie in one
        extent, or None; cached per key for the backend's life."""
        hit = self._fast.get(key, False)
        if hit is not False:
            return hit  # type: ignore[return-value]
        r = self.bmap.files[key]  # the raw record: parsing a FileEntry would cost more than this whole plan
        ext = r["extents"]
        got = None
        if r["raw_readable"] and len(ext) == 1:
            lo, ph, ln = int(ext[0][0]), int(ext[0][1]), int(ext[0][2])
            got = (self.source.base + ph - lo, lo, min(int(r["size"]), lo + ln))
        self._fast[key] = got
        return got

    def _read_arena(self, requests: Sequence[ReadRequest], arena: Any, starts: list[int], sizes: list[int]) -> None:
        """The batch path of `read`: requests whose range lies in one extent become (device offset, arena slot)
        pieces, sorted by device offset and read in runs of neighbours (one preadv each, straight into the
        slots); the rest go request by request. Planning is a few dict lookups per file: at tens of thousands
        of small files per second the Python per file is what limits the bandwidth."""
        keys, checks = self._keys(requests)
        a = self._raw.align
        why_of, fast_of = self._why.get, self._fast_entry
        pieces: list[tuple[int, int, int, int]] = []  # (device offset, arena offset, padded span, nbytes)
        confirm: list[int] = []  # requests read before their file's freshness check came back
        slow: list[int] = []
        for i, key in enumerate(keys):
            r = requests[i]
            why = why_of(key, "?")
            f = fast_of(key) if why is None or why == "?" else None
            if f is None or r.offset < f[1] or r.offset + r.nbytes > f[2] or (f[0] + r.offset) % a:
                slow.append(i)
                continue
            pieces.append((f[0] + r.offset, starts[i], sizes[i], r.nbytes))
            if why == "?":
                confirm.append(i)
        pieces.sort()
        view = memoryview(arena).cast("B")
        runs, warm = list(self._runs(pieces)), []
        if not self._raw.direct:  # a loop image read through its page cache: warm runs are copies, done here
            fd, resident = self._raw.fd(), self._probe.resident
            warm = [r for r in runs if resident(fd, r[0][0], r[-1][0] + r[-1][2] - r[0][0])]
            runs = [r for r in runs if r not in warm] if warm else runs
        futures: list[Future[Any]] = [self.pool.submit(self._read_slots, run, view) for run in runs]
        rooms = [k - r.nbytes for k, r in zip(sizes, requests)]
        futures += [self.pool.submit(self._one, requests[i], arena[starts[i] :], rooms[i]) for i in slow]
        for run in warm:  # a pool hand-off costs more than copying a few warm runs
            self._read_slots(run, view)
        for fut in [*checks, *futures]:
            fut.result()
        for i in confirm:
            if self._why[keys[i]] is not None:  # changed since mapping: the raw bytes may be wrong, read it again
                self._one(requests[i], arena[starts[i] :], rooms[i])

    def _runs(self, pieces: list[tuple[int, int, int, int]]) -> Iterator[list[tuple[int, int, int, int]]]:
        """Group sorted pieces into runs: neighbours at most `max_gap` apart, not overlapping, at most
        `coalesce` bytes from the first device byte to the last, at most IOV_MAX/2 pieces."""
        run: list[tuple[int, int, int, int]] = []
        end = 0
        limit, gap, most = self.coalesce, self.max_gap, _IOV_MAX // 2
        for p in pieces:
            if run and (p[0] < end or p[0] > end + gap or p[0] + p[2] - run[0][0] > limit or len(run) >= most):
                yield run
                run = []
            run.append(p)
            end = p[0] + p[2]
        if run:
            yield run

    def _read_slots(self, run: list[tuple[int, int, int, int]], view: memoryview) -> None:
        """One O_DIRECT preadv of a run straight into its arena slots (gaps into a throwaway buffer)."""
        iov: list[memoryview] = []
        start = pos = run[0][0]
        gap: memoryview | None = None
        for dev, at, span, _ in run:
            if dev > pos:
                if gap is None:
                    gap = aligned_empty(self.max_gap + self._raw.align, self._raw.align).data
                iov.append(gap[: dev - pos])
            iov.append(view[at : at + span])
            pos = dev + span
        got = os.preadv(self._raw.fd(), iov, start)
        if got < pos - start:  # a short vectored read (device end or signal): redo it piece by piece
            for dev, at, span, n in run:
                self._raw.read_into(dev, view[at : at + span], n)

    def _run(self, requests: Sequence[ReadRequest], buffers: Sequence[Any], rooms: Sequence[int]) -> None:
        if len(requests) == 1 or self.threads <= 1:
            for req, buf, room in zip(requests, buffers, rooms):
                self._one(req, buf, room)
            return
        if self.coalesce <= 0:
            for fut in [self.pool.submit(self._one, *args) for args in zip(requests, buffers, rooms)]:
                fut.result()
            return
        self._run_coalesced(requests, buffers, rooms)

    def _keys(self, requests: Sequence[ReadRequest]) -> tuple[list[str], list[Future[Any]]]:
        """Keys of the requests, and the freshness checks still running for files not checked before."""
        try:
            keys = [self.bmap.key_for(r.path) for r in requests]
        except FormatError as exc:
            raise BackendError(str(exc)) from None
        self.guard.refresh(dict.fromkeys(keys))  # changed since this backend checked it: check it again
        # what the record alone says (not raw-readable, outside the device) is settled before any raw read
        unchecked = [k for k in {k: None for k in keys if k not in self._why} if self.guard.precheck(k) is None]
        if not self.guard.check_stale:
            self.guard.check_many(unchecked)
            return keys, []
        # The checks run on their own small pool, alongside the data reads: a stat of a cold inode costs
        # ~10 us of kernel CPU (inode readahead makes its I/O cheap), so more threads only contend for cores.
        self.ready_for_threads()
        assert self._stat_pool is not None
        step = max(64, len(unchecked) // self.stat_threads + 1)
        chunks = [unchecked[i : i + step] for i in range(0, len(unchecked), step)]
        for fut in [self._stat_pool.submit(self.guard.check_many, c) for c in chunks]:
            fut.result()  # no raw read before its file's check is in: a raw read must not outrun the open
        return keys, []

    def ready_for_threads(self) -> None:
        """Make the pools now, on this thread: reads from several threads at once then share them (made on first
        use by two threads at once, one pool each would be left unclosed)."""
        _ = self.pool
        if self._stat_pool is None or self._pool_pid != self._stat_pid:  # none yet, or the parent's (forked)
            self._stat_pool = ThreadPoolExecutor(self.stat_threads, thread_name_prefix="blockprep-stat")
            self._stat_pid = self._pool_pid

    def _run_coalesced(self, requests: Sequence[ReadRequest], buffers: Sequence[Any], rooms: Sequence[int]) -> None:
        """Sort the data segments of the batch by device offset and read neighbours (at most `max_gap` apart)
        as one O_DIRECT read of up to `coalesce` bytes: many small files laid out together read at the
        bandwidth of large requests. The batch is planned in slices of `_PLAN_SLICE` requests, each slice's
        reads submitted before the next is planned, so planning overlaps the reads. Filesystem-only entries
        go through the filesystem. Files whose freshness check is still running are read raw speculatively
        and re-read through the filesystem if the check finds them changed."""
        keys, checks = self._keys(requests)
        futures: list[Future[Any]] = []
        confirm: list[tuple[ReadRequest, Any, int, str]] = []
        for lo in range(0, len(requests), _PLAN_SLICE):
            pieces: list[tuple[int, int, memoryview]] = []  # (device offset, nbytes, destination)
            for i in range(lo, min(lo + _PLAN_SLICE, len(requests))):
                self._plan(keys[i], requests[i], buffers[i], rooms[i], pieces, futures, confirm)
            self._submit_runs(pieces, futures)
        for fut in [*checks, *futures]:
            fut.result()
        for req, buf, room, key in confirm:
            if self._why[key] is not None:  # changed since mapping: the raw bytes may be wrong, read it again
                self._one(req, buf, room)
            elif req.offset + req.nbytes > self.bmap.entry(key).size:
                raise short_read(req, max(0, self.bmap.entry(key).size - req.offset))

    def _plan(
        self,
        key: str,
        req: ReadRequest,
        buf: Any,
        room: int,
        pieces: list[tuple[int, int, memoryview]],
        futures: list[Future[Any]],
        confirm: list[tuple[ReadRequest, Any, int, str]],
    ) -> None:
        why = self._why.get(key, "?")  # "?": its freshness check is still running
        e = self.bmap.entry(key)
        if not e.raw_readable or why not in ("?", None):
            futures.append(self.pool.submit(self._one, req, buf, room))
            return
        if why == "?":
            confirm.append((req, buf, room, key))
        view = memoryview(buf).cast("B")
        ext = e.extents[0] if len(e.extents) == 1 else None
        if ext and ext[0] <= req.offset and req.offset + req.nbytes <= min(e.size, ext[0] + ext[2]):
            # the common case, one extent covering the range: no segment walk
            pieces.append((self.source.base + ext[1] + req.offset - ext[0], req.nbytes, view[: req.nbytes + room]))
            return
        try:
            segments = self.bmap.segments(key, req.offset, req.nbytes)
        except ValueError:
            if why == "?":  # beyond the mapped size: maybe the file grew; settled once its check is in
                return
            raise short_read(req, max(0, e.size - req.offset)) from None
        for seg in segments:
            at = seg.file_offset - req.offset
            if seg.device_offset is None:
                view[at : at + seg.nbytes] = bytes(seg.nbytes)  # a hole reads as zeros
            else:
                # only a request's last segment may spill, into padding this backend allocated
                end = req.nbytes + room if at + seg.nbytes == req.nbytes else at + seg.nbytes
                pieces.append((self.source.base + seg.device_offset, seg.nbytes, view[at:end]))

    def _submit_runs(self, pieces: list[tuple[int, int, memoryview]], futures: list[Future[Any]]) -> None:
        pieces.sort(key=lambda p: p[0])
        run: list[tuple[int, int, memoryview]] = []
        run_end = 0
        for piece in pieces:
            if run and (piece[0] > run_end + self.max_gap or piece[0] + piece[1] - run[0][0] > self.coalesce):
                futures.append(self.pool.submit(self._read_run, run))
                run = []
            run_end = max(run_end, piece[0] + piece[1]) if run else piece[0] + piece[1]
            run.append(piece)
        if run:
            futures.append(self.pool.submit(self._read_run, run))

    def _read_run(self, run: list[tuple[int, int, memoryview]]) -> None:
        if len(run) == 1:
            offset, n, dest = run[0]
            self._raw.read_into(offset, dest, n)
            return
        if self._raw.direct and self._scatter(run):
            return
        a = self._raw.align
        lo = run[0][0] - run[0][0] % a
        hi = max(o + n for o, n, _ in run)
        scratch = aligned_empty(hi - lo, a)
        self._raw.read_into(lo, scratch.data, hi - lo)
        for offset, n, dest in run:
            dest[:n] = scratch.data[offset - lo : offset - lo + n]

    def _scatter(self, run: list[tuple[int, int, memoryview]]) -> bool:
        """One preadv straight into the destinations (gaps into a throwaway buffer), when every piece starts
        aligned on the device and in memory with room for its padded end; False when it cannot (no read)."""
        a = self._raw.align
        iov: list[memoryview] = []
        gap: memoryview | None = None
        pos = start = run[0][0]
        for o, n, d in run:
            span = -(-n // a) * a
            if o % a or o < pos or len(d) < span or _address(d) % a:
                return False
            if o > pos:
                if gap is None or len(gap) < o - pos:
                    gap = aligned_empty(max(o - pos, self.max_gap), a).data
                iov.append(gap[: o - pos])
            iov.append(d[:span])
            pos = o + span
        if len(iov) > _IOV_MAX:
            return False
        got = os.preadv(self._raw.fd(), iov, start)
        last_o, last_n, _ = run[-1]
        if got < pos - start:  # a short vectored read (device end or signal): redo it the simple way
            return got >= last_o + last_n - start
        return True

    def close(self) -> None:
        super().close()
        if self._stat_pool is not None and self._stat_pid == os.getpid():
            self._stat_pool.shutdown(wait=True)
        self._stat_pool = None
        self._raw.close()
        self.guard.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_stat_pool"] = None
        state.pop("_probe", None)  # a ctypes handle: made again where it lands
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._probe = PageCacheProbe()
        self._why = self.guard.why  # one dict after unpickling too
