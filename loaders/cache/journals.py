"""The journal line format, both directions: `prep cache`'s workers and the MONAI drop-in write an item's
tensors into a shard of their own, fsync it, then append one sealed JSON line describing them; every reader of
a journal trusts a line only by the rules here.

A record is {"shard": "shards/<name>", "tensors": [{"key", "offset", "nbytes", "dtype", "shape", "xxh3"}],
"meta": meta line} plus who it is for ("item": a plan position for `prep cache`; "entry": the datalist entry's
key for the drop-in). Its line carries the xxh3 of the record ("line_xxh3"): a torn last line (kill -9
mid-write) or a damaged one is never trusted, nor one whose tensors lie past its shard's end, nor one naming a
shard that is not a regular file directly in `shards/` (no link is followed).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.checksums import checksum
from loaders.cache.dtypes import dtype_name
from loaders.cache.spec import SHARD_DIR
from loaders.cache.writing import ShardWriter, fsync_dir
from loaders.opener import open_to_write

_OUT_FIX = "remove it, or choose another --output (prep cache never writes through a link)"


def _record_sum(record: dict[str, Any]) -> str:
    return f"{checksum(json.dumps(record, sort_keys=True, separators=(',', ':')).encode()):016x}"


def sealed(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the xxh3 of its content, so a damaged line is never trusted."""
    return {**record, "line_xxh3": _record_sum(record)}


def unsealed(raw: bytes) -> dict[str, Any] | None:
    """The record of a journal line, or None for a torn, damaged or unsealed one."""
    try:
        record = json.loads(raw)
        seal = record.pop("line_xxh3")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return record if seal == _record_sum(record) else None


class JournalWriter:
    """Append-only JSON-lines journal of one writer; lines fsynced in groups by the caller. `dir_fd`: its
    folder's descriptor, held open (the name is taken relative to it); `fix`: what a refusal tells the user.
    `exclusive`: the file must not exist yet (O_EXCL: a writer never appends to another's journal)."""

    def __init__(self, path: Path, dir_fd: int | None = None, fix: str = _OUT_FIX, exclusive: bool = False) -> None:
        self.path = Path(path)
        self._dir: Path | int = self.path.parent if dir_fd is None else dir_fd
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_EXCL if exclusive else 0)
        self._fd = open_to_write(self.path, flags, fix, dir_fd=dir_fd)
        self._named = False  # the folder's entry of this file made durable (with the first lines)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line and fsync it."""
        self.append_many([record])

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Write records as lines (O_APPEND) and fsync once; a kill mid-write leaves at most a torn last line."""
        data = b"".join((json.dumps(sealed(r), separators=(",", ":")) + "\n").encode() for r in records)
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])
        os.fsync(self._fd)
        if not self._named:  # until then a crash may lose the file, and with it lines nobody could trust yet
            fsync_dir(self._dir)
            self._named = True

    def removed(self) -> bool:
        """True once the journal's file has no name any more (a commit consumed and removed it)."""
        return self._fd < 0 or os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        """Close the journal file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_tensors(writer: ShardWriter, arrays: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Write a head's flat arrays (`loaders.cache.meta.split_output`) to a shard, in key order; returns the
    record's "tensors" list."""
    tensors = []
    for key in sorted(arrays):
        array = arrays[key]
        offset, nbytes, xxh3 = writer.write(array)
        tensors.append(
            {"key": key, "offset": offset, "nbytes": nbytes, "dtype": dtype_name(array.dtype),
             "shape": list(array.shape), "xxh3": xxh3}
        )  # fmt: skip
    return tensors


def shard_size(shard: str, shards_fd: int) -> int:
    """The size of a record's shard `shards/<name>`, found relative to the shard folder's descriptor without
    following a link; -1 where it is missing, not a regular file, or not a name a writer makes."""
    folder, name = os.path.split(shard)
    if folder != SHARD_DIR or name in ("", ".", ".."):
        return -1
    try:
        st = os.stat(name, dir_fd=shards_fd, follow_symlinks=False)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def tensors_inside(record: dict[str, Any], size: int) -> bool:
    """Whether every tensor of a record lies inside its shard's `size` bytes (a well-formed list of them)."""
    tensors = record.get("tensors", [])
    if not isinstance(tensors, list):
        return False
    try:
        return all(int(t["offset"]) >= 0 and int(t["nbytes"]) >= 0 and int(t["offset"]) + int(t["nbytes"]) <= size
                   for t in tensors)  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return False
