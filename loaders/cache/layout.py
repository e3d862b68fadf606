"""Checks of a cache's layout before anything it says is used: a cache someone else made is untrusted input.

Checksums in the manifest catch accidents; anyone who edits a cache can recompute them. So on open (and in
`prep verify`) every path the manifest names must resolve to a regular file inside the cache directory, and
every count, size, shape and offset of the index must agree with the real sizes of the files, before a byte
is allocated or read on their word. All index checks are vectorised (a million-row index in well under a
second). Each failure is one FormatError line naming the file and the fix.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.dtypes import np_dtype
from loaders.errors import FormatError

_FIX = "rebuild it with `prep cache --force` (or ask whoever made it)"
_LINKS = "copy the cache with `cp -r` (or rebuild it) so no file outside it shares the shard's bytes"

# Shards as checked when their cache was opened: path -> (st_dev, st_ino, follow). Every open of a cache shard
# by path (backends, region reads, `prep verify`) goes through `open_read`, which refuses any other file.
_PINS: dict[str, tuple[int, int, bool]] = {}


def shard_paths(root: Path, names: Any, allow_outside: bool = False) -> list[Path]:
    """The manifest's shard names as paths: relative, inside `root` once symlinks are resolved, regular files.

    allow_outside=True accepts shards that resolve elsewhere (a cache whose shards were moved on purpose);
    they must still be regular files."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FormatError(f"{root}/manifest.json: 'shards' is not a list of names; {_FIX}")
    real_root = os.path.realpath(root)
    out = []
    seen: dict[str, str] = {}
    for name in names:
        if "\x00" in name:
            raise FormatError(f"{root}/manifest.json: shard name {name[:60]!r} holds a NUL; {_FIX}")
        path = root / name
        real = os.path.realpath(path)
        if real in seen:  # a second name for one shard would let two index extents overlap unseen
            raise FormatError(
                f"{root}/manifest.json: shard {name[:60]!r} names the same file as {seen[real][:60]!r}; {_FIX}"
            )
        seen[real] = name
        outside = os.path.isabs(name) or ".." in Path(name).parts or os.path.commonpath([real_root, real]) != real_root
        if outside and not allow_outside:
            raise FormatError(
                f"{path}: shard {name!r} resolves outside the cache directory ({real}); refused "
                "(pass allow_outside=True only for a cache you made yourself)"
            )
        try:
            st = os.stat(real)
        except OSError:
            out.append(path)  # missing: said when it is read (prep verify lists it)
            continue
        check_shard_stat(str(path), st)
        pin(str(path), st, follow=os.path.islink(path))
        out.append(path)
    return out


def check_shard_stat(path: str, st: os.stat_result) -> None:
    """FormatError unless `st` is a regular file with one link (a hard link from outside the cache would let
    whoever holds it change or read the cache's bytes behind every check)."""
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path}: shard is not a regular file (a device, FIFO or folder); refused")
    if st.st_nlink > 1:
        raise FormatError(f"{path}: shard has {st.st_nlink} links; {_LINKS}")


def pin(path: str, st: os.stat_result, follow: bool = False) -> None:
    """Record the file checked at `path`: later opens through `open_read` must find this very file."""
    _PINS[path] = (st.st_dev, st.st_ino, follow)


def open_read(path: str, flags: int = os.O_RDONLY) -> int:
    """Open a file to read. A pinned cache shard opens only as the file checked when its cache was opened:
    no symlink put in its place (O_NOFOLLOW), no hang on a FIFO (O_NONBLOCK), a regular file with one link,
    the same device and inode; anything else is one FormatError line. Other paths open plainly."""
    pinned = _PINS.get(path)
    if pinned is None:
        return os.open(path, flags)
    dev, ino, follow = pinned
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path}: shard was replaced by a symlink after the cache was opened; {_SWAP}") from None
        raise
    try:
        st = os.fstat(fd)
        check_shard_stat(path, st)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise FormatError(f"{path}: shard is another file than the one checked when the cache was opened; {_SWAP}")
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def checked_path(path: str) -> Iterator[str]:
    """A name for exactly the file `open_read` checks, for libraries that open files by name (kvikio, xNVMe):
    /proc/self/fd/N of a checked descriptor while the block runs; a path that is no cache shard as it is."""
    if path not in _PINS:
        yield path
        return
    fd = open_read(path)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


_SWAP = "refused (someone replaced it); reopen the cache, or rebuild it with `prep cache --force`"


def check_counts(root: Path, manifest: Mapping[str, Any], meta_lines: int) -> int:
    """n_items from the manifest, checked against the meta offsets on disk (one line per item; an item may
    have no tensors, so the index bounds nothing here)."""
    n = manifest.get("n_items")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise FormatError(f"{root}/manifest.json: n_items {str(n)[:40]!r} is not a count; {_FIX}")
    if n != meta_lines:
        raise FormatError(f"{root}/manifest.json: n_items {n} but meta_offsets.npy has {meta_lines} lines; {_FIX}")
    keys = manifest.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise FormatError(f"{root}/manifest.json: 'keys' is not a list of names; {_FIX}")
    twice = sorted({k for k in keys if keys.count(k) > 1}) if len(set(keys)) != len(keys) else []
    if twice:
        raise FormatError(f"{root}/manifest.json: key {twice[0][:60]!r} is listed twice in 'keys'; {_FIX}")
    return n


def npy_array(data: bytes, where: Path | str, fix: str = _FIX, what: str = "an .npy array") -> np.ndarray:
    """The array of an .npy file's bytes, read-only and sharing them: header parsed by numpy's own reader, never
    pickled objects, C order, and exactly as many bytes as its shape and dtype make; FormatError otherwise."""
    import io

    from numpy.lib import format as npy

    f = io.BytesIO(data)
    try:
        read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(npy.read_magic(f))
        if read is None:
            raise ValueError("an .npy version prep does not write")
        shape, fortran, dtype = read(f, max_header_size=10_000)
    except (ValueError, TypeError, SyntaxError, EOFError) as exc:
        raise FormatError(f"{where}: not {what} ({str(exc)[:80]}); {fix}") from None
    if fortran or dtype.hasobject or len(shape) > 8:
        raise FormatError(f"{where}: not {what} (objects or Fortran order, not what `prep` writes); {fix}")
    count = float(np.prod(np.asarray(shape, dtype=np.float64)))
    if count * dtype.itemsize != len(data) - f.tell():
        raise FormatError(f"{where}: not {what} (the header's shape {str(shape)[:60]} does not match the file's "
                          f"{len(data)} bytes); {fix}")  # fmt: skip
    return np.frombuffer(data, dtype=dtype, count=int(count), offset=f.tell()).reshape(shape)


def check_offsets(path: Path, offsets: np.ndarray, meta_size: int) -> np.ndarray:
    """meta_offsets.npy (as `npy_array` parsed it), checked to be what `write_meta` writes: a 1-D integer array
    (never pickled objects), starting at 0, never decreasing, every offset inside meta.jsonl; FormatError
    in one line otherwise (checked whole: one vectorised pass, 8 bytes per item)."""
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise FormatError(f"{path}: offsets are a {offsets.ndim}-D {offsets.dtype} array, not 1-D integers; {_FIX}")
    if not len(offsets):
        return offsets
    wide = offsets.astype(np.float64)  # uint64 past 2^63 and negative int64 alike compare right
    if wide[0] != 0 or np.any(wide[1:] < wide[:-1]):
        raise FormatError(f"{path}: offsets do not start at 0 and rise (negative or decreasing); {_FIX}")
    if wide[-1] >= meta_size:
        raise FormatError(f"{path}: an offset points past the end of meta.jsonl ({meta_size} bytes); {_FIX}")
    return offsets


def check_index(
    where: Path, index: np.ndarray, n_items: int, n_keys: int, dtypes: Sequence[str], shard_sizes: Sequence[int]
) -> None:
    """The index agrees with itself and with the shards: items in order and below n, each key once per item, known
    dtypes, shapes whose byte count (no wrap-around) is nbytes, aligned extents inside their shard's real
    size (a missing shard: size -1, extents not checked), no two extents overlapping."""
    if not len(index):  # a head with no tensor outputs
        return
    item, key, shard = index["item"], index["key"], index["shard"]  # views: each check is one pass, no copies
    if np.any(item[1:] < item[:-1]) or int(item[-1]) >= n_items:
        raise FormatError(f"{where}: index rows are not items 0..{n_items - 1} in order (edited?); {_FIX}")
    if int(key.max()) >= n_keys or np.any((item[1:] == item[:-1]) & (key[1:] <= key[:-1])):
        raise FormatError(f"{where}: index keys are not each key once per item, in order; {_FIX}")
    if int(shard.max()) >= len(shard_sizes) or int(index["dtype"].max()) >= len(dtypes):
        raise FormatError(f"{where}: index names a shard or dtype the manifest does not have; {_FIX}")
    _check_sizes(where, index, dtypes)
    check_extents(where, index, shard, shard_sizes)


def _check_sizes(where: Path, index: np.ndarray, dtypes: Sequence[str]) -> None:
    ndim = index["ndim"]
    shape = index["shape"].astype(np.float64)  # float: a product past 2^64 shows as large, never wraps
    if np.any(shape >= 2.0**62):
        raise FormatError(f"{where}: an index row has a size of 2^62 or more (edited?); {_FIX}")
    if int(ndim.max()) > shape.shape[1]:
        raise FormatError(f"{where}: an index row has more dims than the layout holds; {_FIX}")
    used = np.arange(shape.shape[1], dtype=np.uint8)[None, :] < ndim[:, None]
    if np.any(np.where(used, 0.0, shape)):
        raise FormatError(f"{where}: an index row has sizes past its ndim (edited?); {_FIX}")
    itemsize = np.array([np_dtype(d).itemsize for d in dtypes], dtype=np.float64)[index["dtype"]]
    exact = np.where(used, shape, 1.0).prod(axis=1) * itemsize
    if np.any(exact >= 2.0**62) or np.any(exact != index["nbytes"]):
        raise FormatError(f"{where}: an index row's shape and dtype do not make its nbytes (edited?); {_FIX}")


def check_extents(
    where: Path, index: np.ndarray, shard: np.ndarray, shard_sizes: Sequence[int], fix: str = _FIX
) -> None:
    """Rows' extents (`offset`, `nbytes` in the file `shard` names): 4 KiB-aligned, inside the file's real size (-1:
    missing, not checked), none overlapping another in one file."""
    offset, nbytes = index["offset"], index["nbytes"]
    if np.any(offset & np.uint64(4095)) or int(offset.max()) >= 1 << 62:
        raise FormatError(f"{where}: an index offset is not 4 KiB-aligned or out of range; {fix}")
    end = offset + nbytes  # both below 2^62 (checked): no wrap-around
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    limit = np.where(sizes >= 0, sizes, np.iinfo(np.int64).max).astype(np.uint64)[shard]
    if np.any(end > limit):
        raise FormatError(f"{where}: an index extent runs past the end of its shard (edited or truncated); {fix}")
    order = np.argsort(offset, kind="stable") if len(sizes) == 1 else np.lexsort((offset, shard))
    s, o, e = shard[order], offset[order], end[order]
    if np.any((s[1:] == s[:-1]) & (o[1:] < e[:-1])):
        raise FormatError(f"{where}: two index extents overlap in one shard (edited?); {fix}")


def file_size(path: Path) -> int:
    """A regular file's size, -1 when it is missing."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
