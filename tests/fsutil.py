"""Helpers shared by tests that build files on loop-mounted filesystems."""

from __future__ import annotations

import os
from pathlib import Path


def interleaved_appends(mnt: Path, keys: list[str], rounds: int, piece: int = 5000) -> dict[str, bytes]:
    """Append random pieces to files under `mnt` in turn, fsync after each, so each file gets several
    extents; returns key -> content."""
    content = {k: b"" for k in keys}
    fds = {k: os.open(mnt / k, os.O_WRONLY | os.O_CREAT, 0o644) for k in keys}
    try:
        for _ in range(rounds):
            for k, fd in fds.items():
                data = os.urandom(piece)
                os.write(fd, data)
                os.fsync(fd)
                content[k] += data
    finally:
        for fd in fds.values():
            os.close(fd)
    return content
