"""Checksums of a prepared cache's bytes: xxh3 of tensors, of each file of the layout by chunks, of documents.

Light: numpy and xxhash only. `loaders.cache.format` records these in the manifest and checks them on read.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loaders.errors import ChecksumError, FormatError

CHUNK = 1 << 20  # checksum granularity of the layout's files


def checksum(buf: Any) -> int:
    """xxh3_64 of a buffer (bytes, memoryview or C-contiguous numpy array)."""
    import xxhash

    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1).data
    return int(xxhash.xxh3_64_intdigest(buf))


def file_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Size and the xxh3 of each CHUNK of a file, as the manifest records them."""
    digests = []
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digests.append(f"{checksum(chunk):016x}")
    return {"size": os.path.getsize(path), "chunk": CHUNK, "xxh3": digests}


def doc_checksum(doc: Mapping[str, Any]) -> str:
    """xxh3 of a JSON document without its own "checksum" entry (keys sorted, compact)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return f"{checksum(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):016x}"


MIN_CHUNK, MAX_CHUNK = 1 << 10, 64 << 20  # a record's chunk: what a reader allocates per checksummed read
_REBUILD = "rebuild with `prep cache --force`"


def _record_fields(path: Path, record: Any) -> tuple[int, int, list[int]]:
    """(size, chunk, digests) of a manifest file record, each checked before anything is allocated on it."""
    where = f"{path}: the manifest's record of this file"
    if not isinstance(record, Mapping):
        raise FormatError(f"{where} is not an object; {_REBUILD}")
    size, chunk, digests = record.get("size"), record.get("chunk", CHUNK), record.get("xxh3")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 62:
        raise FormatError(f"{where} has size {str(size)[:40]!r}, not a byte count; {_REBUILD}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise FormatError(
            f"{where} has chunk {str(chunk)[:40]!r}, not a whole number of bytes in {MIN_CHUNK}..{MAX_CHUNK}; "
            + _REBUILD
        )
    ok = isinstance(digests, list) and all(isinstance(h, str) and len(h) == 16 for h in digests)
    try:
        values = [int(h, 16) for h in digests] if ok and isinstance(digests, list) else []
    except ValueError:
        ok = False
    if not ok:
        raise FormatError(f"{where} has no list of 16-digit hex checksums ('xxh3'); {_REBUILD}")
    return size, chunk, values


class FileCheck:
    """One layout file against its manifest record: size checked at once, chunks checked once each, as read."""

    def __init__(self, path: Path, record: Mapping[str, Any]) -> None:
        self.path = path
        self.size, self.chunk, self.digests = _record_fields(path, record)
        self._ok: set[int] = set()
        self._lock = threading.Lock()
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise FormatError(f"{path}: missing from the cache; rebuild it with `prep cache --force`") from None
        if size != self.size or len(self.digests) != -(-self.size // self.chunk):
            raise ChecksumError(
                f"{path}: {size} bytes, the manifest says {self.size}; rebuild with `prep cache --force`"
            )

    def check(self, offset: int = 0, length: int | None = None) -> None:
        """Raise ChecksumError unless every chunk holding bytes [offset, offset + length) matches."""
        end = self.size if length is None else min(self.size, offset + length)
        todo = [c for c in range(offset // self.chunk, -(-end // self.chunk)) if c not in self._ok]
        if not todo:
            return
        with self._lock, open(self.path, "rb") as f:
            for c in todo:
                if checksum(os.pread(f.fileno(), self.chunk, c * self.chunk)) != self.digests[c]:
                    raise ChecksumError(
                        f"{self.path}: bytes {c * self.chunk}-{min(self.size, (c + 1) * self.chunk)} fail their "
                        "checksum (changed since `prep cache` wrote them); rebuild with `prep cache --force`"
                    )
                self._ok.add(c)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()
