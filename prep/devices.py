"""Where a filesystem lives: mountpoint -> block device, partition start, logical block size, type, UUID.

FIEMAP reports physical offsets relative to the filesystem's own device (a partition, a loop device).
A reader of the whole disk must add the partition start; a reader of a loop device's image file must
add the loop offset. Everything comes from /proc/self/mountinfo and sysfs; the UUID from the superblock
(ext2/3/4, xfs), /dev/disk/by-uuid, or is left unknown.
"""

from __future__ import annotations

import os
import re
import uuid as _uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prep.errors import UnsupportedFilesystemError

SECTOR = 512  # sysfs `start` and `size` are in 512-byte units whatever the logical block size

# Filesystems whose FIEMAP "physical" addresses are not offsets on one block device.
_MULTI_DEVICE_FS = {
    "btrfs": "btrfs addresses span several devices (its FIEMAP physical is a logical address)",
    "bcachefs": "bcachefs may span several devices",
    "zfs": "zfs pools span several devices",
}


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    major: int
    minor: int
    mountpoint: str
    fstype: str
    source: str


@dataclass(frozen=True)
class DeviceInfo:
    """The block device under a mountpoint and what a raw reader needs to know about it."""

    mountpoint: str
    fstype: str
    source: str  # as mounted (may be a symlink name)
    device: str  # /dev/<name> of the filesystem's own block device
    major: int
    minor: int
    disk: str  # /dev/<name> of the whole disk (same as device when not a partition)
    partition_start: int  # bytes from the start of `disk` to the start of `device`
    logical_block_size: int  # LBA size of `disk` (bytes)
    fs_block_size: int
    uuid: str | None
    loop_backing_file: str | None  # for loop devices: the image file, readable without root
    loop_offset: int  # bytes into the image file where the loop device starts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse /proc/self/mountinfo text into Mounts, in file order."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        major, minor = (int(x) for x in fields[2].split(":"))
        mounts.append(Mount(major, minor, _unescape(fields[4]), tail[0], _unescape(tail[1]) if len(tail) > 1 else ""))
    return mounts


def find_mount(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount:
    """The mount that holds `path` (longest mountpoint prefix with the same device; the last one wins)."""
    real = os.path.realpath(path)
    st_dev = os.stat(real).st_dev
    if mounts is None:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())

    def under(mp: str) -> bool:
        return real == mp or real.startswith(mp.rstrip("/") + "/")

    same = [m for m in mounts if under(m.mountpoint) and (m.major, m.minor) == (os.major(st_dev), os.minor(st_dev))]
    pool = same or [m for m in mounts if under(m.mountpoint)]
    if not pool:
        raise UnsupportedFilesystemError(f"{path}: no mount found for it in /proc/self/mountinfo")
    best = max(len(m.mountpoint) for m in pool)
    return [m for m in pool if len(m.mountpoint) == best][-1]


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def superblock_uuid(path: str, offset: int = 0) -> str | None:
    """UUID from an ext2/3/4 or xfs superblock at byte `offset` of `path` (a device or image); None if unknown."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            head = f.read(2048)
    except OSError:
        return None
    if head[:4] == b"XFSB":
        return str(_uuid.UUID(bytes=head[32:48]))
    if len(head) >= 1024 + 0x78 and head[1024 + 0x38 : 1024 + 0x3A] == b"\x53\xef":
        return str(_uuid.UUID(bytes=head[1024 + 0x68 : 1024 + 0x78]))
    return None


def _uuid_by_link(device: str) -> str | None:
    by_uuid = Path("/dev/disk/by-uuid")
    try:
        for link in by_uuid.iterdir():
            if os.path.realpath(link) == device:
                return link.name
    except OSError:
        pass
    return None


def device_info(mountpoint: str | os.PathLike[str], sys_root: Path = Path("/sys")) -> DeviceInfo:
    """Describe the block device that holds `mountpoint` (any path on it works); `check_mappable` refuses."""
    mount = find_mount(mountpoint)
    sysdev = sys_root / "dev" / "block" / f"{mount.major}:{mount.minor}"
    if mount.major == 0 or not sysdev.exists():
        raise UnsupportedFilesystemError(
            f"{mountpoint}: {mount.fstype} at {mount.mountpoint} is not on a block device "
            f"(source {mount.source!r}); block maps need a filesystem on a local disk, partition or loop device"
        )
    node = Path(os.path.realpath(sysdev))
    name = node.name
    is_part = (node / "partition").exists()
    disk_node = node.parent if is_part else node
    start = _read_int(node / "start") * SECTOR if is_part else 0
    lbs = _read_int(disk_node / "queue" / "logical_block_size", SECTOR)
    backing, loop_offset = None, 0
    loop_dir = disk_node / "loop"
    if loop_dir.is_dir():
        backing = (loop_dir / "backing_file").read_text().strip() or None
        loop_offset = _read_int(loop_dir / "offset")
    device = f"/dev/{name}"
    uuid = None
    if os.access(device, os.R_OK):
        uuid = superblock_uuid(device)
    if uuid is None and backing:
        uuid = superblock_uuid(backing, loop_offset + start)
    if uuid is None:
        uuid = _uuid_by_link(device)
    return DeviceInfo(
        mountpoint=mount.mountpoint,
        fstype=mount.fstype,
        source=mount.source,
        device=device,
        major=mount.major,
        minor=mount.minor,
        disk=f"/dev/{disk_node.name}",
        partition_start=start,
        logical_block_size=lbs,
        fs_block_size=os.statvfs(mountpoint).f_bsize,
        uuid=uuid,
        loop_backing_file=backing,
        loop_offset=loop_offset,
    )


def check_mappable(info: DeviceInfo) -> None:
    """Raise UnsupportedFilesystemError when raw reads through FIEMAP addresses would be wrong here."""
    where = f"{info.mountpoint} ({info.fstype} on {info.device})"
    if info.fstype in _MULTI_DEVICE_FS:
        raise UnsupportedFilesystemError(f"{where}: {_MULTI_DEVICE_FS[info.fstype]}; copy the data to ext4 or xfs")
    name = Path(info.disk).name
    if name.startswith("dm-"):
        raise UnsupportedFilesystemError(
            f"{where}: device-mapper (LVM, crypt, multipath) remaps blocks, so FIEMAP addresses are not "
            "disk addresses; map a filesystem on a plain partition or loop device"
        )
    if name.startswith("md"):
        raise UnsupportedFilesystemError(
            f"{where}: md RAID stripes blocks over several disks; map a filesystem on a plain partition"
        )
