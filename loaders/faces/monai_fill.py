"""The drop-in's own writes into its prepared cache: an entry the cache lacks, once computed, is written as
`prep cache`'s workers write an item (`loaders.cache.journals`: its tensors into a shard, fsynced, then one
sealed journal line), so later reads, other `DataLoader` workers and DDP ranks, and the next `prep cache` run
(`prep.cache_plan.regrow`) find it instead of computing it again.

Each process writes its own files, created with O_EXCL and named for the host, the process and a random token:
`journal/fill-<host>-<pid>-<token>.fill` (records keyed by the entry, `loaders.cache.meta.entry_key`, not by a
plan position, so `prep cache`'s own journal reader passes them by) and `shards/fill-<host>-<pid>-<token>.bin`.
Nothing of the committed cache is written. A process that cannot write (a read-only folder, a full disk) warns
once and goes on computing such items at each read, as before.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.checksums import checksum
from loaders.cache.dtypes import DTYPES, dtype_code, np_dtype, torch_dtype
from loaders.cache.journals import JournalWriter, tensors_inside, unsealed, write_tensors
from loaders.cache.meta import check_line, meta_line, split_output
from loaders.cache.spec import JOURNAL_DIR, MAX_NDIM, SHARD_DIR
from loaders.cache.writing import ShardWriter
from loaders.errors import PrepError
from loaders.opener import folder_to_write, open_to_write, opened_in, read_fd

__all__ = ["FILL_PREFIX", "FILL_SUFFIX", "Fill", "fill_records"]

FILL_PREFIX = "fill-"
FILL_SUFFIX = ".fill"  # not ".jsonl": `prep cache`'s journal reader reads only its own workers' journals
MAX_FILL_JOURNAL = 256 << 20  # bytes of one drop-in journal read (a line per item: far more than any datalist)
MAX_FILL_FILES = 4096  # drop-in journals scanned (one per writing process); entries of any others are computed
_FIX = "remove it (the drop-in never writes through a link); `prep cache --force` rebuilds the cache"


def _shape_ok(t: Any) -> bool:
    """A record's tensor whose dtype, shape and size agree (what a reader allocates is what its shard holds)."""
    if not isinstance(t, dict) or t.get("dtype") not in DTYPES or not isinstance(t.get("key"), str):
        return False
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(isinstance(s, int) and s >= 0 for s in shape):
        return False
    count = 1
    for s in shape:
        count *= s
    return bool(count * np_dtype(t["dtype"]).itemsize == t.get("nbytes")) and isinstance(t.get("xxh3"), int)


def _well_formed(record: dict[str, Any], fingerprint: str) -> bool:
    """A drop-in record of this head with tensors and a meta line readers can take apart."""
    line = record.get("meta")
    return (
        isinstance(record.get("entry"), str)
        and record.get("fingerprint") == fingerprint
        and isinstance(record.get("tensors"), list)
        and all(_shape_ok(t) for t in record["tensors"])
        and isinstance(line, dict)
        and check_line(line) is None
    )


class _Scan:
    """What has been read of each drop-in journal of a cache: (inode, bytes read) by name, records by entry."""

    def __init__(self) -> None:
        self.read: dict[str, tuple[int, int]] = {}
        self.records: dict[str, dict[str, Any]] = {}

    def more(self, root: Path, fingerprint: str) -> None:
        """Read the lines appended since the last scan (whole lines only), keeping the first valid record of
        each entry; files that are links, FIFOs or over MAX_FILL_JOURNAL bytes are passed by."""
        try:
            folder = os.open(root / JOURNAL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # no journal folder (yet), or a link: nothing to trust
        try:
            names = sorted(n for n in os.listdir(folder) if n.startswith(FILL_PREFIX) and n.endswith(FILL_SUFFIX))
            for name in names[:MAX_FILL_FILES]:
                self._file(folder, name, fingerprint)
        finally:
            os.close(folder)

    def _file(self, folder: int, name: str, fingerprint: str) -> None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            ino, done = self.read.get(name, (st.st_ino, 0))
            if ino != st.st_ino:
                done = 0  # another file by that name now
            end = min(st.st_size, MAX_FILL_JOURNAL)
            if not stat.S_ISREG(st.st_mode) or end <= done:
                return
            data = os.pread(fd, end - done, done)
        finally:
            os.close(fd)
        whole = data.rfind(b"\n") + 1  # a line still being written is read at a later scan
        self.read[name] = (st.st_ino, done + whole)
        for raw in data[:whole].splitlines():
            record = unsealed(raw)
            if record is not None and _well_formed(record, fingerprint):
                self.records.setdefault(record["entry"], record)


class Fill:
    """The drop-in journals of one prepared cache, as seen and written by this process.

    root: the cache folder. fingerprint: its head's (records of another head are never used). section: the
    datalist section a record's meta line names (the cache's first section: `prep cache` matches records to
    its datalist by section and entry). writes: False where the folder cannot take them (said once already by
    the caller): items are computed at each read, in every process."""

    writes = True  # objects unpickled from before this existed

    def __init__(self, root: Path, fingerprint: str, section: str, writes: bool = True) -> None:
        self.root, self.fingerprint, self.section, self.writes = Path(root), fingerprint, section, writes
        self._scan = _Scan()
        self._new_state()

    def _new_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._journal: JournalWriter | None = None
        self._shard: ShardWriter | None = None
        self._rel = ""
        self._dirs: list[int] = []  # the journal and shard folders' descriptors, while files are open
        self._off = not self.writes  # writing failed here once (said in a warning): this process writes no more

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its files and lock: a spawned worker writes files of its own."""
        return {k: v for k, v in self.__dict__.items() if k in ("root", "fingerprint", "section", "writes", "_scan")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_state()

    def find(self, key: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """({flat key: host tensor}, meta line) of the entry `key` from a trusted drop-in record (this process's
        or another's: the journals are scanned again on a miss), or None."""
        record = self._scan.records.get(key)
        if record is None:
            self._scan.more(self.root, self.fingerprint)
            record = self._scan.records.get(key)
        if record is None:
            return None
        tensors = self._tensors(record)
        if tensors is None:
            self._scan.records.pop(key, None)  # its bytes are gone or damaged: computed (and written) again
            return None
        return tensors, record["meta"]

    def _tensors(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A record's tensors read from its shard (a regular file directly in shards/, reached without a link,
        holding them, each matching its checksum), else None."""
        import torch

        shard = str(record.get("shard", ""))
        folder, name = os.path.split(shard)
        if folder != SHARD_DIR or name in ("", ".", ".."):
            return None
        out = {}
        try:
            with opened_in(self.root, shard, _FIX) as (fd, st):
                if not tensors_inside(record, st.st_size):
                    return None
                for t in record["tensors"]:
                    data = read_fd(fd, int(t["nbytes"]), str(self.root / shard), _FIX, int(t["offset"]))
                    if checksum(data) != t["xxh3"]:
                        return None
                    flat = torch.from_numpy(np.frombuffer(bytearray(data), np.uint8))  # its own, writable
                    out[t["key"]] = flat.view(torch_dtype(np_dtype(t["dtype"]))).reshape(t["shape"])
        except (OSError, PrepError):  # missing, or refused by the opener (a link, a FIFO, truncated meanwhile)
            return None
        return out

    def write(self, key: str, source: Any, head: Callable[[], Any]) -> None:
        """Write the head's output `head()` of the entry `source` (JSON-able; `key`: its `entry_key`) as a
        drop-in record: tensors into this process's shard, fsynced, then its sealed journal line. Any failure
        is said once in a warning (the item was computed; the training goes on) and stops this process's
        writes."""
        with self._lock:
            if self._off:
                return
            try:
                arrays, parts = split_output(head())
                for array in arrays.values():
                    dtype_code(array.dtype)  # one `prep cache` could not commit is not written
                self._open()
                assert self._shard is not None and self._journal is not None
                tensors = write_tensors(self._shard, arrays)
                self._shard.sync()  # the bytes before the line that vouches for them
                record = {"entry": key, "fingerprint": self.fingerprint, "shard": self._rel, "tensors": tensors,
                          "meta": meta_line(source, self.section, parts)}  # fmt: skip
                self._journal.append(record)
            except Exception as exc:  # noqa: BLE001  (the item is the user's either way: never fail training)
                self._off = True
                self._close()
                warnings.warn(
                    f"{self.root}: cannot write computed items into this prepared cache ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); they are computed at each read in this process; make the folder writable "
                    "or run `prep cache` on this datalist to prepare them",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return
            self._scan.records.setdefault(key, json.loads(json.dumps(record)))  # as other processes read it

    def _open(self) -> None:
        """This process's journal and shard, new ones after a fork (the parent's are its own) or once a
        `prep cache` commit took and removed them."""
        if self._pid != os.getpid():
            if self._shard is not None:
                self._shard.abandon()
            if self._journal is not None:
                self._journal.close()
            for fd in self._dirs:
                os.close(fd)  # this process's copies of its parent's descriptors
            self._journal, self._shard, self._dirs, self._pid = None, None, [], os.getpid()
        if self._journal is not None and not self._journal.removed():
            return
        self._close()
        name = f"{FILL_PREFIX}{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        # held while the files are written: the journal's first lines make its folder entry durable through it
        self._dirs = [folder_to_write(self.root, JOURNAL_DIR, _FIX)]
        self._dirs.append(folder_to_write(self.root, SHARD_DIR, _FIX))
        journals, shards = self._dirs
        self._rel = f"{SHARD_DIR}/{name}.bin"
        os.close(open_to_write(self.root / self._rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FIX, dir_fd=shards))
        self._shard = ShardWriter(self.root / self._rel, prealloc=0, dir_fd=shards)
        self._journal = JournalWriter(self.root / JOURNAL_DIR / f"{name}{FILL_SUFFIX}", journals, _FIX, exclusive=True)

    def _close(self) -> None:
        if self._shard is not None:
            self._shard.close()
        if self._journal is not None:
            self._journal.close()
        for fd in self._dirs:
            os.close(fd)
        self._shard, self._journal, self._dirs = None, None, []


def fill_records(root: Path, fingerprint: str) -> dict[str, dict[str, Any]]:
    """Every well-formed drop-in record of head `fingerprint` in the cache at `root`, by entry key (the first of
    each); the caller checks their shard bytes as it checks its own journals' (`prep cache` takes them)."""
    scan = _Scan()
    scan.more(Path(root), fingerprint)
    return scan.records
