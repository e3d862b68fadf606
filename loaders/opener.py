"""The one way a reader opens a file of a cache or a block map: confined, a regular file, never through a link.

A cache or a map someone else made is untrusted input, and so is the folder it lies in: any name in it may be
a symlink to a file elsewhere, a FIFO that blocks `open()` forever, or a file swapped or edited after a check.
`open_in(root, rel)` walks from the root one component at a time (`openat` with O_NOFOLLOW on every folder and
on the file), opens with O_NONBLOCK (a FIFO never hangs), `fstat`s the descriptor and refuses anything but a
regular file, and bounds its size before a byte is allocated. `read_in` reads such a file whole into memory
(layout files are checked there, never mapped: a mapping shows later edits and dies of SIGBUS on truncation).
Every refusal is one `UnsafeFileError` line naming the file and the fix. The root itself is the caller's
argument and may be reached through links; nothing below it may.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from loaders.errors import UnsafeFileError

_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink"),
          (stat.S_ISREG, "a regular file"))  # fmt: skip


def kind(mode: int) -> str:
    """What a file of `mode` is, in words ("a FIFO", "a folder", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _parts(rel: str, where: str, fix: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if os.path.isabs(rel) or ".." in parts or "\x00" in rel or not parts:
        raise UnsafeFileError(f"{where}: the name {rel[:80]!r} does not stay inside {os.path.dirname(where)}; {fix}")
    return parts


def open_in(root: str | os.PathLike[str], rel: str, fix: str, limit: int | None = None) -> tuple[int, os.stat_result]:
    """(descriptor, fstat) of the regular file `rel` under `root`, opened without following any link below
    `root`; UnsafeFileError for a link, FIFO, device, socket or folder, or a size over `limit`. FileNotFoundError
    when it is missing (callers say what that means). The caller closes the descriptor."""
    root = os.fspath(root)
    where = os.path.join(root, rel)
    parts = _parts(rel, where, fix)
    fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last:  # a device is never opened (opening one may act: rewind a tape), nor a socket (ENXIO)
                check_stat(os.path.join(root, *parts), os.lstat(part, dir_fd=fd), fix, limit)
            try:
                nxt = os.open(part, _FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO):
                    at = os.path.join(root, *parts[: i + 1])
                    what = kind(os.lstat(part, dir_fd=fd).st_mode) if _exists(part, fd) else "not a folder"
                    raise UnsafeFileError(f"{at}: is {what}, where a {'file' if last else 'folder'} of {root} "
                                          f"belongs; refused (links are never followed); {fix}") from None  # fmt: skip
                raise
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        check_stat(where, st, fix, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _exists(part: str, dir_fd: int) -> bool:
    try:
        os.lstat(part, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def check_stat(where: str, st: os.stat_result, fix: str, limit: int | None = None) -> None:
    """UnsafeFileError unless `st` is a regular file of at most `limit` bytes."""
    if not stat.S_ISREG(st.st_mode):
        why = " (links are never followed)" if stat.S_ISLNK(st.st_mode) else ""
        raise UnsafeFileError(f"{where}: is {kind(st.st_mode)}, not a regular file; refused{why}; {fix}")
    if limit is not None and st.st_size > limit:
        raise UnsafeFileError(f"{where}: {st.st_size} bytes, over the {limit} bytes such a file may hold; {fix}")


@contextmanager
def opened_in(
    root: str | os.PathLike[str], rel: str, fix: str, limit: int | None = None
) -> Iterator[tuple[int, os.stat_result]]:
    """`open_in` as a context manager: the descriptor is closed when the block ends."""
    fd, st = open_in(root, rel, fix, limit)
    try:
        yield fd, st
    finally:
        os.close(fd)


def read_fd(fd: int, size: int, where: str, fix: str, offset: int = 0) -> bytes:
    """Exactly `size` bytes at `offset` of an open file; UnsafeFileError when it holds fewer now (truncated
    under the reader)."""
    parts, got = [], 0
    while got < size:
        chunk = os.pread(fd, min(size - got, 64 << 20), offset + got)
        if not chunk:
            raise UnsafeFileError(f"{where}: ends after {offset + got} bytes, {offset + size} expected "
                                  f"(truncated while being read); {fix}")  # fmt: skip
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_in(root: str | os.PathLike[str], rel: str, fix: str, limit: int) -> bytes:
    """The whole regular file `rel` under `root` (see `open_in`), at most `limit` bytes, read into memory."""
    with opened_in(root, rel, fix, limit) as (fd, st):
        return read_fd(fd, st.st_size, os.path.join(os.fspath(root), rel), fix)


def split(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(folder, name) of a path, for a file whose folder is the root it is confined to."""
    path = os.fspath(path)
    return os.path.dirname(path) or ".", os.path.basename(path)


def open_to_write(
    path: str | os.PathLike[str], flags: int, fix: str, mode: int = 0o644, dir_fd: int | None = None
) -> int:
    """A descriptor to write the regular file `path` of an output (`prep cache`'s lock, journals, shards, temp
    files): never through a symlink (O_NOFOLLOW), never a FIFO or device (O_NONBLOCK, then fstat), never a file
    with a second name (a hard link from outside would be truncated or overwritten); UnsafeFileError otherwise.
    `dir_fd`: the descriptor of the file's folder, opened once (the file's name is taken relative to it, so a
    folder swapped for a link after that cannot redirect the write); `path` then only names it in messages."""
    path = os.fspath(path)
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        what = kind(os.lstat(name, dir_fd=dir_fd).st_mode)
        raise UnsafeFileError(f"{path}: is {what}, where a file of this output belongs; refused (nothing is "
                              f"written through a link); {fix}") from None  # fmt: skip
    try:
        st = os.fstat(fd)
        check_stat(path, st, fix)
        if st.st_nlink > 1:
            raise UnsafeFileError(f"{path}: has {st.st_nlink} names (a hard link: writing would change a file "
                                  f"outside this output); refused; {fix}")  # fmt: skip
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def folder_to_write(root: str | os.PathLike[str], rel: str, fix: str) -> int:
    """The descriptor of folder `rel` below an output's `root` (made where missing, mode 0755), every part opened
    O_DIRECTORY | O_NOFOLLOW relative to the one above: a link anywhere below `root` is refused (UnsafeFileError),
    and once held, a path swapped for a link redirects nothing written relative to it (`dir_fd=`). `root` is the
    user's argument and may be reached through links."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = os.fspath(root)
    try:
        for part in _parts(rel, where, fix):
            where = os.path.join(where, part)

            def refuse(what: str, where: str = where) -> Exception:
                return UnsafeFileError(f"{where}: is {what}, where a folder of this output belongs; refused "
                                       f"(nothing is written through a link); {fix}")  # fmt: skip

            below = made_folder(part, fd, refuse)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def made_folder(name: str, dir_fd: int, refuse: Callable[[str], Exception]) -> int:
    """The descriptor of folder `name` in the folder `dir_fd` (made where missing, mode 0755), opened
    O_DIRECTORY | O_NOFOLLOW: where `name` is a link or no folder, `refuse(what it is)` is raised."""
    with suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise refuse(kind(os.lstat(name, dir_fd=dir_fd).st_mode)) from None


def create_new(path: str | os.PathLike[str], fix: str, mode: int = 0o644, dir_fd: int | None = None) -> int:
    """A new, empty file at `path` for writing (a temp file to rename): whatever held the name is unlinked
    first, then O_CREAT | O_EXCL | O_NOFOLLOW, so nothing planted there is ever written through. `dir_fd`: as
    for `open_to_write`."""
    with suppress(FileNotFoundError):
        os.unlink(path if dir_fd is None else os.path.basename(path), dir_fd=dir_fd)
    return open_to_write(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fix, mode, dir_fd)


def safe_to_map(st: os.stat_result) -> bool:
    """Whether a file may be memory-mapped to read: only this user or root owns it, so nobody else can truncate
    it under the mapping (a read past its new end is SIGBUS, no exception). Another user's file is read instead."""
    return st.st_uid in (os.geteuid(), 0)
