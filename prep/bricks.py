"""`prep bricks`: write a prepared cache's tensors a second time, in blocks (`loaders.cache.bricks`).

Each cache shard gets one bricks file, written in a temp folder (`bricks.tmp/`) with the rows it holds; an
interrupted run keeps the files it finished and the next run resumes after them (unless the cache was rebuilt in
between). The folder becomes `bricks/` by one rename once the index and the manifest are written. Every tensor's
bytes are checked against the cache's own xxh3 before they are cut: bricks are never made of damaged data.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from loaders.cache.bricks import (
    BRICK_DTYPE,
    BRICKS_DIR,
    BRICKS_INDEX,
    BRICKS_MANIFEST,
    BRICKS_SCHEMA,
    block_for,
    read_bricks,
    to_bricks,
)
from loaders.cache.checksums import checksum, doc_checksum, file_record
from loaders.cache.format import PreparedCache
from loaders.cache.layout import open_read
from loaders.cache.spec import ALIGN, MAX_NDIM
from loaders.cache.writing import ShardWriter, atomic_write_bytes, fsync_dir
from loaders.errors import ChecksumError, FormatError
from loaders.opener import folder_to_write

_TMP = "bricks.tmp"
_STATE = "state.json"
_FIX = "remove the cache's bricks.tmp/ folder and run `prep bricks` again"


def build_bricks(
    cache_dir: str | os.PathLike[str],
    page: int = ALIGN,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write `cache_dir`'s bricks (blocks of about `page` bytes) and return their folder. An existing, current
    bricks folder is kept (nothing to do) unless `force`; one made from another build of the cache is replaced.
    `progress(n)` is told each tensor written."""
    cache = PreparedCache(cache_dir)
    root = Path(cache.root)
    done = root / BRICKS_DIR
    if os.path.lexists(done) and not force:
        try:
            if getattr(read_bricks(cache), "page", None) == page:
                return done
        except FormatError:
            pass  # stale or damaged: made again below
    tmp_fd = folder_to_write(root, _TMP, _FIX)
    try:
        _start(root / _TMP, tmp_fd, cache.manifest["checksum"], page)
        rows = np.zeros(len(cache.index), dtype=BRICK_DTYPE)
        names = []
        for shard in range(len(cache.shards)):
            name = f"{shard:05d}.bin"
            names.append(name)
            rows_of = _shard_rows(cache, shard, root / _TMP / name, tmp_fd, page, progress)
            for row, values in rows_of.items():
                rows[row] = values
        atomic_write_bytes(root / _TMP / BRICKS_INDEX, _npy(rows), dir_fd=tmp_fd)
        doc = {"format": "blockprep-bricks", "schema": BRICKS_SCHEMA, "cache": cache.manifest["checksum"],
               "page": page, "files": names, "index": file_record(root / _TMP / BRICKS_INDEX)}  # fmt: skip
        doc["checksum"] = doc_checksum(doc)
        atomic_write_bytes(root / _TMP / BRICKS_MANIFEST, json.dumps(doc, indent=1).encode(), dir_fd=tmp_fd)
    finally:
        os.close(tmp_fd)
    for name in os.listdir(root / _TMP):  # the parts and the state: not part of the bricks
        if name.endswith(".rows.npy") or name == _STATE:
            os.unlink(root / _TMP / name)
    _drop(done)
    os.rename(root / _TMP, done)
    fsync_dir(root)
    read_bricks(cache)  # what readers will check, checked once here
    return done


def drop_bricks(root: str | os.PathLike[str]) -> None:
    """Remove a cache's bricks and an interrupted run's folder (`prep cache` does at each commit: they are of the
    earlier commit's tensors)."""
    for name in (BRICKS_DIR, _TMP):
        _drop(Path(root) / name)


def _drop(path: Path) -> None:
    """Remove a folder (never following a link in it) or whatever else holds the name."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _start(tmp: Path, tmp_fd: int, made_from: str, page: int) -> None:
    """Keep an interrupted run's finished files where it was of this very cache and page; else start afresh."""
    state = {"cache": made_from, "page": page}
    try:
        with open(tmp / _STATE, "rb") as f:
            same = json.loads(f.read(1 << 16)) == state
    except (OSError, ValueError):
        same = False
    if not same:
        for name in os.listdir(tmp):
            os.unlink(name, dir_fd=tmp_fd)
        atomic_write_bytes(tmp / _STATE, json.dumps(state).encode(), dir_fd=tmp_fd)


def _shard_rows(
    cache: PreparedCache, shard: int, out: Path, tmp_fd: int, page: int, progress: Callable[[int], None] | None
) -> dict[int, tuple]:
    """One cache shard's tensors written in blocks to `out` (or found written by an interrupted run): each
    index row -> its bricks row."""
    part = out.with_name(out.name.replace(".bin", ".rows.npy"))
    if part.exists() and out.exists():
        saved = np.load(part, allow_pickle=False)
        return {int(r): tuple(v) for r, v in zip(saved["row"], saved["values"].tolist())}
    picked = np.flatnonzero(cache.index["shard"] == shard)
    got: dict[int, tuple] = {}
    fd = open_read(str(cache.shards[shard]))
    try:
        with ShardWriter(out, dir_fd=tmp_fd) as writer:
            for row in picked[np.argsort(cache.index["offset"][picked], kind="stable")].tolist():
                entry = cache.entry_of_row(row)
                data = os.pread(fd, entry.nbytes, entry.offset)
                if len(data) != entry.nbytes or checksum(data) != entry.xxh3:
                    raise ChecksumError(f"{entry.shard}: item {entry.item} key '{entry.key}' fails its checksum "
                                        "(damaged); run `prep verify`, then `prep cache --force`")  # fmt: skip
                array = np.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)
                block = block_for(entry.shape, entry.dtype.itemsize, page)
                offset, nbytes, xxh3 = writer.write(to_bricks(array, block))
                got[row] = (shard, offset, nbytes, tuple(block) + (0,) * (MAX_NDIM - len(block)), xxh3)
                if progress is not None:
                    progress(1)
            writer.sync()
    finally:
        os.close(fd)
    saved = np.zeros(len(got), dtype=[("row", "<u8"), ("values", BRICK_DTYPE)])
    saved["row"] = list(got)
    saved["values"] = list(got.values())
    atomic_write_bytes(part, _npy(saved), dir_fd=tmp_fd)
    return got


def _npy(array: np.ndarray) -> bytes:
    import io

    f = io.BytesIO()
    np.save(f, array, allow_pickle=False)
    return f.getvalue()
