"""prep.devices: mountinfo parsing, device facts of real loop mounts, and the refusals."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prep.devices import DeviceInfo, check_mappable, device_info, find_mount, parse_mountinfo, superblock_uuid
from prep.errors import UnsupportedFilesystemError

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 7:3 / /mnt/with\\040space rw,relatime shared:5 master:1 - xfs /dev/loop3 rw,attr2
31 30 7:4 / /mnt/with\\040space/inner rw - ext4 /dev/loop4 rw
"""


def test_parse_mountinfo_handles_escapes_and_optional_fields() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert [(m.major, m.minor, m.mountpoint, m.fstype, m.source) for m in mounts] == [
        (0, 21, "/proc", "proc", "proc"),
        (254, 0, "/", "ext4", "/dev/vda"),
        (7, 3, "/mnt/with space", "xfs", "/dev/loop3"),
        (7, 4, "/mnt/with space/inner", "ext4", "/dev/loop4"),
    ]


def test_find_mount_of_this_checkout() -> None:
    m = find_mount(Path(__file__))
    assert Path(__file__).resolve().as_posix().startswith(m.mountpoint.rstrip("/") + "/")


@pytest.mark.loopdev
@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_device_info_of_a_loop_mount(make_loopfs: Callable[..., Any], fstype: str) -> None:
    fs = make_loopfs(fstype, offset=1 << 20)
    (fs.mountpoint / "sub").mkdir()
    info = device_info(fs.mountpoint / "sub")  # any path on the filesystem names the same device
    assert (info.mountpoint, info.fstype, info.device, info.disk) == (str(fs.mountpoint), fstype, fs.device, fs.device)
    assert info.partition_start == 0 and info.loop_offset == 1 << 20
    assert info.loop_backing_file == str(fs.image)
    lbs = int(Path(f"/sys/block/{Path(fs.device).name}/queue/logical_block_size").read_text())
    assert info.logical_block_size == lbs and info.fs_block_size >= 512
    blkid = subprocess.run(["blkid", "-p", "-o", "value", "-s", "UUID", fs.device], capture_output=True, text=True)
    assert info.uuid == blkid.stdout.strip() != ""
    # the superblock read through the image file at the loop offset gives the same UUID (no root needed)
    assert superblock_uuid(str(fs.image), 1 << 20) == info.uuid
    assert superblock_uuid(str(fs.image), 0) is None  # the first MiB is not a filesystem
    check_mappable(info)  # ext4/xfs on a loop device: fine


def test_not_on_a_block_device() -> None:
    with pytest.raises(UnsupportedFilesystemError, match="/dev/shm: tmpfs .* not on a block device"):
        device_info("/dev/shm")


BASE = DeviceInfo("/mnt/x", "ext4", "/dev/sda1", "/dev/sda1", 8, 1, "/dev/sda", 1 << 20, 512, 4096, None, None, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fstype": "btrfs"}, "btrfs addresses span several devices"),
        ({"fstype": "zfs"}, "zfs pools"),
        ({"device": "/dev/dm-0", "disk": "/dev/dm-0"}, "device-mapper"),
        ({"device": "/dev/md0", "disk": "/dev/md0"}, "md RAID"),
        ({"device": "/dev/md127p1", "disk": "/dev/md127"}, "md RAID"),
    ],
)
def test_refusals_name_the_mountpoint(change: dict[str, str], message: str) -> None:
    check_mappable(BASE)
    with pytest.raises(UnsupportedFilesystemError, match=message) as err:
        check_mappable(dataclasses.replace(BASE, **change))  # type: ignore[arg-type]
    assert str(err.value).startswith("/mnt/x (") and "\n" not in str(err.value)
