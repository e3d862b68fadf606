"""Input checks run before an item's head: a bad file is quarantined with its path and reason, never cached.

nibabel reads a .nii.gz lazily and may never reach the gzip trailer, so a flipped byte inside the stream can
load silently; reading the whole stream here makes zlib check the CRC and length. A NIfTI's decoded bytes can
be kept (`streams_check(..., keep)`), so that the head reads them instead of inflating the file again
(`prep.inflated`). With a bound (`prep cache
--max-item-bytes`), what the header declares is compared with it first, and the stream is read no further
than the bound: a header or a stream that claims more is refused before anything is decoded.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loaders.cache.dtypes import dtype_code
from prep.errors import FormatError
from prep.item_size import declared, human

IMAGE_SUFFIXES = (".nii", ".nii.gz", ".nrrd", ".mha", ".mhd", ".npy", ".npz", ".png", ".jpg", ".jpeg", ".tif", ".tiff")
_CHUNK = 1 << 20


def input_paths(entry: Mapping[str, Any]) -> list[str]:
    """The file paths an item names: string values (or lists of them) that look like image files."""
    paths: list[str] = []
    for value in entry.values():
        values = value if isinstance(value, (list, tuple)) else [value]
        paths.extend(v for v in values if isinstance(v, str) and v.lower().endswith(IMAGE_SUFFIXES))
    return paths


def check_entry(
    entry: Mapping[str, Any], max_bytes: int | None = None, keep: dict[str, bytes] | None = None
) -> tuple[str, str] | None:
    """(path, reason) of the first bad input file of an item, or None when all look sound; with `max_bytes`,
    a file whose header declares more decoded bytes is bad; with `keep`, each sound .nii.gz's decoded bytes go
    into it by path (`streams_check`)."""
    bad, streams = split_checks(entry, max_bytes)
    return bad or streams_check(streams, keep)


Stream = Callable[[dict[str, bytes] | None], str | None]  # a .gz stream check: why it fails, or None


def split_checks(
    entry: Mapping[str, Any], max_bytes: int | None = None
) -> tuple[tuple[str, str] | None, list[tuple[str, Stream]]]:
    """The checks of an item's files in two parts: (path, reason) of the first file the cheap checks refuse
    (missing, empty, a header over `max_bytes`, an unreadable NIfTI header or dtype, a short .nii), and the
    stream checks left to run (each .gz decompressed whole so zlib checks its CRC and length, then a NIfTI's
    length against its header)."""
    streams: list[tuple[str, Stream]] = []
    for path in input_paths(entry):
        reason, later = _check_now(Path(path), max_bytes)
        if reason:
            return (path, reason), []
        if later is not None:
            streams.append((path, later))
    return None, streams


def streams_check(streams: list[tuple[str, Stream]], keep: dict[str, bytes] | None = None) -> tuple[str, str] | None:
    """(path, reason) of the first file whose stream check fails, or None; with `keep`, the decoded bytes of
    each sound .nii.gz go into it by path (for `prep.inflated.served`)."""
    for path, later in streams:
        reason = later(keep)
        if reason:
            return path, reason
    return None


def check_file(path: str | os.PathLike[str], max_bytes: int | None = None) -> str | None:
    """Why a file cannot be prepared (missing, empty, over `max_bytes` decoded, corrupt/truncated stream,
    unsupported dtype), or None."""
    reason, later = _check_now(Path(path), max_bytes)
    return reason or (later(None) if later is not None else None)


def _check_now(path: Path, max_bytes: int | None) -> tuple[str | None, Stream | None]:
    """(why the file is refused by the cheap checks, or None; the stream check left, or None)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing file", None
    except OSError as exc:
        return f"unreadable ({exc.strerror})", None
    if size == 0:
        return "empty file", None
    if max_bytes is not None and (reason := _over_bound(path, max_bytes)):
        return reason, None
    gz = path.name.lower().endswith(".gz")
    needed: int | None = None
    if path.name.lower().endswith((".nii", ".nii.gz")):
        got = _nifti_needs(path)
        if isinstance(got, str):  # a damaged stream says so first, as when the stream was read before the header
            return (_gzip_check(path, max_bytes, None) if gz else None) or got, None
        needed = got
    if not gz:
        return _truncated(size, needed), None
    nifti = needed is not None
    return None, lambda keep: _gzip_check(path, max_bytes, needed, keep if nifti else None)


def _gzip_check(
    path: Path, max_bytes: int | None, needed: int | None, keep: dict[str, bytes] | None = None
) -> str | None:
    # the header may sit in front of the voxels: 1 MiB over the bound is still no more than it declared
    limit = None if max_bytes is None else max_bytes + _CHUNK
    chunks: list[bytes] | None = [] if keep is not None else None
    try:
        data_bytes = _gzip_length(path, limit, chunks)
    except (OSError, EOFError, zlib.error) as exc:
        return f"corrupt or truncated gzip stream ({exc})"
    if limit is not None and data_bytes > limit:
        return (f"the gzip stream decompresses to more than {human(limit)}, over --max-item-bytes "
                f"{human(max_bytes or 0)}; pass a larger --max-item-bytes to prepare it")  # fmt: skip
    reason = _truncated(data_bytes, needed)
    if keep is not None and chunks is not None and reason is None:
        keep[str(path)] = b"".join(chunks)
    return reason


def _truncated(data_bytes: int, needed: int | None) -> str | None:
    if needed is not None and data_bytes < needed:
        return f"truncated NIfTI: {data_bytes} bytes, header needs {needed}"
    return None


def _over_bound(path: Path, max_bytes: int) -> str | None:
    """Why the file's header declares too much to decode, or None (also for a header that cannot be parsed:
    the checks after this one, or the head, say what is wrong with it)."""
    try:
        found = declared(path)
    except Exception as exc:  # many parsers, many kinds of damage
        if type(exc).__name__ == "DecompressionBombError":  # PIL's own bound, which the reader would hit too
            return f"{exc}"
        return None
    if found is None or found[0] <= max_bytes:
        return None
    n, what = found
    return (f"the header declares {what}: {human(n)} decoded, over --max-item-bytes {human(max_bytes)}; "
            "pass a larger --max-item-bytes to prepare it")  # fmt: skip


def _gzip_length(path: Path, limit: int | None = None, chunks: list[bytes] | None = None) -> int:
    """Decompress the stream (so zlib checks CRC32 and ISIZE); return the decompressed length (its pieces into
    `chunks` when given). Stops once the length passes `limit` (the result is then over it, and the stream's
    end unchecked)."""
    total = 0
    with gzip.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if chunks is not None:
                chunks.append(chunk)
            total += len(chunk)
            if limit is not None and total > limit:
                break
    return total


def _nifti_needs(path: Path) -> int | str:
    """The bytes a NIfTI's header says the file holds (offset + voxels), or why the header is refused."""
    import nibabel as nib
    import numpy as np

    try:
        image: Any = nib.load(path)
        header = image.header
        dtype = np.dtype(header.get_data_dtype())
        offset = getattr(image.dataobj, "offset", header.get_data_offset())
        needed = int(offset) + int(np.prod(header.get_data_shape())) * dtype.itemsize
    except Exception as exc:  # nibabel raises many kinds on a damaged header
        return f"unreadable NIfTI header ({type(exc).__name__}: {exc})"
    # the file's byte order is no reason to refuse it: the head's output dtype is judged when it is stored
    # (MONAI converts big-endian data on load); complex and structured voxels have no faithful stored form
    try:
        dtype_code(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    except FormatError as exc:
        return f"unsupported dtype: {exc}"
    return needed


def input_stats(entry: Mapping[str, Any]) -> dict[str, list[int] | None]:
    """{path: [size, mtime_ns] or None when absent} of the files an item names: recorded with a quarantine,
    so a later run knows whether a file was restored or replaced since."""
    stats: dict[str, list[int] | None] = {}
    for path in input_paths(entry):
        try:
            st = os.stat(path)
            stats[path] = [st.st_size, st.st_mtime_ns]
        except OSError:
            stats[path] = None
    return stats


def to_retry(quarantined: list[dict[str, Any]], max_bytes: int) -> list[int]:
    """Items of a committed cache's quarantine worth preparing again: a file they name changed since
    (restored, replaced, removed), or they were refused by a smaller --max-item-bytes than `max_bytes`.
    Records written before inputs were recorded are left as they are (`--force` rebuilds)."""
    out = []
    for q in quarantined:
        inputs = q.get("inputs")
        if not isinstance(inputs, dict):
            continue
        changed = any(input_stats({"f": path}).get(path) != old for path, old in inputs.items())
        bound = q.get("max_item_bytes")
        if changed or (isinstance(bound, int) and max_bytes > bound):
            out.append(int(q["item"]))
    return out
