"""Bricks: a second copy of a prepared cache's tensors, each cut into small blocks a page or so in size.

A crop of a C-order volume needs whole rows of the last axis, each in whole pages: a 96^3 crop of a ~200^3
float32 volume reads about twice its bytes, more where its rows are shorter than a page. Cut into blocks of one
page (float32: 8 x 8 x 16 voxels, uint8: 16^3), stored block after block in C order of the block grid, the same
crop needs the blocks it touches: about 1.4x its bytes, in runs of whole blocks along the grid's last axis.
`prep bricks CACHE` writes them; cold region reads (`loaders.reading.region`) read them where they exist, warm
ones keep reading the C-order shards (a page-cache copy costs no disk). The price is the disk space of a second
copy of the tensors.

    CACHE/bricks/
      manifest.json   written last: the cache's manifest checksum it was made from, the index's record, the files
      bricks.npy      one row per row of the cache's index.npy (BRICK_DTYPE)
      NNNNN.bin       the tensors in blocks, each tensor at an ALIGN-aligned offset

A tensor of shape S cut in blocks of shape B (S and B of one ndim; B[0] is 1 where there is a channel axis) has
the block grid G = ceil(S / B); it is stored as the array of shape (*G, *B), C order, edges zero-padded. The
layout is untrusted input as the cache is: every row is checked against the cache's index before it is used.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache import layout
from loaders.cache.checksums import FileCheck, doc_checksum
from loaders.cache.spec import ALIGN, MAX_MANIFEST, MAX_NDIM
from loaders.errors import FormatError
from loaders.opener import read_in

BRICKS_DIR = "bricks"
BRICKS_INDEX = "bricks.npy"
BRICKS_MANIFEST = "manifest.json"
BRICKS_SCHEMA = "1"
MAX_BRICK = 1 << 20  # bytes of one block at most: what a reader allocates per block it touches
_FIX = "re-run `prep bricks --force` on the cache (or remove its bricks/ folder)"

BRICK_DTYPE = np.dtype(
    [
        ("file", "<u4"),  # position in the bricks manifest's "files"
        ("offset", "<u8"),  # byte offset in that file, multiple of ALIGN
        ("nbytes", "<u8"),  # prod(grid) * prod(block) * itemsize
        ("block", "<u4", (MAX_NDIM,)),  # block shape; unused trailing dims are 0
        ("xxh3", "<u8"),  # xxh3_64 of the bricked bytes
    ]
)


def block_for(shape: tuple[int, ...], itemsize: int, page: int = ALIGN) -> tuple[int, ...]:
    """The block shape for a tensor: the spatial axes (all but a leading channel axis where there are 3 or more
    dims) doubled in turn, the shortest first, the last axis on ties, until a block holds `page` bytes or no axis
    can grow (each stays within its dim)."""
    lead = 1 if len(shape) >= 3 else 0
    block = [1] * len(shape)
    while math.prod(block) * itemsize < page:
        growable = [d for d in range(lead, len(shape)) if block[d] < shape[d]]
        if not growable:
            break
        d = min(growable, key=lambda a: (block[a], -a))
        block[d] = min(block[d] * 2, shape[d])
    return tuple(block)


def grid_of(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks along each axis (the last ones zero-padded)."""
    return tuple(-(-s // b) for s, b in zip(shape, block))


def to_bricks(array: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """`array` as blocks: shape (*grid, *block), C order, edges zero-padded."""
    grid = grid_of(array.shape, block)
    padded = np.zeros([g * b for g, b in zip(grid, block)], dtype=array.dtype)
    padded[tuple(slice(0, s) for s in array.shape)] = array
    split = padded.reshape([x for g, b in zip(grid, block) for x in (g, b)])
    n = len(block)
    return np.ascontiguousarray(split.transpose(*range(0, 2 * n, 2), *range(1, 2 * n, 2)))


@dataclass(frozen=True)
class BrickEntry:
    """Where one tensor's blocks lie."""

    path: str
    offset: int
    nbytes: int
    block: tuple[int, ...]
    grid: tuple[int, ...]
    xxh3: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return self.nbytes // max(math.prod(self.grid), 1)


class Bricks:
    """A cache's bricks as checked on open: rows aligned with the cache's index, files inside bricks/."""

    def __init__(self, cache: Any) -> None:
        root = Path(cache.root) / BRICKS_DIR
        self.root = root
        doc = _manifest(root)
        self.page = doc.get("page")
        if doc.get("cache") != cache.manifest.get("checksum"):
            raise FormatError(f"{root}: made from another build of the cache (rebuilt since); {_FIX}")
        index = FileCheck(root, BRICKS_INDEX, doc.get("index") or {}, _FIX)
        self.rows = layout.npy_array(index.read(), root / BRICKS_INDEX, _FIX, "a bricks index")
        if self.rows.dtype != BRICK_DTYPE or self.rows.shape != (len(cache.index),):
            raise FormatError(f"{root / BRICKS_INDEX}: not one {BRICK_DTYPE} row per row of the cache's index; {_FIX}")
        self.paths = layout.shard_paths(root, doc.get("files"))
        _check_rows(root / BRICKS_INDEX, self.rows, cache.index, [layout.file_size(p) for p in self.paths])
        self._paths = [str(p) for p in self.paths]

    def of(self, tensor: Any) -> BrickEntry:
        """The blocks of one cached tensor (a `TensorEntry` of this cache)."""
        r = self.rows[tensor.row]
        block = tuple(int(b) for b in r["block"][: len(tensor.shape)])
        grid = grid_of(tensor.shape, block)
        return BrickEntry(self._paths[int(r["file"])], int(r["offset"]), int(r["nbytes"]), block, grid, int(r["xxh3"]))


def _manifest(root: Path) -> dict[str, Any]:
    """bricks/manifest.json, read whole and checked (FormatError in one line otherwise)."""
    try:
        doc = json.loads(read_in(root, BRICKS_MANIFEST, _FIX, MAX_MANIFEST))
    except FileNotFoundError:
        raise FormatError(f"{root}: no {BRICKS_MANIFEST} (an interrupted `prep bricks`?); {_FIX}") from None
    except (ValueError, RecursionError):
        raise FormatError(f"{root / BRICKS_MANIFEST}: not valid JSON; {_FIX}") from None
    if not isinstance(doc, dict) or doc.get("format") != "blockprep-bricks" or doc.get("checksum") != doc_checksum(doc):
        raise FormatError(f"{root / BRICKS_MANIFEST}: not a bricks manifest, or it fails its checksum; {_FIX}")
    if doc.get("schema") != BRICKS_SCHEMA:
        raise FormatError(f"{root / BRICKS_MANIFEST}: bricks schema {str(doc.get('schema'))[:20]!r}, this blockprep "
                          f"reads {BRICKS_SCHEMA}; {_FIX}")  # fmt: skip
    return doc


def _check_rows(where: Path, rows: np.ndarray, index: np.ndarray, sizes: list[int]) -> None:
    """Every row agrees with its tensor: a block within the tensor's dims (1 past them is 0), of at most MAX_BRICK
    bytes, nbytes = grid x block x itemsize, aligned extents inside their file, none overlapping."""
    if not len(rows):
        return
    from loaders.cache.dtypes import DTYPES, np_dtype

    if int(rows["file"].max()) >= len(sizes) or min(sizes, default=0) < 0:
        raise FormatError(f"{where}: a row names a bricks file that is missing or not listed; {_FIX}")
    ndim = index["ndim"].astype(np.int64)
    used = np.arange(MAX_NDIM)[None, :] < ndim[:, None]
    shape = np.where(used, index["shape"], 1).astype(np.float64)
    block = rows["block"].astype(np.float64)
    if np.any(np.where(used, (block < 1) | (block > np.maximum(shape, 1)), block != 0)):
        raise FormatError(f"{where}: a row's block is not within its tensor's dims (edited?); {_FIX}")
    itemsize = np.array([np_dtype(d).itemsize for d in DTYPES], dtype=np.float64)[index["dtype"]]
    block = np.where(used, block, 1.0)
    per = block.prod(axis=1) * itemsize
    total = (np.ceil(shape / block) * block).prod(axis=1) * itemsize
    if np.any(per > MAX_BRICK) or np.any(total != rows["nbytes"].astype(np.float64)):
        raise FormatError(f"{where}: a row's block or byte count does not fit its tensor (edited?); {_FIX}")
    layout.check_extents(where, rows, rows["file"], sizes, _FIX)


def read_bricks(cache: Any) -> Bricks | None:
    """The cache's bricks, None where it has none; FormatError in one line where they are damaged or stale."""
    if not os.path.lexists(Path(cache.root) / BRICKS_DIR):
        return None
    return Bricks(cache)
