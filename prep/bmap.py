"""`prep bmap`: walk a tree, map every regular file with FIEMAP, write bmap.json (or the flat seed form).

The walk runs on the calling thread; files are mapped in batches on a thread pool (the FIEMAP ioctl and
open/fstat release the GIL). Nothing is written until every file is mapped: the document goes to a temp
file that is renamed over the output, so a failed walk never replaces a good map. The document format
and its checksum are defined once, in `loaders.bmap`.
"""

from __future__ import annotations

import fnmatch
import itertools
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
from pathlib import Path
from typing import Any

from loaders.bmap import BMAP_FORMAT, BMAP_VERSION, EXTENT_FIELDS, BlockMap, encode_document
from loaders.format import atomic_write_bytes, checksum
from prep.devices import DeviceInfo, check_mappable, device_info
from prep.errors import PrepError, UsageError
from prep.fiemap import EXTENT_FLAGS, SAFE_FLAGS, Extent, FiemapReader, merge_adjacent, unsafe_reasons

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


def _matcher(globs: Sequence[str]) -> Callable[[str], bool] | None:
    if not globs:
        return None
    rx = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))
    return lambda rel: rx.match(rel) is not None or rx.match(os.path.basename(rel)) is not None


def walk(
    root: Path, include: Sequence[str] = (), exclude: Sequence[str] = (), skip: Collection[str] = ()
) -> Iterator[str]:
    """Relative paths of the regular files under `root` (symlinks not followed, other filesystems mounted
    inside not entered), filtered by globs that match the relative path or the file name; a directory that
    cannot be listed raises UsageError."""
    inc, exc = _matcher(include), _matcher(exclude)
    root_dev = os.stat(root).st_dev
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        full = os.path.join(root, rel_dir) if rel_dir else os.fspath(root)
        try:
            with os.scandir(full) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            if os.path.basename(full) == "lost+found":  # fsck's root-only folder on ext4: never data
                continue
            raise UsageError(f"{full}: cannot list ({err.strerror}); fix its permissions or --exclude it") from None
        subdirs = []
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_dir(follow_symlinks=False):
                # another filesystem mounted here has its own device: its addresses would be wrong in this map
                if not (exc and exc(rel)) and entry.stat(follow_symlinks=False).st_dev == root_dev:
                    subdirs.append(rel)
            elif entry.is_file(follow_symlinks=False) and rel not in skip and _selected(rel, inc, exc):
                yield rel
        stack.extend(reversed(subdirs))  # popped in name order: keys come out sorted depth-first


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


def _map_batch(
    root: str, rels: list[str], checksums: bool, root_dev: int
) -> list[tuple[str, dict[str, Any] | None, str | None]]:
    out: list[tuple[str, dict[str, Any] | None, str | None]] = []
    extents_of = FiemapReader()
    for rel in rels:
        path = root + "/" + rel
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as err:
            out.append((rel, None, err.strerror))
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != root_dev:  # replaced since listed, or a bind mount
                continue
            extents = extents_of(fd, path)
            reason = classify(extents, st.st_size)
            rec: dict[str, Any] = {
                "size": st.st_size,
                "inode": st.st_ino,
                "mtime_ns": st.st_mtime_ns,
                "extents": extents,  # JSON arrays [logical, physical, length, flags]
                "reason": reason,
                "raw_readable": reason is None,
            }
            if checksums:
                with os.fdopen(os.dup(fd), "rb") as f:
                    rec["xxh3"] = checksum(f.read())
            out.append((rel, rec, None))
        finally:
            os.close(fd)
    return out


def _batches(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for rel in it:
        batch.append(rel)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


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
    files: dict[str, dict[str, Any]] = {}
    denied: list[tuple[str, str]] = []
    root_s = os.fspath(root)
    root_dev = os.stat(root).st_dev
    listed = walk(root, include, exclude, skip)
    head = list(itertools.islice(listed, PROCESS_MIN_FILES))
    batches = _batches(itertools.chain(head, listed), _BATCH)
    if workers <= 1:
        for batch in batches:
            _collect(_map_batch(root_s, batch, checksums, root_dev), files, denied, progress)
    else:
        with _executor(workers, large=len(head) == PROCESS_MIN_FILES) as pool:
            pending: deque[Future[list[tuple[str, dict[str, Any] | None, str | None]]]] = deque()
            for batch in batches:
                pending.append(pool.submit(_map_batch, root_s, batch, checksums, root_dev))
                if len(pending) >= 4 * workers:  # bounded: the walk does not run far ahead of the mapping
                    _collect(pending.popleft().result(), files, denied, progress)
            for fut in pending:
                _collect(fut.result(), files, denied, progress)
    if denied:
        rel, why = denied[0]
        raise UsageError(
            f"{root_s}/{rel}: cannot open ({why}); {len(denied)} file(s) unreadable, no map written; "
            "run as a user who can read them or --exclude them"
        )
    return files


def _executor(workers: int, large: bool) -> Executor:
    # Per file the work is ~10 us of Python around three short syscalls: threads mostly wait for the GIL.
    # Large trees go to forked processes, but only from a single-threaded caller (forking a process that
    # runs threads can deadlock the child); spawn/forkserver would re-run an unguarded user __main__.
    if large and threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(workers, thread_name_prefix="bmap")


def _collect(
    results: list[tuple[str, dict[str, Any] | None, str | None]],
    files: dict[str, dict[str, Any]],
    denied: list[tuple[str, str]],
    progress: Callable[[int], None] | None,
) -> None:
    for rel, rec, err in results:
        if rec is not None:
            files[rel] = rec
        elif err is not None:
            denied.append((rel, err))
    if progress is not None:
        progress(len(results))


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


def seed_entry(rec: dict[str, Any], partition_start: int, block: int) -> tuple[dict[str, int] | None, str | None]:
    """The flat seed entry {"startblock": S, "endblock": E} (whole-disk LBAs, E inclusive) of a mapped file,
    or (None, reason) when the file is not one contiguous raw-readable run."""
    size = rec["size"]
    if not rec["raw_readable"]:
        return None, rec["reason"]
    if size == 0:
        return None, "empty"
    live = [Extent(*e) for e in rec["extents"] if e[0] < size]
    if not live:
        return None, "hole"  # all sparse: nothing on the device to point at
    runs = merge_adjacent(live)
    if runs[0].logical != 0 or runs[0].length < size:
        return None, "hole" if len(runs) == 1 or runs[0].logical != 0 else "fragmented"
    start = partition_start + runs[0].physical
    if start % block:
        return None, "not_aligned"
    return {"startblock": start // block, "endblock": -(-(start + size) // block) - 1}, None


def seed_document(doc: dict[str, Any]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Seed entries and skipped files (key -> reason) of a full bmap document."""
    seed: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    for key, rec in doc["files"].items():
        entry, why = seed_entry(rec, int(doc["partition_start"]), int(doc["logical_block_size"]))
        if entry is None:
            skipped[key] = why or "?"
        else:
            seed[key] = entry
    return seed, skipped


def skipped_path(output: Path) -> Path:
    """The side file next to a seed map listing the files left out, with reasons."""
    return output.with_name(output.name.removesuffix(".json") + ".skipped.json")


def write_seed(doc: dict[str, Any], output: Path) -> tuple[int, dict[str, str]]:
    """Write the seed form of `doc` to `output` and its skipped list beside it (both atomic)."""
    import json

    seed, skipped = seed_document(doc)
    atomic_write_bytes(skipped_path(output), json.dumps(skipped, indent=1, sort_keys=True).encode() + b"\n")
    atomic_write_bytes(output, json.dumps(seed, separators=(",", ":")).encode() + b"\n")
    return len(seed), skipped


def seed_from_bmap(bmap_path: Path, output: Path) -> tuple[int, dict[str, str]]:
    """Convert an existing bmap.json to the seed form without walking again: (files written, skipped)."""
    return write_seed(BlockMap.load(bmap_path).doc, output)


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
    files = map_tree(
        root,
        include=include,
        exclude=exclude,
        workers=workers,
        checksums=checksums,
        skip={p for p in own if not p.startswith("..")},
        progress=progress,
    )
    doc = header(root, info) | {"files": files}
    summary = BmapSummary(
        output,
        fmt,
        files=len(files),
        bytes=sum(r["size"] for r in files.values()),
        extents=sum(len(r["extents"]) for r in files.values()),
    )
    try:
        if fmt == "full":
            atomic_write_bytes(output, encode_document(doc))
            summary.skipped = dict(Counter(r["reason"] for r in files.values() if r["reason"]))
            summary.raw_readable = sum(r["raw_readable"] for r in files.values())
        else:
            summary.raw_readable, skipped = write_seed(doc, output)
            summary.skipped = dict(Counter(skipped.values()))
            summary.skipped_path = skipped_path(output)
    except OSError as err:
        raise UsageError(f"{output}: cannot write ({err.strerror}); pick a writable --output") from None
    summary.seconds = time.perf_counter() - t0
    return summary


@dataclass(frozen=True)
class Mismatch:
    """A mapped range whose raw bytes differ from the filesystem's (or a file that changed since mapping)."""

    key: str
    path: str
    extent: int | None  # index into the entry's extents; None for whole-file problems
    logical: int
    physical: int
    nbytes: int
    detail: str

    def __str__(self) -> str:
        where = f"extent {self.extent} (file byte {self.logical}, device byte {self.physical}, {self.nbytes} bytes)"
        return f"{self.path}: {where if self.extent is not None else 'file'}: {self.detail}"


_VERIFY_CHUNK = 8 << 20  # long extents are compared in pieces to bound memory


def _verify_entry(bmap: BlockMap, raw: Any, base: int, key: str) -> list[Mismatch]:
    from loaders.backends.blockdev import aligned_empty

    e = bmap.entry(key)
    path = bmap.file_path(key)
    stale = bmap.stale_reason(key)
    if stale:
        return [Mismatch(key, path, None, 0, 0, e.size, f"changed since it was mapped ({stale})")]
    out: list[Mismatch] = []
    with open(path, "rb", buffering=0) as f:
        for i, (logical, physical, length, _flags) in enumerate(e.extents):
            end = min(logical + length, e.size)
            for lo in range(logical, end, _VERIFY_CHUNK):
                n = min(_VERIFY_CHUNK, end - lo)
                dev = aligned_empty(n)[:n]
                raw.read_into(base + physical + (lo - logical), dev.data)
                fs = os.pread(f.fileno(), n, lo)
                if bytes(dev) != fs:
                    at = next(j for j in range(min(n, len(fs))) if dev[j] != fs[j]) if len(fs) == n else len(fs)
                    out.append(Mismatch(key, path, i, logical, physical, length, f"differs at file byte {lo + at}"))
                    break
        if e.xxh3 is not None and not out and checksum(f.read()) != e.xxh3:
            out.append(Mismatch(key, path, None, 0, 0, e.size, "content differs from the checksum stored at mapping"))
    return out


def verify_bmap(
    bmap_path: Path,
    device: Path | None = None,
    *,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[Mismatch]:
    """Read every mapped range of every raw-readable file from the raw device (or the loop image file) and
    compare with a read through the filesystem; returns the mismatches ([] when the map is right)."""
    from loaders.backends.blockdev import RawDevice

    bmap = BlockMap.load(bmap_path)
    src = bmap.source(device)
    if bmap.uuid:
        from prep.devices import superblock_uuid

        found = superblock_uuid(src.path, src.base)
        if found and found != bmap.uuid:
            raise UsageError(f"{src.path}: holds filesystem {found}, but {bmap_path} maps {bmap.uuid}; wrong device")
    raw = RawDevice(src.path)
    keys = [k for k in bmap.files if bmap.files[k]["raw_readable"]]
    mismatches: list[Mismatch] = []
    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            for found_mm in pool.map(lambda k: _verify_entry(bmap, raw, src.base, k), keys):
                mismatches.extend(found_mm)
                if progress is not None:
                    progress(1)
    except OSError as err:
        raise PrepError(f"{src.path}: read failed ({err.strerror}); check the device") from None
    finally:
        raw.close()
    return mismatches
