"""Helpers shared by tests that build files on loop-mounted filesystems."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

# the Debian/Ubuntu package of each tool the loop-device tests run (losetup is in `mount`, not `util-linux`)
LOOP_TOOLS = {"losetup": "mount", "mkfs.ext4": "e2fsprogs", "mkfs.xfs": "xfsprogs"}


def loop_reason(*fstypes: str) -> str | None:
    """Why loop-mounted `fstypes` images cannot be made here, naming exactly what is missing; None if they can."""
    if os.geteuid() != 0:
        return "loop mounts need root"
    tools = ["losetup", *(f"mkfs.{t}" for t in fstypes)]
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        packages = " ".join(dict.fromkeys(LOOP_TOOLS.get(t, "?") for t in missing))
        return f"{' and '.join(missing)} missing (apt-get install {packages})"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control: loop devices are not permitted in this container"
    return None


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


def fill_free_space(mnt: Path, byte: int) -> None:
    """Write `byte` into every free block of the filesystem (then delete the filler): blocks a file left
    behind now hold other bytes."""
    chunk = bytes([byte]) * (1 << 20)
    with open(mnt / "filler", "wb") as f:
        try:
            while True:
                f.write(chunk)
        except OSError:  # ENOSPC: every free block is taken
            pass
        with contextlib.suppress(OSError):
            f.flush()
        os.fsync(f.fileno())
    (mnt / "filler").unlink()


def evict_tree(root: Path) -> None:
    """Every file under `root` out of the page cache (written out first): a raw reader that reads from memory
    what memory holds (`BmapSource`) then reads these raw."""
    os.sync()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def unmount(mountpoint: Path, wait_s: float = 30.0) -> None:
    """Unmount, waiting while the mount is busy (a test's worker processes still closing their files in it, as a
    dask cluster's do after its run returns); still busy after `wait_s`, detached lazily (it leaves the namespace
    at once, the filesystem when its last file closes), so no test leaves a mount behind."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        done = subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True, text=True)
        if done.returncode == 0 or "not mounted" in done.stderr or not mountpoint.is_mount():
            return
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
            return
        time.sleep(0.2)
