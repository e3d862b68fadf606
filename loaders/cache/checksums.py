"""Checksums of a prepared cache's bytes: xxh3 of tensors, of each file of the layout by chunks, of documents.

Light: numpy and xxhash only. `loaders.cache.format` records these in the manifest and checks them on read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loaders.errors import ChecksumError, FormatError
from loaders.opener import open_in, read_fd

CHUNK = 1 << 20  # checksum granularity of the layout's files


def checksum(buf: Any) -> int:
    """xxh3_64 of a buffer (bytes, memoryview or C-contiguous numpy array)."""
    import xxhash

    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1).data
    return int(xxhash.xxh3_64_intdigest(buf))


def file_record(path: str | os.PathLike[str], dir_fd: int | None = None) -> dict[str, Any]:
    """Size and the xxh3 of each CHUNK of a file, as the manifest records them. `dir_fd`: `path` is a name in that
    held folder, opened without following a link (a file this run just wrote there)."""

    def opener(name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)

    digests = []
    with open(path if dir_fd is None else os.path.basename(path), "rb", opener=opener) as f:
        while chunk := f.read(CHUNK):
            digests.append(f"{checksum(chunk):016x}")
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "chunk": CHUNK, "xxh3": digests}


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
    """One layout file against its manifest record, opened through `loaders.opener` (confined to its root, a
    regular file, no link followed) on every use: its size checked against the record then, and the chunks of
    every read checked on that read (a file swapped or edited after open is caught where it is used)."""

    def __init__(self, root: str | os.PathLike[str], rel: str, record: Mapping[str, Any], fix: str = _REBUILD) -> None:
        self.root, self.rel, self.fix = os.fspath(root), rel, fix
        self.path = Path(self.root) / rel
        self.size, self.chunk, self.digests = _record_fields(self.path, record)
        if len(self.digests) != -(-self.size // self.chunk):
            raise ChecksumError(f"{self.path}: the manifest's record lists {len(self.digests)} checksums for "
                                f"{self.size} bytes; {fix}")  # fmt: skip
        os.close(self._open())

    def _open(self) -> int:
        """A checked descriptor of the file: UnsafeFileError for a link or FIFO, ChecksumError for another size."""
        try:
            fd, st = open_in(self.root, self.rel, self.fix)
        except FileNotFoundError:
            raise FormatError(f"{self.path}: missing from the cache; {self.fix}") from None
        if st.st_size != self.size:
            os.close(fd)
            raise ChecksumError(f"{self.path}: {st.st_size} bytes, the manifest says {self.size}; {self.fix}")
        return fd

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset + length) (to the end when length is None), each chunk holding them checked."""
        end = self.size if length is None else min(self.size, offset + length)
        if end <= offset:
            return b""
        first, stop = offset // self.chunk, -(-end // self.chunk)
        fd = self._open()
        try:
            data = read_fd(fd, min(self.size, stop * self.chunk) - first * self.chunk, str(self.path), self.fix,
                           first * self.chunk)  # fmt: skip
        finally:
            os.close(fd)
        view = memoryview(data)
        for c in range(first, stop):
            self._match(c, view[(c - first) * self.chunk : (c - first + 1) * self.chunk])
        return data[offset - first * self.chunk : end - first * self.chunk]

    def check(self) -> None:
        """Raise ChecksumError unless every chunk of the file matches (read one chunk at a time)."""
        fd = self._open()
        try:
            for c in range(len(self.digests)):
                size = min(self.chunk, self.size - c * self.chunk)
                self._match(c, read_fd(fd, size, str(self.path), self.fix, c * self.chunk))
        finally:
            os.close(fd)

    def _match(self, c: int, data: Any) -> None:
        if checksum(data) != self.digests[c]:
            raise ChecksumError(
                f"{self.path}: bytes {c * self.chunk}-{min(self.size, (c + 1) * self.chunk)} fail their "
                f"checksum (changed since `prep cache` wrote them); {self.fix}"
            )
