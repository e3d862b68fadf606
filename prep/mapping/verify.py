"""`prep bmap verify`: read every mapped range from the raw device and compare with the filesystem."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.blockmap.bmap import BlockMap
from loaders.cache.format import checksum
from prep.errors import PrepError, UsageError


@dataclass(frozen=True)
class Mismatch:
    """A mapped range whose raw bytes differ from the filesystem's (or a file that changed since mapping)."""

    key: str
    path: str
    extent: int | None  # index into the entry's extents; None for whole-file problems
    logical: int
    physical: int
    nbytes: int
    detail: str

    def __str__(self) -> str:
        where = f"extent {self.extent} (file byte {self.logical}, device byte {self.physical}, {self.nbytes} bytes)"
        return f"{self.path}: {where if self.extent is not None else 'file'}: {self.detail}"


_VERIFY_CHUNK = 8 << 20  # long extents are compared in pieces to bound memory


def _verify_entry(bmap: BlockMap, raw: Any, base: int, key: str) -> list[Mismatch]:
    from loaders.backends.blockdev import aligned_empty

    e = bmap.entry(key)
    path = bmap.file_path(key)
    stale = bmap.stale_reason(key)
    if stale:
        return [Mismatch(key, path, None, 0, 0, e.size, f"changed since it was mapped ({stale})")]
    out: list[Mismatch] = []
    with open(path, "rb", buffering=0) as f:
        for i, (logical, physical, length, _flags) in enumerate(e.extents):
            end = min(logical + length, e.size)
            for lo in range(logical, end, _VERIFY_CHUNK):
                n = min(_VERIFY_CHUNK, end - lo)
                dev = aligned_empty(n)[:n]
                raw.read_into(base + physical + (lo - logical), dev.data)
                fs = os.pread(f.fileno(), n, lo)
                if bytes(dev) != fs:
                    at = next(j for j in range(min(n, len(fs))) if dev[j] != fs[j]) if len(fs) == n else len(fs)
                    out.append(Mismatch(key, path, i, logical, physical, length, f"differs at file byte {lo + at}"))
                    break
        if e.xxh3 is not None and not out and checksum(f.read()) != e.xxh3:
            out.append(Mismatch(key, path, None, 0, 0, e.size, "content differs from the checksum stored at mapping"))
    return out


def verify_bmap(
    bmap_path: Path,
    device: Path | None = None,
    *,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> list[Mismatch]:
    """Read every mapped range of every raw-readable file from the raw device (or the loop image file) and
    compare with a read through the filesystem; returns the mismatches ([] when the map is right)."""
    from loaders.backends.blockdev import RawDevice

    bmap = BlockMap.load(bmap_path)
    if bmap.flat:
        raise UsageError(f"{bmap_path}: a flat startblock/endblock map cannot be verified; verify the full map")
    src = bmap.source(device)
    if bmap.uuid:
        from prep.devices import superblock_uuid

        found = superblock_uuid(src.path, src.base)
        if found and found != bmap.uuid:
            raise UsageError(f"{src.path}: holds filesystem {found}, but {bmap_path} maps {bmap.uuid}; wrong device")
    raw = RawDevice(src.path)
    keys = [k for k in bmap.files if bmap.files[k]["raw_readable"]]
    mismatches: list[Mismatch] = []
    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            for found_mm in pool.map(lambda k: _verify_entry(bmap, raw, src.base, k), keys):
                mismatches.extend(found_mm)
                if progress is not None:
                    progress(1)
    except OSError as err:
        raise PrepError(f"{src.path}: read failed ({err.strerror}); check the device") from None
    finally:
        raw.close()
    return mismatches
