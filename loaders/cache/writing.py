"""Writing a prepared cache (the layout is loaders.cache.format's): durable file writes, shards, index, meta, manifest.

`prep cache` writes through these in parallel with journals (prep.worker, prep.journal); `write_items` writes a
whole small cache in one process, for tests and for users exporting tensors from their own code.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.checksums import checksum, doc_checksum, file_record
from loaders.cache.dtypes import dtype_code, dtype_name, to_numpy
from loaders.cache.format import PreparedCache
from loaders.cache.nesting import flatten, to_jsonable
from loaders.cache.spec import (
    INDEX,
    INDEX_DTYPE,
    LAYOUT_FILES,
    MANIFEST,
    MAX_META_LINE,
    MAX_NDIM,
    META,
    META_OFFSETS,
    SCHEMA_VERSION,
    SHARD_DIR,
    align_up,
)
from loaders.errors import FormatError
from loaders.opener import create_new, open_to_write


def fsync_dir(path: str | os.PathLike[str] | int) -> None:
    """fsync a directory (a path, or a descriptor already open) so a rename inside it is durable."""
    if isinstance(path, int):
        os.fsync(path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_OUT_FIX = "remove it, or choose another output folder (prep never writes through a link)"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, dir_fd: int | None = None) -> None:
    """Write a file so readers see the old or the new content, never a torn one (temp, fsync, rename); the temp
    file is made new (O_EXCL, O_NOFOLLOW) and the rename replaces a name, never writes through a link. `dir_fd`:
    the folder's descriptor, opened once; names are taken relative to it (`path` then names it in messages)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with os.fdopen(create_new(tmp, _OUT_FIX, dir_fd=dir_fd), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if dir_fd is None:
        os.replace(tmp, path)
        fsync_dir(path.parent)
    else:
        os.replace(tmp.name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)


class ShardWriter:
    """Append tensors to one shard file at ALIGN-aligned offsets, preallocating ahead so the shard is one or
    few extents. Use as a context manager; `close()` trims the preallocation to the bytes written."""

    def __init__(
        self, path: str | os.PathLike[str], prealloc: int = 256 << 20, start: int = 0, dir_fd: int | None = None
    ) -> None:
        self.path = Path(path)
        self.prealloc = prealloc
        # checked before the ftruncate; `dir_fd`: its folder's descriptor (the name is taken relative to it)
        self._fd = open_to_write(self.path, os.O_RDWR | os.O_CREAT, _OUT_FIX, dir_fd=dir_fd)
        self.size = align_up(start)
        self._allocated = self.size
        os.ftruncate(self._fd, self.size)

    def _reserve(self, end: int) -> None:
        """Allocate through `end`, and up to `prealloc` bytes ahead while at most half the free space: the
        ahead part is best effort, so a nearly full disk still takes every tensor that fits."""
        if end <= self._allocated:
            return
        ahead = max(end, self._allocated + self.prealloc)
        if ahead > end:
            vfs = os.fstatvfs(self._fd)
            ahead = max(end, min(ahead, self._allocated + vfs.f_bavail * vfs.f_frsize // 2))
        for new in dict.fromkeys((ahead, end)):
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(self._fd, self._allocated, new - self._allocated)
            except OSError as exc:
                if exc.errno == errno.ENOSPC and new > end:
                    continue  # no room ahead: reserve what this tensor needs
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: plain writes
                    raise
            self._allocated = new
            return

    def write(self, array: np.ndarray) -> tuple[int, int, int]:
        """Write one tensor; returns (offset, nbytes, xxh3). Raises OSError (e.g. ENOSPC) untouched."""
        data = np.ascontiguousarray(array)
        raw = data.view(np.uint8).reshape(-1) if data.size else np.empty(0, np.uint8)
        offset = self.size
        nbytes = raw.nbytes
        padded = align_up(nbytes) if nbytes else 0
        self._reserve(offset + padded)
        view = memoryview(raw)  # type: ignore[arg-type]
        done = 0
        while done < nbytes:
            done += os.pwrite(self._fd, view[done:], offset + done)
        if padded > nbytes:
            os.pwrite(self._fd, bytes(padded - nbytes), offset + nbytes)
        self.size = offset + padded
        return offset, nbytes, checksum(raw)

    def sync(self) -> None:
        """Flush written bytes to stable storage (before they are journaled as done)."""
        os.fsync(self._fd)

    def close(self) -> None:
        """Trim the preallocated tail and close."""
        if self._fd >= 0:
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def abandon(self) -> None:
        """Close without trimming: a forked child's copy of its parent's writer (the file stays the parent's)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_rows(entries: list[dict[str, Any]]) -> np.ndarray:
    """Index rows from dicts with item, key (int), shard (int), offset, nbytes, dtype (name), shape, xxh3."""
    rows = np.zeros(len(entries), dtype=INDEX_DTYPE)
    for i, e in enumerate(entries):
        shape = tuple(int(s) for s in e["shape"])
        if len(shape) > MAX_NDIM:
            raise FormatError(f"tensor with {len(shape)} dims exceeds the layout's {MAX_NDIM}")
        rows[i]["item"] = e["item"]
        rows[i]["key"] = e["key"]
        rows[i]["shard"] = e["shard"]
        rows[i]["dtype"] = dtype_code(e["dtype"])
        rows[i]["ndim"] = len(shape)
        rows[i]["offset"] = e["offset"]
        rows[i]["nbytes"] = e["nbytes"]
        rows[i]["shape"][: len(shape)] = shape
        rows[i]["xxh3"] = e["xxh3"]
    return rows


def write_index(cache_dir: str | os.PathLike[str], rows: np.ndarray) -> None:
    """Write index.npy atomically; rows are sorted by (item, key) so an item's rows are contiguous."""
    _atomic_save(Path(cache_dir) / INDEX, np.sort(rows, order=["item", "key"]))


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """np.save through a temp file, fsync and rename (no torn .npy even on a crash)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with os.fdopen(create_new(tmp, _OUT_FIX), "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_meta(cache_dir: str | os.PathLike[str], metas: list[dict[str, Any]], parsed: bool = False) -> None:
    """Write meta.jsonl (one line per item, in item order) and its offsets. `parsed`: the metas came from
    `json.loads` (journal records), so they are plain JSON already and skip `to_jsonable`, which is the
    identity on them (192 spheres items: most of the commit's time)."""
    offsets = np.zeros(len(metas), dtype="<u8")
    chunks = []
    pos = 0
    for i, meta in enumerate(metas):
        line = (json.dumps(meta if parsed else to_jsonable(meta), separators=(",", ":")) + "\n").encode()
        if len(line) > MAX_META_LINE:  # readers refuse such a line: say so here, naming the item's source
            source = str(meta.get("source", "?"))[:80] if isinstance(meta, Mapping) else "?"
            raise FormatError(f"item {i} ({source}): its meta is {len(line)} bytes, over the {MAX_META_LINE >> 20} "
                              "MiB limit; drop large values from the head's meta (keep them as tensors)")  # fmt: skip
        offsets[i] = pos
        pos += len(line)
        chunks.append(line)
    atomic_write_bytes(Path(cache_dir) / META, b"".join(chunks))
    _atomic_save(Path(cache_dir) / META_OFFSETS, offsets)


def write_manifest(cache_dir: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Commit the cache: checksum every layout file, then write manifest.json last and atomically.

    Required keys: keys, shards, n_items. bmap.json is not covered: it is remade wherever the cache is copied
    (staging to node-local scratch), and carries its own checksum and the files' extents, checked on read."""
    for required in ("keys", "shards", "n_items"):
        if required not in manifest:
            raise FormatError(f"manifest is missing '{required}'")
    root = Path(cache_dir)
    files = {name: file_record(root / name) for name in LAYOUT_FILES}
    generation = secrets.token_hex(8)  # a rebuilt cache is a new one, for readers that still hold the old
    doc = to_jsonable({"schema_version": SCHEMA_VERSION, "format": "blockprep-cache", "generation": generation,
                       **manifest, "files": files})  # fmt: skip
    doc["checksum"] = doc_checksum(doc)
    atomic_write_bytes(root / MANIFEST, json.dumps(doc, indent=1).encode())


def write_items(
    cache_dir: str | os.PathLike[str],
    items: list[Mapping[str, Any]],
    metas: list[dict[str, Any]] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> PreparedCache:
    """Write a whole cache in this process: one shard, index, meta, manifest (committed last).

    `items` are (nested) dicts of numpy arrays. `prep cache` does the same in parallel with journals; this
    is for small caches, tests and users exporting tensors from their own code.
    """
    root = Path(cache_dir)
    (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    flat = [flatten(item) for item in items]
    keys = sorted({k for f in flat for k in f})
    shard = f"{SHARD_DIR}/shard-000000.bin"
    rows = []
    with ShardWriter(root / shard, prealloc=1 << 20) as writer:
        for i, f in enumerate(flat):
            for key, value in f.items():
                array = to_numpy(value) if hasattr(value, "detach") else np.asarray(value)
                dtype_code(array.dtype)
                offset, nbytes, xxh3 = writer.write(array)
                rows.append(
                    {"item": i, "key": keys.index(key), "shard": 0, "offset": offset, "nbytes": nbytes,
                     "dtype": dtype_name(array.dtype), "shape": array.shape, "xxh3": xxh3}
                )  # fmt: skip
    write_index(root, make_rows(rows))
    write_meta(root, metas if metas is not None else [{} for _ in items])
    extra = dict(manifest or {})
    if "fingerprint" in extra and "versions" not in extra:
        from loaders.cache.chain import versions

        extra["versions"] = versions()  # a head's output, made under this process's libraries
    write_manifest(root, {**extra, "keys": keys, "shards": [shard], "n_items": len(items)})
    return PreparedCache(root)
