"""The cache layout's fixed terms: its schema version, file names, alignment and the index's record
(`loaders.cache.format` reads by them, `loaders.cache.writing` writes by them; the dtypes it stores:
`loaders.cache.dtypes`)."""

from __future__ import annotations

import numpy as np

# major.minor: readers reject another major, accept any minor of theirs. 2: file checksums in the manifest.
SCHEMA_VERSION = "2.0"
ALIGN = 4096
SMALL = 16 << 20  # files up to this size are checked whole on open; larger ones chunk by chunk as read
MAX_NDIM = 6
MAX_META_LINE = 16 << 20  # bytes of one item's meta line, at write and at read
MAX_MANIFEST = 64 << 20  # bytes of manifest.json (checksums of the layout files, shard names): read whole
MAX_IN_MEMORY = 4 << 30  # index.npy and meta_offsets.npy are read into memory (never mapped): at most this each

MANIFEST = "manifest.json"
INDEX = "index.npy"
META = "meta.jsonl"
META_OFFSETS = "meta_offsets.npy"
SHARD_DIR = "shards"
JOURNAL_DIR = "journal"
BMAP = "bmap.json"
PENDING = "pending.json"  # a cache the MONAI drop-in started, no `prep cache` run yet (loaders.cache.pending)
MAX_PENDING = 1 << 20  # bytes of pending.json, read whole
LAYOUT_FILES = (INDEX, META, META_OFFSETS)  # always present in a committed cache; BMAP when written

INDEX_DTYPE = np.dtype(
    [
        ("item", "<u4"),  # item number (row of meta.jsonl)
        ("key", "<u2"),  # position in manifest["keys"]
        ("shard", "<u4"),  # position in manifest["shards"]
        ("dtype", "u1"),  # position in loaders.cache.dtypes.DTYPES
        ("ndim", "u1"),
        ("offset", "<u8"),  # byte offset in the shard, multiple of ALIGN
        ("nbytes", "<u8"),  # tensor bytes (without padding)
        ("shape", "<u8", (MAX_NDIM,)),  # unused trailing dims are 0
        ("xxh3", "<u8"),  # xxh3_64 of the tensor bytes
    ]
)


def align_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of `align` that is >= n."""
    return -(-n // align) * align
