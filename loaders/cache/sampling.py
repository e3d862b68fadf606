"""Sampling sets: what a label-driven crop draws from, prepared once per item and kept beside the cache.

`RandCropByPosNegLabeld` draws its centres from the foreground and background voxels of the label
(`map_binary_to_indices`), `RandCropByLabelClassesd` from each class's voxels (`map_classes_to_indices`). MONAI
lists every such voxel at every draw (8 bytes a voxel, on the label's device, copied to the host). The draw
only needs each set's size and the few entries it picks, so `prep cache` computes the sets once, with MONAI's
own functions over the cached label, and stores each as a bit mask (1 bit a voxel, C order of the spatial dims)
with the running count of set bits at every BLOCK_BITS: the k-th member is a search over the counts and one
block's bits (`MaskSet`). A crop's draw then reads a few KB and never the label.

Layout, one folder per crop signature (what the sets depend on: kind, label key, image key and threshold)::

    CACHE/sampling/<signature hash>/
      sets.npy          one row per (item, set) in item order (SETS_DTYPE): where its mask lies, its counts
      bits.bin          per row: the mask (padded to 8 bytes), then int64 running counts (nblocks + 1)
      manifest.json     written last: signature, the cache generation the sets were made from, checksums

Untrusted like the rest of a cache: the manifest carries its own checksum and the files' per-MiB xxh3
(checked as read); every file opened by `loaders.opener` (no link, no FIFO, confined to the cache); rows read
into memory and checked on open (order, counts, extents inside bits.bin, no overlap), each item's bits read and
checked again on use, with its counts (monotone, ending at the set's size, at most BLOCK_BITS per block).
`prep verify` checks the sets against the cached label they were made from (prep.cache_verify).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.checksums import FileCheck, doc_checksum, file_record
from loaders.cache.layout import npy_array
from loaders.cache.spec import MAX_MANIFEST
from loaders.errors import ChecksumError, FormatError, UnsafeFileError
from loaders.opener import create_new, folder_to_write, read_in

SCHEMA = "1.0"
DIR = "sampling"
MANIFEST = "manifest.json"
SETS = "sets.npy"
BITS = "bits.bin"
BLOCK_BITS = 4096  # bits per counted block: a select unpacks at most 512 bytes
MAX_SETS = 1024  # classes per item, a bound on what a manifest may declare
MAX_ROWS_BYTES = 1 << 30  # sets.npy is read into memory: at most this
_FIX = "re-run `prep sampling` to remake them"
_OUT_FIX = "remove it, or choose another output folder (prep never writes through a link)"
SETS_DTYPE = np.dtype(
    [("item", "<u4"), ("set", "<u2"), ("offset", "<u8"), ("nvox", "<u8"), ("count", "<u8")]
)  # fmt: skip


def signature(transform: Any) -> dict[str, Any] | None:
    """What a label-driven crop's sets depend on, or None when `transform` draws from no prepared sets
    (another transform, or one given its indices by the user: `fg_indices_key`, `indices_key`)."""
    from monai.transforms import RandCropByLabelClassesd, RandCropByPosNegLabeld

    cls = type(transform)
    if cls is RandCropByPosNegLabeld:
        if transform.fg_indices_key is not None or transform.bg_indices_key is not None:
            return None
        kind, extra = "posneg", {}
    elif cls is RandCropByLabelClassesd:
        if transform.indices_key is not None:
            return None
        kind, extra = "classes", {"num_classes": transform.cropper.num_classes}
    else:
        return None
    threshold = float(transform.cropper.image_threshold)
    return {"kind": kind, "label_key": str(transform.label_key),
            "image_key": None if transform.image_key is None else str(transform.image_key),
            "image_threshold": threshold if transform.image_key is not None else 0.0, **extra}  # fmt: skip


def folder(cache_root: str | os.PathLike[str], sig: Mapping[str, Any]) -> Path:
    """Where the sets of signature `sig` live in a cache."""
    digest = hashlib.sha256(json.dumps(dict(sig), sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_root) / DIR / digest


def compute_sets(sig: Mapping[str, Any], label: Any, image: Any = None) -> list[np.ndarray]:
    """One item's sets as bool masks over the flattened spatial dims, from MONAI's own index functions
    (so every quirk of theirs, such as uint8 labels' bitwise not, is kept)."""
    from monai.transforms.utils import map_binary_to_indices, map_classes_to_indices

    nvox = math.prod(label.shape[1:])
    if sig["kind"] == "posneg":
        lists = list(map_binary_to_indices(label, image, sig["image_threshold"]))
    else:
        lists = map_classes_to_indices(label, sig.get("num_classes"), image, sig["image_threshold"])
    masks = []
    for idx in lists:
        mask = np.zeros(nvox, dtype=bool)
        mask[np.asarray(idx, dtype=np.int64).reshape(-1)] = True
        masks.append(mask)
    return masks


def _packed(mask: np.ndarray) -> tuple[bytes, int]:
    """A mask's bits (little bit order, padded to 8 bytes) and its running block counts, as stored."""
    bits = np.packbits(mask, bitorder="little")
    bits = np.concatenate([bits, np.zeros(-len(bits) % 8, dtype=np.uint8)])
    nblocks = -(-len(mask) // BLOCK_BITS)
    starts = np.arange(nblocks, dtype=np.int64) * (BLOCK_BITS // 8)
    per_block = np.add.reduceat(_POPCOUNT[bits], starts, dtype=np.int64) if nblocks else np.zeros(0, np.int64)
    cum = np.zeros(nblocks + 1, dtype="<i8")
    np.cumsum(per_block, out=cum[1:])
    return bits.tobytes() + cum.tobytes(), int(cum[-1])


_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1).astype(np.uint8)


def _stored_size(nvox: int) -> int:
    return -(-nvox // 64) * 8 + (-(-nvox // BLOCK_BITS) + 1) * 8


Packed = list[tuple[int, bytes, int]]  # one item's sets as stored: (voxels, bits and running counts, members)


def packed_sets(sig: Mapping[str, Any], label: Any, image: Any = None) -> Packed:
    """One item's sets as `write_sets` stores them, from its label (and image) as the tail sees them."""
    return [(len(m), *_packed(m)) for m in compute_sets(sig, label, image)]


def write_sets(
    cache_root: str | os.PathLike[str],
    sig: Mapping[str, Any],
    sets_of: Callable[[int], Packed],
    n_items: int,
    generation: str,
    workers: int = 2,
) -> Path:
    """Commit every item's sets (`sets_of(item)`, as `packed_sets` makes them; on `workers` threads): bits and
    rows first, the manifest last (an interrupted run leaves no manifest and is redone)."""
    where = folder(cache_root, sig)
    held = folder_to_write(cache_root, os.path.relpath(where, cache_root), _OUT_FIX)  # no link below the cache
    try:
        _write_held(held, where, sig, sets_of, n_items, generation, workers)
    finally:
        os.close(held)
    return where


def _write_held(
    held: int, where: Path, sig: Mapping[str, Any], sets_of: Callable[[int], Packed], n_items: int,
    generation: str, workers: int,
) -> None:  # fmt: skip
    """`write_sets` into the folder `held` (its descriptor; `where` names it in messages): every file made,
    checksummed and renamed relative to it."""
    with suppress(FileNotFoundError):
        os.unlink(MANIFEST, dir_fd=held)
    rows: list[tuple[int, int, int, int, int]] = []
    pos = 0
    with (
        os.fdopen(create_new(where / BITS, _OUT_FIX, dir_fd=held), "wb") as f,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        for item, sets in zip(range(n_items), _ordered(pool, sets_of, n_items, 2 * max(1, workers))):
            if len(sets) > MAX_SETS:
                raise FormatError(f"{where}: item {item} has {len(sets)} classes; at most {MAX_SETS} are kept")
            for s, (nvox, data, count) in enumerate(sets):
                f.write(data)
                rows.append((item, s, pos, nvox, count))
                pos += len(data)
        f.flush()
        os.fsync(f.fileno())
    table = np.array(rows, dtype=SETS_DTYPE)
    with os.fdopen(create_new(where / SETS, _OUT_FIX, dir_fd=held), "wb") as f:
        np.save(f, table, allow_pickle=False)
    n_sets = len(rows) // n_items if n_items else 0
    doc: dict[str, Any] = {"format": "blockprep-sampling", "schema_version": SCHEMA, "signature": dict(sig),
                           "generation": generation, "n_items": n_items, "n_sets": n_sets,
                           "block_bits": BLOCK_BITS,
                           "files": {name: file_record(where / name, held) for name in (SETS, BITS)}}  # fmt: skip
    doc["checksum"] = doc_checksum(doc)
    tmp = MANIFEST + ".tmp"
    with os.fdopen(create_new(where / tmp, _OUT_FIX, dir_fd=held), "w") as out:
        out.write(json.dumps(doc, indent=1))
    os.replace(tmp, MANIFEST, src_dir_fd=held, dst_dir_fd=held)


def _ordered(pool: ThreadPoolExecutor, fn: Callable[[int], Any], n: int, ahead: int) -> Iterator[Any]:
    """fn(0), fn(1), ... in order, at most `ahead` in flight (memory stays bounded whatever n is)."""
    futures = [pool.submit(fn, i) for i in range(min(n, ahead))]
    for i in range(n):
        got = futures[i].result()
        futures[i] = None  # type: ignore[call-overload]
        if i + ahead < n:
            futures.append(pool.submit(fn, i + ahead))
        yield got


class MaskSet:
    """One stored set as MONAI's index list looks to a draw: `len()` and `[k]` (the k-th member's flat
    index), found from the running counts and one block's bits. `picks` keeps only those members
    (`max_samples_per_class`'s even subsample), as MONAI keeps them."""

    def __init__(
        self, bits: np.ndarray, cum: np.ndarray, count: int, picks: np.ndarray | None = None, where: str = "a set"
    ) -> None:
        self._bits, self._cum, self._count, self._picks, self.where = bits, cum, count, picks, where

    def __len__(self) -> int:
        return self._count if self._picks is None else len(self._picks)

    def keeping(self, max_samples: int | None) -> MaskSet:
        """This set as `map_classes_to_indices(max_samples_per_class=max_samples)` keeps it."""
        return MaskSet(self._bits, self._cum, self._count, subsample(self._count, max_samples), self.where)

    def __getitem__(self, k: Any) -> np.int64:
        k = int(k)
        if not 0 <= k < len(self):
            raise IndexError(k)
        if self._picks is not None:
            k = int(self._picks[k])
        block = int(np.searchsorted(self._cum, k, side="right")) - 1
        step = BLOCK_BITS // 8
        chunk = np.unpackbits(self._bits[block * step : (block + 1) * step], bitorder="little")
        hits = np.flatnonzero(chunk)
        at = k - int(self._cum[block])
        if not 0 <= at < len(hits):
            raise ChecksumError(f"{self.where}: block {block} holds {len(hits)} members, its counts say more; {_FIX}")
        return np.int64(block * BLOCK_BITS + int(hits[at]))


class SetStore:
    """The sets of one signature in a cache, checked on open; `sets(item, nvox)` gives an item's `MaskSet`s."""

    def __init__(self, cache_root: str | os.PathLike[str], sig: Mapping[str, Any], generation: str | None) -> None:
        self.where = folder(cache_root, sig)
        rel = os.path.relpath(self.where, cache_root)
        doc = _read_manifest(Path(cache_root), f"{rel}/{MANIFEST}")
        if doc.get("signature") != dict(sig) or doc.get("block_bits") != BLOCK_BITS:
            raise FormatError(f"{self.where}: sets of another crop; re-run `prep sampling` to remake them")
        if doc.get("generation") != generation:
            raise FormatError(f"{self.where}: made for an earlier build of the cache; re-run `prep sampling`")
        files = doc.get("files")
        if not isinstance(files, dict) or set(files) != {SETS, BITS}:
            raise FormatError(f"{self.where / MANIFEST}: no checksums for its files; re-run `prep sampling`")
        try:
            self.files = {name: FileCheck(cache_root, f"{rel}/{name}", files[name], _FIX) for name in (SETS, BITS)}
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{self.where / MANIFEST}: bad file record ({exc}); re-run `prep sampling`") from None
        if self.files[SETS].size > MAX_ROWS_BYTES:
            raise UnsafeFileError(f"{self.where / SETS}: {self.files[SETS].size} bytes, over the "
                                  f"{MAX_ROWS_BYTES >> 20} MiB sets.npy may hold; {_FIX}")  # fmt: skip
        rows = npy_array(self.files[SETS].read(), self.where / SETS, _FIX)  # in memory, checked whole
        self.rows = _checked_rows(self.where, doc, rows, self.files[BITS].size)
        self.n_sets = int(doc["n_sets"])

    def stored(self, item: int) -> Packed:
        """Item `item`'s sets as stored, (voxels, bits and counts, members) each, read and checked now: what
        `packed_sets` makes from its label (`prep verify` compares the two)."""
        rows = self.rows[item * self.n_sets : (item + 1) * self.n_sets].tolist()
        return [(n, self.files[BITS].read(offset, _stored_size(n)), count) for _, _, offset, n, count in rows]

    def sets(self, item: int, nvox: int) -> list[MaskSet]:
        """Item `item`'s sets; FormatError when they do not cover `nvox` voxels (the label's spatial size).
        Their bits are read (and their chunks checked) on every call, never mapped: a bits.bin edited or
        truncated after open is a ChecksumError or UnsafeFileError naming it, never wrong draws or SIGBUS."""
        if not 0 <= item < len(self.rows) // max(1, self.n_sets):
            raise FormatError(f"{self.where}: no sets for item {item}; re-run `prep sampling`")
        rows = self.rows[item * self.n_sets : (item + 1) * self.n_sets].tolist()
        if not rows:
            return []
        for _, _, _, n, _ in rows:
            if n != nvox:
                raise FormatError(f"{self.where}: item {item}'s sets cover {n} voxels, its label {nvox}; "
                                  "re-run `prep sampling`")  # fmt: skip
        base = rows[0][2]
        blob = np.frombuffer(self.files[BITS].read(base, rows[-1][2] + _stored_size(rows[-1][3]) - base), np.uint8)
        out = []
        for _, _, offset, n, count in rows:
            nbits, nblocks, at = -(-n // 64) * 8, -(-n // BLOCK_BITS), offset - base
            cum = blob[at + nbits : at + nbits + 8 * (nblocks + 1)].view("<i8")
            steps = np.diff(cum)
            if cum[0] != 0 or cum[-1] != count or (steps < 0).any() or (steps > BLOCK_BITS).any():
                raise FormatError(f"{self.where}: item {item}'s counts are inconsistent; re-run `prep sampling`")
            if np.unpackbits(blob[at + n // 8 : at + nbits], bitorder="little")[n % 8 :].any():
                raise FormatError(f"{self.where / BITS}: item {item} has members past its {n} voxels; {_FIX}")
            out.append(MaskSet(blob[at : at + nbits], np.asarray(cum), count, where=str(self.where / BITS)))
        return out


def _read_manifest(root: Path, rel: str) -> dict[str, Any]:
    path = root / rel
    try:
        doc = json.loads(read_in(root, rel, _FIX, MAX_MANIFEST))
    except FileNotFoundError:
        raise FormatError(f"{path}: missing (no sampling sets); add them with `prep sampling`") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: unreadable ({type(exc).__name__}); re-run `prep sampling`") from None
    if not isinstance(doc, dict) or doc.get("format") != "blockprep-sampling":
        raise FormatError(f"{path}: not a sampling manifest; re-run `prep sampling`")
    if str(doc.get("schema_version", "")).split(".")[0] != SCHEMA.split(".")[0]:
        raise FormatError(f"{path}: sampling schema {doc.get('schema_version')!r} unknown; re-run `prep sampling`")
    if doc.get("checksum") != doc_checksum(doc):
        raise ChecksumError(f"{path}: fails its checksum (edited or damaged); re-run `prep sampling`")
    return doc


def _checked_rows(where: Path, doc: Mapping[str, Any], rows: np.ndarray, bits_size: int) -> np.ndarray:
    """sets.npy checked whole (vectorised): the declared counts, item/set order, extents inside bits.bin
    that do not overlap, counts within the voxels."""
    n_items, n_sets = doc.get("n_items"), doc.get("n_sets")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n_items, n_sets)) or not (
        0 <= n_sets <= MAX_SETS and 0 <= n_items < 1 << 32  # type: ignore[operator]
    ):
        raise FormatError(f"{where / MANIFEST}: bad n_items/n_sets; re-run `prep sampling`")
    if rows.dtype != SETS_DTYPE or rows.ndim != 1 or len(rows) != n_items * n_sets:  # type: ignore[operator]
        raise FormatError(f"{where / SETS}: not {n_items} x {n_sets} rows of the sets layout; re-run `prep sampling`")
    want_item = np.repeat(np.arange(n_items, dtype=np.int64), n_sets)  # type: ignore[arg-type]
    want_set = np.tile(np.arange(n_sets, dtype=np.int64), n_items)  # type: ignore[arg-type]
    nvox = rows["nvox"].astype(np.float64)  # float: no wrap of a crafted 2^64 - 1
    size = -(-nvox // 64) * 8 + (-(-nvox // BLOCK_BITS) + 1) * 8
    start = rows["offset"].astype(np.float64)
    bad = (
        (rows["item"] != want_item).any()
        or (rows["set"] != want_set).any()
        or (rows["offset"] % 8 != 0).any()
        or (start + size > bits_size).any()
        or (rows["count"] > rows["nvox"]).any()
        or (len(rows) > 1 and (start[1:] < start[:-1] + size[:-1]).any())
    )
    if bad:
        raise FormatError(f"{where / SETS}: rows out of order, overlapping or outside {BITS}; re-run `prep sampling`")
    return rows


def stored_signatures(cache_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The signature of every set folder of a cache (`prep verify` checks each against the label); FormatError
    for a folder whose manifest is damaged or names a signature other than its folder's."""
    top = Path(cache_root) / DIR
    if not os.path.isdir(top) or os.path.islink(top):
        return []
    out = []
    for name in sorted(n for n in os.listdir(top) if not n.startswith(".")):
        sig = _read_manifest(Path(cache_root), f"{DIR}/{name}/{MANIFEST}").get("signature")
        if not isinstance(sig, dict) or folder(cache_root, sig).name != name:
            raise FormatError(f"{top / name}: its manifest names the sets of another crop; {_FIX}")
        out.append(sig)
    return out


def open_store(cache: Any, sig: Mapping[str, Any]) -> SetStore | None:
    """The cache's sets for `sig`, or None when it has none (made before sets existed, or for another crop)."""
    if not os.path.lexists(folder(cache.root, sig) / MANIFEST):
        return None
    return SetStore(cache.root, sig, cache.generation)


def subsample(n: int, max_samples: int | None) -> np.ndarray | None:
    """The members MONAI's `map_classes_to_indices(max_samples_per_class=)` keeps of a set of `n`."""
    if max_samples and n > max_samples and n > 1:
        return np.round(np.linspace(0, n - 1, max_samples)).astype(int)
    return None


def shape_only(shape: Sequence[int]) -> np.ndarray:
    """An array of `shape` holding no memory: what MONAI's draw reads `.shape` from."""
    return np.broadcast_to(np.zeros((), dtype=bool), tuple(shape))
