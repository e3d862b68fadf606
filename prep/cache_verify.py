"""`prep verify`: check every file of a committed cache against the manifest, then every tensor against the index."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loaders.cache.dtypes import DTYPES, dtype_name
from loaders.cache.format import PreparedCache, TensorEntry, checksum
from loaders.cache.layout import open_read
from loaders.cache.spec import align_up

_CHUNK_ITEMS = 4096
_SWAPPED = ("sampling sets differ from the ones its cached label makes (swapped or edited); remake them with "
            "`prep sampling CACHE --pipeline P --force`")  # fmt: skip


@dataclass(frozen=True)
class BadItem:
    """One tensor that fails verification, with the reason."""

    item: int
    key: str
    shard: str
    reason: str

    def __str__(self) -> str:
        where = f" in {self.shard}" if self.shard else ""
        return f"item {self.item} key '{self.key}'{where}: {self.reason}"


def verify_cache(cache_dir: str | os.PathLike[str]) -> list[BadItem]:
    """Check every layout file's checksums, then every tensor's checksum, shape/dtype against its size, and
    every shard's length; list all tensor failures.

    Raises FormatError (IncompleteCacheError, ChecksumError, ...) when a layout file is missing or fails its
    checksum: then nothing the index says can be trusted.
    """
    cache = PreparedCache(cache_dir, shard_sizes=False)  # short shards: listed tensor by tensor below
    cache.check_files()
    bad: list[BadItem] = _check_meta(cache)
    sizes: dict[str, int] = {}
    for shard in cache.shards:
        try:
            sizes[str(shard)] = shard.stat().st_size
        except OSError as exc:
            sizes[str(shard)] = -1
            bad.append(BadItem(-1, "", str(shard), f"shard unreadable ({exc.strerror})"))
    ends: dict[str, int] = {}
    fds: dict[str, int] = {}
    try:
        for entry in cache.iter_entries():
            ends[entry.shard] = max(ends.get(entry.shard, 0), entry.offset + align_up(entry.nbytes))
            reason = _check_entry(entry, sizes.get(entry.shard, -1), fds)
            if reason:
                bad.append(BadItem(entry.item, entry.key, Path(entry.shard).name, reason))
    finally:
        for fd in fds.values():
            os.close(fd)
    for name, end in ends.items():
        if sizes.get(name, -1) >= 0 and sizes[name] != end:
            bad.append(BadItem(-1, "", Path(name).name, f"shard is {sizes[name]} bytes, index says {end}"))
    if len(cache.index) and int(cache.index["item"].max()) >= cache.n_items:
        bad.append(BadItem(int(cache.index["item"].max()), "", "", "index row beyond the manifest's n_items"))
    if not bad:  # the sets and bricks are made from the tensors: checked against them once those are known good
        bad += _check_sets(cache) + _check_bricks(cache)
    return bad


def _check_bricks(cache: PreparedCache) -> list[BadItem]:
    """Every tensor's blocks (`prep bricks`), where the cache has them, against the blocks its bytes make: blocks
    edited, swapped or resealed are listed, tensor by tensor."""
    from loaders.cache.bricks import to_bricks

    bricks = cache.bricks  # FormatError for a damaged or stale bricks folder: nothing in it is trusted
    if bricks is None:
        return []
    bad: list[BadItem] = []
    for entry in cache.iter_entries():
        brick = bricks.of(entry)
        tensor = np.frombuffer(_pread(entry.shard, entry.nbytes, entry.offset), entry.dtype)
        blocks = _pread(brick.path, brick.nbytes, brick.offset)
        if to_bricks(tensor.reshape(entry.shape), brick.block).tobytes() != blocks:
            why = "its blocks differ from the tensor; re-run `prep bricks --force`"
            bad.append(BadItem(entry.item, entry.key, f"bricks/{Path(brick.path).name}", why))
    return bad


def _check_sets(cache: PreparedCache) -> list[BadItem]:
    """Every item's stored sampling sets against the sets MONAI's own functions make from its cached label (and
    image), as `prep sampling` made them: sets swapped, edited and resealed are listed, item by item."""
    from loaders.cache import sampling

    bad: list[BadItem] = []
    for sig in sampling.stored_signatures(cache.root):
        store = sampling.SetStore(cache.root, sig, cache.generation)  # files, rows and checksums checked
        keys = [sig["label_key"]] + ([sig["image_key"]] if sig.get("image_key") else [])
        missing = [k for k in keys if k not in cache.keys]
        if missing:
            bad.append(BadItem(-1, missing[0], "", f"sampling sets of {store.where.name} name a key the cache lacks"))
            continue
        from loaders import PreparedDataset

        ds = PreparedDataset(cache.root, keys=keys, meta=False)
        try:
            for item in range(cache.n_items):
                got = ds[item]
                image = got.get(sig["image_key"]) if sig.get("image_key") else None
                if store.stored(item) != sampling.packed_sets(sig, got[sig["label_key"]], image):
                    bad.append(BadItem(item, sig["label_key"], f"{sampling.DIR}/{store.where.name}", _SWAPPED))
        finally:
            ds.close()
    return bad


def _pread(path: str, nbytes: int, offset: int) -> bytes:
    """Bytes of a checked cache file (`open_read`: the very file checked on open, no link followed)."""
    fd = open_read(path)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _check_meta(cache: PreparedCache) -> list[BadItem]:
    """Every meta line parses into the parts readers take apart (`cache.meta` checks them), decodes to
    allowed values only, and gives each tensor an affine that fits it (what readers will build); FormatError,
    naming the item, for the first that does not. Items whose non-tensor outputs differ from item 0's (which
    PreparedLoader refuses to batch) are listed."""
    from loaders.cache.meta import META as META_PART
    from loaders.cache.meta import OPS, TYPED, VALUES, check_affine, decode, key_meta
    from loaders.errors import FormatError

    bad: list[BadItem] = []
    first: set[str] | None = None
    for item in range(cache.n_items):
        line = cache.meta(item)
        names = set(line.get(VALUES) or {})
        first = names if first is None else first
        if names != first:
            bad.append(BadItem(item, ",".join(sorted(names ^ first)), "", "its non-tensor outputs differ from "
                               "item 0's (PreparedLoader refuses batches mixing them)"))  # fmt: skip
        try:
            if line.get(TYPED):
                for part in (META_PART, OPS, VALUES):
                    decode(line.get(part) or {})
            for entry in cache.entries(item):
                affine = key_meta(line, entry.key).get("affine")
                if affine is not None:
                    check_affine(affine, len(entry.shape))
        except FormatError as exc:
            raise FormatError(f"{cache.root / 'meta.jsonl'}: item {item}: {exc}") from None
    return bad


def _check_entry(entry: TensorEntry, shard_size: int, fds: dict[str, int]) -> str | None:
    """Why one tensor is bad, or None."""
    if dtype_name(entry.dtype) not in DTYPES:
        return f"unknown dtype {entry.dtype}"
    expected = int(np.prod(entry.shape, dtype=np.int64)) * entry.dtype.itemsize
    if expected != entry.nbytes:
        return f"shape {entry.shape} of {entry.dtype} needs {expected} bytes, index says {entry.nbytes}"
    if entry.offset % 4096:
        return f"offset {entry.offset} is not 4 KiB-aligned"
    if shard_size < 0:
        return "shard missing"
    if entry.offset + entry.nbytes > shard_size:
        return f"shard ends at {shard_size}, tensor needs bytes up to {entry.offset + entry.nbytes}"
    if entry.shard not in fds:
        fds[entry.shard] = open_read(entry.shard)
    data = os.pread(fds[entry.shard], entry.nbytes, entry.offset)
    if len(data) != entry.nbytes:
        return f"short read: {len(data)} of {entry.nbytes} bytes"
    got = checksum(data)
    if got != entry.xxh3:
        return f"checksum mismatch (stored {entry.xxh3:016x}, read {got:016x})"
    return None
