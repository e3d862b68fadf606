"""Skip reasons name exactly what is missing, and the package that brings it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fsutil import loop_reason, unmount


def _path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only executables named `tools` (shutil.which finds those and nothing else)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize(
    "present, fstypes, reason",
    [
        (("losetup", "mkfs.ext4"), ("xfs",), "mkfs.xfs missing (apt-get install xfsprogs)"),
        (("mkfs.ext4", "mkfs.xfs"), ("ext4",), "losetup missing (apt-get install mount)"),
        ((), ("ext4", "xfs"), "losetup and mkfs.ext4 and mkfs.xfs missing (apt-get install mount e2fsprogs xfsprogs)"),
    ],
)
def test_loop_reason_names_only_the_missing_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...], fstypes: tuple[str, ...], reason: str
) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, *present))
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the root check comes first; this tests the tool check
    assert loop_reason(*fstypes) == reason


def test_loop_reason_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert loop_reason("ext4") == "loop mounts need root"


def test_cgroup_reason_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    from workflows.bench.memcg import cgroup_reason

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cgroup_reason() == "memory cgroups need root"


@pytest.mark.loopdev
def test_a_busy_loop_mount_is_unmounted_once_its_last_file_closes(make_loopfs: object) -> None:
    """The loop fixture's teardown waits while a process still holds a file in the mount (a test's dask workers
    closing theirs after the run returned once left CI's mount behind, and the next job's cleanup failed)."""
    import subprocess
    import sys

    fs = make_loopfs("ext4", size_mb=8)  # type: ignore[operator]
    held = fs.mountpoint / "held"
    child = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(held)!r}, 'w'); print(1, flush=True); "
                              "time.sleep(1.5)"], stdout=subprocess.PIPE)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == b"1"  # the file is open now
    busy = subprocess.run(["umount", str(fs.mountpoint)], capture_output=True, text=True)
    assert busy.returncode != 0 and fs.mountpoint.is_mount()  # what the old teardown met, and left mounted
    unmount(fs.mountpoint)
    assert not fs.mountpoint.is_mount()
    child.wait(10)
    child.stdout.close()
