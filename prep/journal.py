"""Crash safety of `prep cache`: the output lock, the run's plan, and the append-only per-writer journals.

A journal line is written only after the item's tensors are fsynced in their shard, and is itself fsynced
(items are committed in groups: one shard fsync, then the group's lines, then one journal fsync), so every
parseable line describes bytes that are on stable storage. Each line carries the xxh3 of its record: a torn
last line (kill -9 mid-write), a damaged line, or a line whose shard bytes are missing is not trusted: that
item is simply prepared again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.cache import sampling
from loaders.cache.bricks import BRICKS_DIR
from loaders.cache.dtypes import dtype_name
from loaders.cache.journals import shard_size, tensors_inside, unsealed
from loaders.cache.spec import JOURNAL_DIR, PENDING, SHARD_DIR
from loaders.cache.writing import atomic_write_bytes
from loaders.opener import kind, open_to_write
from prep.errors import LockedError, UnsafeOutputError, UsageError
from prep.outdirs import OutputDirs

LOCK = ".lock"
PLAN = "plan.json"
_OUT_FIX = "remove it, or choose another --output (prep cache never writes through a link)"


class CacheLock:
    """An exclusive fcntl.flock on CACHE/.lock holding the owner's PID; released by the kernel if we die."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = Path(cache_dir) / LOCK
        self._fd = -1

    def acquire(self) -> None:
        """Take the lock or raise LockedError naming the PID that holds it."""
        try:
            fd = open_to_write(self.path, os.O_RDWR | os.O_CREAT, _OUT_FIX)  # checked before the ftruncate
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise UsageError(
                f"{self.path.parent}: cannot write here ({exc.strerror}) and the cache needs work (incomplete, "
                "stale or --force); choose a writable --output"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockedError(
                    f"{self.path.parent}: another `prep cache` (PID {holder}) is writing this cache; "
                    "wait for it to finish or choose another --output"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a waiting run)."""
        if self._fd >= 0:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CacheLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_plan(cache_dir: Path) -> dict[str, Any] | None:
    """The plan of an earlier (possibly interrupted) run, or None."""
    path = Path(cache_dir) / JOURNAL_DIR / PLAN
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a torn plan means the run never started work: nothing to protect
    return doc if isinstance(doc, dict) else None


def write_plan(cache_dir: Path, plan: dict[str, Any], dir_fd: int | None = None) -> None:
    """Record what this run prepares (fingerprint, datalist hash, ...) before any item is written. `dir_fd`:
    the journal folder's descriptor (`prep.outdirs`; else the folder is made and named by path)."""
    journal = Path(cache_dir) / JOURNAL_DIR
    if dir_fd is None:
        journal.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(journal / PLAN, json.dumps(plan, indent=1).encode(), dir_fd)


def _unsealed(raw: bytes) -> dict[str, Any] | None:
    """The record of a `prep cache` journal line (one with an item number), or None for a torn or damaged one."""
    record = unsealed(raw)
    try:
        int(record["item"])  # type: ignore[index]
    except (ValueError, KeyError, TypeError):
        return None
    return record


@dataclass
class JournalState:
    """What the journals say is finished: prepared records and quarantined items, by item number."""

    done: dict[int, dict[str, Any]]
    quarantined: dict[int, dict[str, Any]]

    @property
    def finished(self) -> set[int]:
        """Items that need no more work."""
        return set(self.done) | set(self.quarantined)

    def order(self, n_items: int) -> list[int]:
        """The prepared items of a plan of `n_items`, in the committed cache's item order."""
        return [i for i in range(n_items) if i in self.done]


def read_journals(cache_dir: Path, dirs: OutputDirs | None = None) -> JournalState:
    """Every trustworthy record of every journal. The first valid record of an item wins. `dirs`: the run's
    folders held open (journals and shards are then found relative to them, never through a swapped folder)."""
    root = Path(cache_dir)
    done: dict[int, dict[str, Any]] = {}
    quarantined: dict[int, dict[str, Any]] = {}
    shard_sizes: dict[str, int] = {}
    for data in _journal_bytes(root, dirs):
        for raw in data.splitlines():
            record = _unsealed(raw)
            if record is None:
                continue  # torn line from a killed writer, or damaged
            item = int(record["item"])
            if item in done or item in quarantined:
                continue
            if "quarantined" in record:
                quarantined[item] = record
            elif _shard_holds(root, record, shard_sizes, dirs):
                done[item] = record
    return JournalState(done, quarantined)


def _journal_bytes(root: Path, dirs: OutputDirs | None) -> Iterator[bytes]:
    """The content of each journal file, in name order (regular files only, never through a link)."""
    if dirs is None:
        for path in sorted((root / JOURNAL_DIR).glob("*.jsonl")):
            yield path.read_bytes()
        return
    folder = dirs.fd(JOURNAL_DIR)
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".jsonl")):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError:
            continue  # a link or a FIFO planted since the start-up check: no line of it is trusted
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                yield f.read()


def _shard_holds(root: Path, record: dict[str, Any], sizes: dict[str, int], dirs: OutputDirs | None) -> bool:
    shard = str(record.get("shard", ""))
    if shard not in sizes:
        if dirs is not None:
            sizes[shard] = shard_size(shard, dirs.fd(SHARD_DIR))
        else:
            try:
                sizes[shard] = (root / shard).stat().st_size
            except OSError:
                sizes[shard] = -1
    return tensors_inside(record, sizes[shard])


def check_output(cache_dir: Path) -> None:
    """Create the output folder; refuse a non-empty folder that is not a blockprep cache."""
    cache_dir = Path(cache_dir)
    if not cache_dir.parent.exists():
        raise UsageError(f"{cache_dir}: parent directory {cache_dir.parent} does not exist; create it first")
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UsageError(f"{cache_dir}: is a file, not a folder; name a new or existing cache folder as --output")
    try:
        cache_dir.mkdir(exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{cache_dir}: cannot create the cache folder ({exc.strerror}); choose a writable --output"
        ) from None
    ours = {
        LOCK,
        JOURNAL_DIR,
        "shards",
        "manifest.json",
        "index.npy",
        "meta.jsonl",
        "meta_offsets.npy",
        "bmap.json",
        PENDING,  # a pending cache the MONAI drop-in started (loaders.cache.pending): `prep cache` commits it
        sampling.DIR,
        BRICKS_DIR,  # `prep bricks` (dropped at the next commit)
        "bricks.tmp",
    }
    foreign = [p.name for p in cache_dir.iterdir() if p.name not in ours and not p.name.startswith(".")]
    if foreign:
        raise UsageError(
            f"{cache_dir}: not empty and not a blockprep cache (has {', '.join(sorted(foreign)[:3])}); "
            "choose an empty or new --output"
        )
    check_no_links(cache_dir)


_FOLDERS = (JOURNAL_DIR, "shards", sampling.DIR, BRICKS_DIR, "bricks.tmp")


def check_no_links(cache_dir: Path) -> None:
    """UnsafeOutputError for anything in the output `prep cache` would write through but did not make: a
    symlink (`.lock` -> a file elsewhere would be truncated, `shards/` -> a folder elsewhere filled), a FIFO or
    device, a folder where a file belongs or the reverse, or a file with a second name (a hard link)."""
    with os.scandir(cache_dir) as entries:
        listed = list(entries)
    for entry in listed:
        folder = entry.name in _FOLDERS
        _check_entry(Path(entry.path), folder)
        if folder and entry.is_dir(follow_symlinks=False):
            for inner, dirs, files in os.walk(entry.path):  # never follows a link (followlinks=False)
                for name in dirs:
                    _check_entry(Path(inner) / name, True)
                for name in files:
                    _check_entry(Path(inner) / name, False)


def _check_entry(path: Path, folder: bool) -> None:
    st = path.lstat()
    if folder and stat.S_ISDIR(st.st_mode):
        return
    if not folder and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return
    what = f"a file with {st.st_nlink} names (a hard link)" if stat.S_ISREG(st.st_mode) else kind(st.st_mode)
    raise UnsafeOutputError(f"{path}: is {what} that `prep cache` did not make, where it writes a "
                            f"{'folder' if folder else 'file'}; refused; {_OUT_FIX}")  # fmt: skip


def committed_records(cache_dir: Path, positions: list[int | None]) -> list[dict[str, Any]] | None:
    """Journal records of a committed cache's items (item n is datalist position `positions[n]`; None: left
    out), so a run that prepares its quarantined or new items commits the others untouched; None when the
    cache is not as `prep cache` writes it (each item's tensors in one shard)."""
    from loaders.cache.format import PreparedCache

    cache = PreparedCache(cache_dir)
    if len(positions) != cache.n_items:
        return None
    names = {str(p): name for p, name in zip(cache.shards, cache.manifest["shards"])}
    records = []
    for n, position in enumerate(positions):
        if position is None:
            continue
        entries = cache.entries(n)
        shards = {e.shard for e in entries}
        if len(shards) != 1:
            return None
        tensors = [{"key": e.key, "offset": e.offset, "nbytes": e.nbytes, "dtype": dtype_name(e.dtype),
                    "shape": list(e.shape), "xxh3": e.xxh3} for e in entries]  # fmt: skip
        records.append({"item": position, "shard": names[shards.pop()], "tensors": tensors, "meta": cache.meta(n)})
    return records
