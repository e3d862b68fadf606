"""The prepared-cache layout: the ONE definition. `prep cache` writes through it, every loader reads through it.

A cache is a directory::

    CACHE/
      manifest.json        written LAST (temp, fsync, rename, fsync dir): no manifest = incomplete, resumable;
                           holds its own checksum and the size + per-MiB xxh3 of index, meta and offsets
      index.npy            one row per tensor (INDEX_DTYPE), numpy .npy, read into memory and checked whole on open
      meta.jsonl           one JSON line per item, in item order: source entry, per-key MetaTensor meta
      meta_offsets.npy     uint64 byte offset of each line of meta.jsonl (random access without parsing all)
      shards/*.bin         tensors at ALIGN-aligned offsets, each padded to ALIGN (O_DIRECT/GDS need no bounce)
      journal/             append-only per-writer journals while preparing (see prep.cache)
      bmap.json            optional: the shards' block map

Every file a reader trusts is covered by a checksum: index.npy, meta.jsonl and meta_offsets.npy by the
manifest (`files`): index and offsets read into memory and checked whole on open, meta.jsonl too while at most
SMALL bytes (a larger one's chunks checked again on every read); every one opened by `loaders.opener` (no link
followed, no FIFO, confined to the cache); tensors by their own xxh3 in the index; the manifest by its own;
bmap.json (remade wherever the cache is copied) by its document checksum and the files' current extents
(loaders.blockmap.bmap). Caches of schema 1 had no such checksums and are refused with the fix (re-run
`prep cache --force`).

Nested outputs (lists of tensors, dicts) are flattened to path keys: {"image": t, "crops": [a, b]} ->
{"image": t, "crops/0": a, "crops/1": b} (loaders.cache.nesting). The writers are in loaders.cache.writing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args
from loaders.cache import layout
from loaders.cache.checksums import FileCheck, checksum, doc_checksum
from loaders.cache.dtypes import DTYPES, np_dtype
from loaders.cache.spec import (
    INDEX,
    INDEX_DTYPE,
    JOURNAL_DIR,
    LAYOUT_FILES,
    MANIFEST,
    MAX_IN_MEMORY,
    MAX_MANIFEST,
    MAX_META_LINE,
    META,
    META_OFFSETS,
    SCHEMA_VERSION,
    SHARD_DIR,
    SMALL,
    align_up,
)
from loaders.errors import ChecksumError, FormatError, IncompleteCacheError, SchemaVersionError, UnsafeFileError
from loaders.opener import read_in


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: shard file, aligned offset, size, dtype, shape and checksum."""

    item: int
    key: str
    shard: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    xxh3: int
    row: int = -1  # its row of the cache's index (-1: not from an index)

    @property
    def padded(self) -> int:
        """Bytes to read with O_DIRECT/GDS: nbytes rounded up to ALIGN."""
        return align_up(self.nbytes)


def read_manifest(cache_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check manifest.json: FormatError naming what the path is when it is no cache,
    IncompleteCacheError if uncommitted, SchemaVersionError for another schema, ChecksumError if edited;
    UnsafeFileError for a manifest that is a link, a FIFO or over MAX_MANIFEST bytes."""
    root = Path(cache_dir)
    path = root / MANIFEST
    if root.is_file():
        raise FormatError(f"{root}: is a file, not a cache directory; pass the folder `prep cache --output` wrote")
    if not root.is_dir():
        raise FormatError(f"{root}: no such cache directory; create it with `prep cache`")
    try:
        raw = read_in(root, MANIFEST, "rebuild it with `prep cache --force`", MAX_MANIFEST)
    except FileNotFoundError:
        if not any(os.path.lexists(root / name) for name in (JOURNAL_DIR, SHARD_DIR, ".lock")):  # `prep cache` traces
            raise FormatError(
                f"{root}: not a prepared cache (no {MANIFEST}, no {JOURNAL_DIR}/); create one with `prep cache`"
            ) from None
        raise IncompleteCacheError(
            f"{path}: missing, so the cache is incomplete (interrupted run?); re-run the same `prep cache` to finish it"
        ) from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:80]
        raise FormatError(f"{path}: not valid JSON ({why}); re-run `prep cache --force` to rebuild") from None
    if not isinstance(doc, dict) or doc.get("format") != "blockprep-cache":
        raise FormatError(f"{path}: not a blockprep cache manifest")
    version = str(doc.get("schema_version", ""))
    major, ours = version.split(".")[0], SCHEMA_VERSION.split(".")[0]
    if major != ours:
        older = major.isdigit() and int(major) < int(ours)
        raise SchemaVersionError(
            f"{path}: schema version {version} is not readable by this blockprep (reads {SCHEMA_VERSION}); "
            + ("it predates file checksums: re-run `prep cache --force` to rebuild it" if older
               else "upgrade blockprep or rebuild the cache")
        )  # fmt: skip
    if doc.get("checksum") != doc_checksum(doc):
        raise ChecksumError(f"{path}: fails its checksum (edited or damaged); rebuild with `prep cache --force`")
    return doc


def _stat_key(path: str | Path) -> tuple[int, int, int, int] | None:
    """(inode, size, mtime, ctime) of a name (a link's own), None when missing: manifest.json is replaced by
    rename on a rebuild."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class PreparedCache:
    """Read-only view of a committed cache: manifest, index (in memory), per-item metadata, shard paths.

    Opening reads the manifest and maps the index; metadata lines are read on demand, so a cache of a
    million items opens in milliseconds.
    """

    def __init__(
        self, cache_dir: str | os.PathLike[str], allow_outside: bool = False, shard_sizes: bool = True
    ) -> None:
        """allow_outside=True reads shards that resolve outside the cache directory (refused by default: a cache
        is untrusted input, see loaders.cache.layout). shard_sizes=False leaves extents past a shard's end to the
        caller (`prep verify` lists each such tensor)."""
        args.cache_dir(cache_dir)
        # absolute, so TensorEntry.shard stays valid whatever the caller's working directory becomes
        self.root = Path(cache_dir).absolute()
        self._manifest_path = str(self.root / MANIFEST)  # stat'ed before every read (check_current)
        self._manifest_stat = _stat_key(self._manifest_path)
        self.manifest = read_manifest(self.root)
        self.generation = self.manifest.get("generation")
        self.files = self._file_checks()
        index_path = self.root / INDEX
        # read into memory and checked there: a mapping would show later edits and die of SIGBUS on truncation
        self.index: np.ndarray = layout.npy_array(self._whole(INDEX), index_path, what="an index")
        if self.index.dtype != INDEX_DTYPE or self.index.ndim != 1:
            raise FormatError(f"{index_path}: rows are a {self.index.ndim}-D {self.index.dtype} array, not the "
                              "index's 1-D row layout; rebuild with `prep cache --force`")  # fmt: skip
        offsets = layout.npy_array(self._whole(META_OFFSETS), self.root / META_OFFSETS, what="an array of offsets")
        self._meta_offsets = layout.check_offsets(self.root / META_OFFSETS, offsets, self.files[META].size)
        self.n_items = layout.check_counts(self.root, self.manifest, len(self._meta_offsets))
        self.keys: list[str] = list(self.manifest["keys"])
        self.shards: list[Path] = layout.shard_paths(self.root, self.manifest.get("shards"), allow_outside)
        layout.check_index(
            index_path,
            self.index,
            self.n_items,
            len(self.keys),
            DTYPES,
            [layout.file_size(p) if shard_sizes else -1 for p in self.shards],
        )
        self._shard_paths = [str(p) for p in self.shards]  # entries are built per item: no Path -> str each time
        self._meta_path = str(self.root / META)
        self._meta = self.files[META].read() if self.files[META].size <= SMALL else None  # larger: read per use
        self._starts = np.searchsorted(self.index["item"], np.arange(self.n_items + 1))

    def _whole(self, name: str) -> bytes:
        """A layout file read whole into memory (at most MAX_IN_MEMORY bytes) and checked against its record."""
        check = self.files[name]
        if check.size > MAX_IN_MEMORY:
            raise UnsafeFileError(f"{check.path}: {check.size} bytes, over the {MAX_IN_MEMORY >> 30} GiB a "
                                  "layout file may hold; rebuild with `prep cache --force`")  # fmt: skip
        return check.read()

    def _file_checks(self) -> dict[str, FileCheck]:
        """Check each layout file's presence and size; the small ones' checksums now, the rest as read."""
        records = self.manifest.get("files")
        if not isinstance(records, dict):
            records = {}
        missing = [n for n in LAYOUT_FILES if n not in records]
        unknown = [str(n)[:60] for n in records if n not in LAYOUT_FILES]
        if unknown:  # any other name would be opened and hashed on the manifest's word (an oracle)
            raise FormatError(
                f"{self.root / MANIFEST}: 'files' names {unknown[0]!r}, not a file of the layout "
                f"({', '.join(LAYOUT_FILES)}); rebuild with `prep cache --force`"
            )
        if missing:
            raise FormatError(
                f"{self.root / MANIFEST}: no checksum for {', '.join(missing)}; rebuild with `prep cache --force`"
            )
        return {name: FileCheck(self.root, name, record) for name, record in records.items()}

    def __len__(self) -> int:
        return self.n_items

    def check_current(self) -> None:
        """FormatError in one line when the cache was rebuilt (or removed) since this reader opened it: a
        stat of manifest.json when nothing changed, its generation compared when it did."""
        key = _stat_key(self._manifest_path)
        if key == self._manifest_stat and key is not None:
            return
        try:
            generation = json.loads(read_in(self.root, MANIFEST, "reopen it", MAX_MANIFEST)).get("generation")
        except (OSError, ValueError, AttributeError, RecursionError, FormatError):
            generation = None
        if key is None or generation is None or generation != self.generation:
            raise FormatError(
                f"the cache at {self.root} was rebuilt (or removed) since this reader opened it; reopen it"
            )
        self._manifest_stat = key

    def entries(self, item: int) -> list[TensorEntry]:
        """The tensors of one item, in key order."""
        self.check_current()
        if not 0 <= item < self.n_items:
            raise IndexError(f"item {item} out of range for a cache of {self.n_items}")
        start, stop = int(self._starts[item]), int(self._starts[item + 1])
        rows = self.index[start:stop].tolist()  # tuples of ints: one C call
        return [self._entry(row, start + k) for k, row in enumerate(rows)]

    def entry_of_row(self, row: int) -> TensorEntry:
        """The tensor of index row `row`."""
        return self._entry(self.index[row], row)

    @property
    def bricks(self) -> Any:
        """The cache's bricks (`loaders.cache.bricks.Bricks`, checked on first use), None where it has none."""
        if not hasattr(self, "_bricks"):
            from loaders.cache.bricks import read_bricks

            self._bricks = read_bricks(self)
        return self._bricks

    def same_spatial(self, keys: Sequence[str]) -> bool:
        """Whether every item holds each of `keys` and their tensors share one spatial shape (every dim but the
        channel), as the index says."""
        rows = self.index[np.isin(self.index["key"], [self.keys.index(k) for k in keys])]
        if len(rows) != len(keys) * self.n_items:
            return False
        items, ndim, shape = rows["item"], rows["ndim"], np.array(rows["shape"])
        shape[:, 0] = 0  # the channel may differ
        first = np.searchsorted(items, items, side="left")  # each row's item's first row (the index is item-sorted)
        return bool((ndim == ndim[first]).all() and (shape == shape[first]).all())

    def _entry(self, row: Any, number: int = -1) -> TensorEntry:
        """A TensorEntry from index row `number` (a numpy record or its .tolist() tuple, fields in INDEX_DTYPE
        order)."""
        item, key, shard, dtype, ndim, offset, nbytes, shape, xxh3 = row if isinstance(row, tuple) else row.tolist()
        return TensorEntry(
            item=int(item),
            key=self.keys[key],
            shard=self._shard_paths[shard],
            offset=int(offset),
            nbytes=int(nbytes),
            dtype=np_dtype(DTYPES[dtype]),
            shape=tuple(int(s) for s in shape[:ndim]),
            xxh3=int(xxh3),
            row=number,
        )

    def meta(self, item: int) -> dict[str, Any]:
        """The item's metadata line: {"source": datalist entry, "meta": {key: MetaTensor meta}}."""
        self.check_current()
        if not 0 <= item < self.n_items:
            raise IndexError(f"item {item} out of range for a cache of {self.n_items}")
        offsets = self._meta_offsets
        start = int(offsets[item])
        stop = int(offsets[item + 1]) if item + 1 < len(offsets) else self.files[META].size
        if stop - start > MAX_META_LINE:
            raise FormatError(f"{self._meta_path}: item {item}'s meta line is {stop - start} bytes, over the "
                              f"{MAX_META_LINE >> 20} MiB limit; re-run `prep cache --force`")  # fmt: skip
        # checked in memory at open, or (a large meta.jsonl) read and its chunks checked again on every use
        raw = self._meta[start:stop] if self._meta is not None else self.files[META].read(start, stop - start)
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:80]
            raise FormatError(f"{self._meta_path}: item {item}'s meta line is not valid JSON ({why}); "
                              "re-run `prep cache --force` to rebuild") from None  # fmt: skip
        from loaders.cache.meta import check_line  # meta.py builds on this module

        wrong = "it is not an object" if not isinstance(line, dict) else check_line(line)
        if wrong:
            raise FormatError(f"{self._meta_path}: item {item}'s meta line is malformed ({wrong}); re-run "
                              "`prep cache --force`")  # fmt: skip
        return line

    def check_files(self) -> None:
        """Check every byte of every layout file against the manifest (`prep verify`); ChecksumError if not."""
        for check in self.files.values():
            check.check()

    def iter_entries(self) -> Iterator[TensorEntry]:
        """Every tensor of the cache, in index order."""
        for number, row in enumerate(self.index):
            yield self._entry(row, number)


def check(entry: TensorEntry, data: Any) -> None:
    """Raise ChecksumError when `data` (the tensor's nbytes, bytes-like or numpy) does not match its entry."""
    got = checksum(data)
    if got != entry.xxh3:
        raise ChecksumError(
            f"{entry.shard}: item {entry.item} key '{entry.key}' at offset {entry.offset} fails its checksum "
            f"(stored {entry.xxh3:016x}, read {got:016x}); run `prep verify` and rebuild the bad items"
        )
