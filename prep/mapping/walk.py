"""`prep bmap`: walk a tree, map every regular file with FIEMAP, write bmap.json (or the flat seed form).

The walk runs on the calling thread; files are mapped in batches on a thread pool (the FIEMAP ioctl and
open/fstat release the GIL). Nothing is written until every file is mapped: the document goes to a temp
file that is renamed over the output, so a failed walk never replaces a good map. The document format
and its checksum are defined once, in `loaders.blockmap.bmap`.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import itertools
import json
import multiprocessing
import os
import re
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps's own (C) key quoting
from pathlib import Path
from typing import Any

from loaders.blockmap.bmap import BMAP_FORMAT, BMAP_VERSION, EXTENT_FIELDS, encode_document_with_files
from loaders.blockmap.fiemap import EXTENT_FLAGS, FS_IOC_FIEMAP, SAFE_FLAGS, FiemapReader, unsafe_reasons
from loaders.cache.format import checksum
from loaders.cache.writing import atomic_write_bytes
from prep.devices import DeviceInfo, check_mappable, device_info
from prep.errors import UsageError
from prep.mapping.seed import skipped_path, write_seed

FORMATS = ("full", "seed")
_BATCH = 256  # files per pool task: amortises task overhead, small enough for a smooth progress bar
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
PROCESS_MIN_FILES = 20_000  # trees at least this large are mapped by worker processes, smaller by threads


@dataclass
class BmapSummary:
    """What a `build_bmap` run did."""

    output: Path
    fmt: str
    files: int = 0  # regular files mapped
    bytes: int = 0
    extents: int = 0
    raw_readable: int = 0  # files a raw reader may use (in the seed format: files written to the seed)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> files not raw-readable (or not in the seed)
    seconds: float = 0.0
    skipped_path: Path | None = None  # seed format: the side file listing skipped files with reasons
    vanished: list[str] = field(default_factory=list)  # keys deleted between listing and mapping: left out

    @property
    def files_per_s(self) -> float:
        """Mapping rate."""
        return self.files / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        skipped = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())) or "none"
        return (
            f"{self.files} files, {self.bytes} bytes, {self.extents} extents; "
            f"{self.raw_readable} raw-readable; skipped: {skipped}; "
            f"{self.files_per_s:,.0f} files/s -> {self.output}"
        )

    def warning(self) -> str | None:
        """The line to show when files vanished while the tree was mapped (else None)."""
        if not self.vanished:
            return None
        n = len(self.vanished)
        return (
            f"{n} file(s) deleted while the tree was mapped, left out of the map (first: {self.vanished[0]}); "
            "re-run `prep bmap` once the tree is settled if they come back"
        )


def _matcher(globs: Sequence[str]) -> Callable[[str], bool] | None:
    if not globs:
        return None
    rx = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))
    return lambda rel: rx.match(rel) is not None or rx.match(os.path.basename(rel)) is not None


def _listing(
    root: Path, include: Sequence[str] = (), exclude: Sequence[str] = (), skip: Collection[str] = ()
) -> Iterator[tuple[str, list[str]]]:
    """(relative folder, sorted names of up to _BATCH regular files in it) for every selected file under
    `root`, depth-first. Types come from the directory entries (no stat per file): only folders are stat()ed,
    to stay on `root`'s filesystem. A folder that cannot be listed raises UsageError."""
    inc, exc = _matcher(include), _matcher(exclude)
    root_dev = os.stat(root).st_dev
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        full = os.path.join(root, rel_dir) if rel_dir else os.fspath(root)
        names: list[str] = []
        subdirs: list[str] = []
        try:
            with os.scandir(full) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):  # d_type: symlinks, fifos, devices left out
                        names.append(entry.name)
        except OSError as err:
            # lost+found: fsck's root-only folder on ext4, never data; ENOENT: removed after it was listed
            if os.path.basename(full) == "lost+found" or err.errno == errno.ENOENT:
                continue
            raise UsageError(f"{full}: cannot list ({err.strerror}); fix its permissions or --exclude it") from None
        prefix = rel_dir + "/" if rel_dir else ""
        if inc or exc or skip:
            names = [n for n in names if prefix + n not in skip and _selected(prefix + n, inc, exc)]
        names.sort()
        for i in range(0, len(names), _BATCH):
            yield rel_dir, names[i : i + _BATCH]
        keep = []
        for name in sorted(subdirs, reverse=True):  # popped in name order
            rel = prefix + name
            # another filesystem mounted here has its own device: its addresses would be wrong in this map
            if not (exc and exc(rel)) and _same_device(os.path.join(full, name), root_dev):
                keep.append(rel)
        stack.extend(keep)


def _same_device(path: str, dev: int) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_dev == dev
    except FileNotFoundError:  # removed after it was listed
        return False


def walk(
    root: Path, include: Sequence[str] = (), exclude: Sequence[str] = (), skip: Collection[str] = ()
) -> Iterator[str]:
    """Relative paths of the regular files under `root` (symlinks not followed, other filesystems mounted
    inside not entered), filtered by globs that match the relative path or the file name; a directory that
    cannot be listed raises UsageError."""
    for rel_dir, names in _listing(root, include, exclude, skip):
        prefix = rel_dir + "/" if rel_dir else ""
        yield from (prefix + n for n in names)


def _selected(rel: str, inc: Callable[[str], bool] | None, exc: Callable[[str], bool] | None) -> bool:
    return (inc is None or inc(rel)) and not (exc and exc(rel))


def classify(extents: Sequence[Sequence[int]], size: int) -> str | None:
    """Why the file must not be read raw (comma-joined reasons), or None. Only extents that hold file bytes
    count: an unwritten preallocation beyond EOF is harmless."""
    seen = 0
    for e in extents:
        if e[0] < size:
            seen |= e[3]
    if not seen & ~SAFE_FLAGS:  # the common case: one plain extent
        return None
    reasons = sorted({r for e in extents if e[0] < size for r in unsafe_reasons(e[3])})
    return ",".join(reasons) or None


def record_json(
    size: int,
    inode: int,
    mtime_ns: int,
    extents: Sequence[Sequence[int]],
    xxh3: int | None = None,
    ctime_ns: int | None = None,
) -> str:
    """One file's record as canonical JSON (sorted keys, no spaces: exactly `json.dumps(record, sort_keys=True,
    separators=(",", ":"))`), formatted directly: a million-file map is a million of these."""
    return _record(size, inode, mtime_ns, extents, classify(extents, size), xxh3, ctime_ns)


def _record(
    size: int,
    inode: int,
    mtime_ns: int,
    extents: Sequence[Sequence[int]],
    reason: str | None,
    xxh3: int | None,
    ctime_ns: int | None = None,
) -> str:
    if len(extents) == 1:
        lo, ph, n, fl = extents[0]
        ext = f"[[{lo},{ph},{n},{fl}]]"
    else:
        ext = "[" + ",".join(f"[{e[0]},{e[1]},{e[2]},{e[3]}]" for e in extents) + "]"
    tail = "" if xxh3 is None else f',"xxh3":{xxh3}'
    lead = "{" if ctime_ns is None else f'{{"ctime_ns":{ctime_ns},'  # ctime: a rewrite with mtime restored shows
    head = f'{lead}"extents":{ext},"inode":{inode},"mtime_ns":{mtime_ns},'
    if reason is None:
        return f'{head}"raw_readable":true,"reason":null,"size":{size}{tail}}}'
    return f'{head}"raw_readable":false,"reason":{_json_str(reason)},"size":{size}{tail}}}'


@dataclass
class _Mapped:
    """What mapping some files gave: keys with their records' JSON, totals, and files that could not be opened."""

    keys: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    bytes: int = 0
    extents: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    denied: list[tuple[str, str]] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)  # listed, then gone before it was opened (deleted)
    # (first key, last key, '"key":record,...') per task, joined where the files were mapped: the parent of
    # worker processes only orders the pieces (see _ordered)
    pieces: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, other: _Mapped) -> None:
        self.keys += other.keys
        self.records += other.records
        self.pieces += other.pieces
        self.bytes += other.bytes
        self.extents += other.extents
        self.skipped.update(other.skipped)
        self.denied += other.denied
        self.vanished += other.vanished


_readers = threading.local()  # one FiemapReader (one ioctl buffer) per thread, in each worker process


def _map_names(root: str, rel_dir: str, names: list[str], checksums: bool, root_dev: int) -> _Mapped:
    """Map files `names` of folder `rel_dir`: opened relative to the folder's descriptor (no path walk per
    file), one fstat, FIEMAP (one ioctl for a file of one extent), the record formatted as JSON here, so a
    worker process sends back strings, not objects."""
    out = _Mapped()
    prefix = rel_dir + "/" if rel_dir else ""
    extents_of = _reader()
    dfd = _open_folder(os.path.join(root, rel_dir), names, prefix, out)
    if dfd is None:
        return out
    open_, fstat, close, isreg, classify_ = os.open, os.fstat, os.close, stat.S_ISREG, classify
    buf, head, ioctl, first = extents_of.buffer, extents_of.header, fcntl.ioctl, extents_of.unpack_first
    keys, records = out.keys, out.records
    nbytes = nextents = 0
    unsafe = ~SAFE_FLAGS
    try:
        for name in names:
            try:
                fd = open_(name, _OPEN_FLAGS, dir_fd=dfd)
            except OSError as err:
                if err.errno == errno.ENOENT:  # deleted after it was listed: not part of the tree any more
                    out.vanished.append(prefix + name)
                else:
                    out.denied.append((prefix + name, err.strerror or "?"))
                continue
            try:
                st = fstat(fd)
                if not isreg(st.st_mode) or st.st_dev != root_dev:  # replaced since listed, or a bind mount
                    continue
                # FiemapReader's fast path inlined (one ioctl, one unpack): this loop is the mapping rate
                buf[:32] = head
                try:
                    ioctl(fd, FS_IOC_FIEMAP, buf, True)
                except OSError:
                    ext = extents_of(fd, name)  # raises the explanatory error (or pages on a retry)
                else:
                    mapped, lo, ph, ln, fl = first(buf)
                    ext = [(lo, ph, ln, fl)] if mapped == 1 and fl & 1 else extents_of(fd, name) if mapped else []
                xxh3 = None
                if checksums:
                    with os.fdopen(os.dup(fd), "rb") as f:
                        xxh3 = checksum(f.read())
                size = st.st_size
                # one plain extent: nothing to classify (classify's own first test, without the call)
                reason = None if len(ext) == 1 and not ext[0][3] & unsafe else classify_(ext, size)
                records.append(_record(size, st.st_ino, st.st_mtime_ns, ext, reason, xxh3, st.st_ctime_ns))
            finally:
                close(fd)
            keys.append(prefix + name)
            nbytes += size
            nextents += len(ext)
            if reason is not None:
                out.skipped[reason] += 1
    finally:
        close(dfd)
    out.bytes, out.extents = nbytes, nextents
    out.pieces = _pieces(keys, records)
    return out


def _reader() -> FiemapReader:
    """This thread's FiemapReader, made on its first use."""
    extents_of = getattr(_readers, "fiemap", None) or FiemapReader()
    _readers.fiemap = extents_of
    return extents_of


def _open_folder(path: str, names: list[str], prefix: str, out: _Mapped) -> int | None:
    """A descriptor of folder `path`, or None with its files `names` noted in `out` as vanished or denied."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENOENT:  # the folder was removed after it was listed
            out.vanished = [prefix + n for n in names]
        else:
            out.denied = [(prefix + n, err.strerror or "?") for n in names]
        return None


def _pieces(keys: list[str], records: list[str]) -> list[tuple[str, str, str]]:
    """A task's piece of the map: (first key, last key, its '"key":record,...' JSON), none for no key."""
    if not keys:
        return []
    # names come sorted from the listing, so the piece's keys are in order
    return [(keys[0], keys[-1], ",".join([f"{_json_str(k)}:{r}" for k, r in zip(keys, records)]))]


def _tasks(
    listing: Iterator[tuple[str, list[str]]],
) -> tuple[list[tuple[str, list[str]]], Iterator[tuple[str, list[str]]], bool]:
    """The first tasks of a listing (up to PROCESS_MIN_FILES files), the rest, and whether the tree is large."""
    head: list[tuple[str, list[str]]] = []
    n = 0
    for task in listing:
        head.append(task)
        n += len(task[1])
        if n >= PROCESS_MIN_FILES:
            return head, listing, True
    return head, iter(()), False


def _map_all(
    root: Path,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    workers: int = 4,
    checksums: bool = False,
    skip: Collection[str] = (),
    progress: Callable[[int], None] | None = None,
) -> _Mapped:
    """Map every selected file under `root` (records as JSON, keys sorted); unreadable files raise UsageError."""
    root_s = os.fspath(root)
    root_dev = os.stat(root).st_dev
    head, rest, large = _tasks(_listing(root, include, exclude, skip))
    total = _Mapped()

    def collect(part: _Mapped) -> None:
        total.add(part)
        if progress is not None:
            progress(len(part.keys) + len(part.denied) + len(part.vanished))

    if workers <= 1:
        for rel_dir, names in itertools.chain(head, rest):
            collect(_map_names(root_s, rel_dir, names, checksums, root_dev))
    else:
        with _executor(workers, large) as pool:
            pending: deque[Future[_Mapped]] = deque()
            for rel_dir, names in itertools.chain(head, rest):
                pending.append(pool.submit(_map_names, root_s, rel_dir, names, checksums, root_dev))
                if len(pending) >= 4 * workers:  # bounded: the listing does not run far ahead of the mapping
                    collect(pending.popleft().result())
            for fut in pending:
                collect(fut.result())
    if total.denied:
        rel, why = total.denied[0]
        raise UsageError(
            f"{root_s}/{rel}: cannot open ({why}); {len(total.denied)} file(s) unreadable, no map written; "
            "run as a user who can read them or --exclude them"
        )
    return _ordered(total)


def _ordered(m: _Mapped) -> _Mapped:
    """Pieces in json.dumps(sort_keys=True)'s order. Pieces (one folder's files each) are ordered as wholes
    when their key ranges do not interleave (a folder's files and its subfolders' can); else file by file."""
    m.pieces.sort()
    if any(a[1] >= b[0] for a, b in zip(m.pieces, m.pieces[1:])):
        order = sorted(range(len(m.keys)), key=m.keys.__getitem__)
        m.keys = [m.keys[i] for i in order]
        m.records = [m.records[i] for i in order]
        m.pieces = [("", "", ",".join([f"{_json_str(k)}:{r}" for k, r in zip(m.keys, m.records)]))]
    return m


def map_tree(
    root: Path,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    workers: int = 4,
    checksums: bool = False,
    skip: Collection[str] = (),
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Map every selected file under `root`: key -> record. Unreadable files raise UsageError (nothing partial)."""
    m = _map_all(
        root, include=include, exclude=exclude, workers=workers, checksums=checksums, skip=skip, progress=progress
    )
    return json.loads(files_json(m))  # type: ignore[no-any-return]


def files_json(m: _Mapped) -> str:
    """The "files" object of the document, canonical JSON, from the ordered pieces (see `_ordered`)."""
    return "{" + ",".join([p[2] for p in m.pieces]) + "}"


def _executor(workers: int, large: bool) -> Executor:
    # Per file the work is a few us of Python around four short syscalls: threads mostly wait for the GIL.
    # Large trees go to forked processes, but only from a single-threaded caller (forking a process that
    # runs threads can deadlock the child); spawn/forkserver would re-run an unguarded user __main__.
    if large and threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(workers, thread_name_prefix="bmap")


def resolve_device(root: Path, require_mountpoint: bool) -> DeviceInfo:
    """Check `root` and describe its device; UsageError / UnsupportedFilesystemError with the fix."""
    if not root.exists():
        raise UsageError(f"{root}: no such directory; pass an existing mountpoint")
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory; pass the mountpoint of the filesystem to map")
    if require_mountpoint and not os.path.ismount(root):
        raise UsageError(f"{root}: not a mountpoint; pass the directory the filesystem is mounted on")
    info = device_info(root)
    check_mappable(info)
    return info


def header(root: Path, info: DeviceInfo) -> dict[str, Any]:
    """The per-map part of a bmap document."""
    return {
        "format": BMAP_FORMAT,
        "version": BMAP_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "root": os.fspath(root),
        "mountpoint": info.mountpoint,
        "device": info.device,
        "disk": info.disk,
        "major": info.major,
        "minor": info.minor,
        "partition_start": info.partition_start,
        "logical_block_size": info.logical_block_size,
        "fs_block_size": info.fs_block_size,
        "fstype": info.fstype,
        "uuid": info.uuid,
        "loop": {"backing_file": info.loop_backing_file, "offset": info.loop_offset}
        if info.loop_backing_file
        else None,
        "extent_fields": list(EXTENT_FIELDS),
        "flag_bits": dict(EXTENT_FLAGS),
    }


def build_bmap(
    root: Path,
    output: Path,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    workers: int = 4,
    fmt: str = "full",
    require_mountpoint: bool = True,
    progress: Callable[[int], None] | None = None,
    checksums: bool = False,
) -> BmapSummary:
    """Map every regular file under `root` and write `output` (fmt "full": bmap.json; "seed": the flat LBA form
    plus `<output>.skipped.json`). Keys are relative to `root`. Raises UnsupportedFilesystemError when the
    filesystem cannot be mapped, UsageError on bad arguments or unreadable files; writes nothing then."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if workers < 1:
        raise UsageError(f"workers must be at least 1 (got {workers})")
    root, output = Path(os.path.abspath(root)), Path(os.path.abspath(output))
    if not output.parent.is_dir():
        raise UsageError(f"{output}: parent directory {output.parent} does not exist; create it first")
    info = resolve_device(root, require_mountpoint)
    t0 = time.perf_counter()
    # the map (and the seed's side file) may live inside the tree: never map them
    own = {os.path.relpath(p, root) for p in (output, skipped_path(output))}
    mapped = _map_all(
        root,
        include=include,
        exclude=exclude,
        workers=workers,
        checksums=checksums,
        skip={p for p in own if not p.startswith("..")},
        progress=progress,
    )
    n = len(mapped.keys)
    summary = BmapSummary(output, fmt, files=n, bytes=mapped.bytes, extents=mapped.extents)
    summary.vanished = sorted(mapped.vanished)
    data = encode_document_with_files(header(root, info), files_json(mapped))
    try:
        if fmt == "full":
            atomic_write_bytes(output, data)
            summary.skipped = dict(mapped.skipped)
            summary.raw_readable = n - sum(mapped.skipped.values())
        else:
            summary.raw_readable, skipped = write_seed(json.loads(data), output)
            summary.skipped = dict(Counter(skipped.values()))
            summary.skipped_path = skipped_path(output)
    except OSError as err:
        raise UsageError(f"{output}: cannot write ({err.strerror}); pick a writable --output") from None
    summary.seconds = time.perf_counter() - t0
    return summary
