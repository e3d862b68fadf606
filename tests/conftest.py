"""Shared fixtures: a synthetic NIfTI dataset and loop-mounted ext4/xfs filesystem images."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fsutil import loop_reason, unmount
from hypothesis import settings

# Property tests check correctness, never speed: a loaded 2-core CI box must not fail them on time.
settings.register_profile("blockprep", deadline=None)
settings.load_profile("blockprep")


@pytest.fixture(scope="session")
def nifti_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six 32^3 image/label pairs and their datalist; returns the datalist path."""
    from prep.synth import nifti_dataset as make

    return make(tmp_path_factory.mktemp("nifti") / "spheres", count=6, size=32, seed=7)


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three classes of five small JPEGs; returns the train/ folder."""
    from prep.synth import image_tree as make

    return make(tmp_path_factory.mktemp("imgs") / "tree", classes=3, per_class=5, size=32, seed=3)


@dataclass
class LoopFS:
    """A filesystem image mounted through a loop device."""

    fstype: str
    image: Path
    mountpoint: Path
    device: str
    offset: int


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def make_loopfs(tmp_path: Path) -> Iterator[Callable[..., LoopFS]]:
    """Factory: make_loopfs("ext4"|"xfs", size_mb=..., offset=bytes, mkfs_args=[...]) -> mounted LoopFS.

    Skips with the reason where loop mounts are not permitted; always unmounts and detaches.
    """
    made: list[LoopFS] = []

    def make(fstype: str = "ext4", size_mb: int = 64, offset: int = 0, mkfs_args: tuple[str, ...] = ()) -> LoopFS:
        reason = loop_reason(fstype)
        if reason:
            pytest.skip(reason)
        if fstype == "xfs":
            size_mb = max(size_mb, 320)  # mkfs.xfs refuses filesystems under 300 MB
        image = tmp_path / f"{fstype}-{uuid.uuid4().hex[:8]}.img"
        with open(image, "wb") as f:
            f.truncate(offset + size_mb * 1024 * 1024)
        try:
            device = _run("losetup", "--find", "--show", "--offset", str(offset), str(image))
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"losetup failed: {exc.stderr.strip()}")
        mnt = tmp_path / f"mnt-{image.stem}"
        mnt.mkdir()
        fs = LoopFS(fstype, image, mnt, device, offset)
        try:
            force = "-F" if fstype == "ext4" else "-f"
            _run(f"mkfs.{fstype}", "-q", force, *mkfs_args, device)
            _run("mount", device, str(mnt))
        except subprocess.CalledProcessError as exc:
            subprocess.run(["losetup", "-d", device], check=False)
            pytest.skip(f"cannot make/mount {fstype}: {exc.stderr.strip()}")
        made.append(fs)
        return fs

    yield make
    for fs in reversed(made):
        unmount(fs.mountpoint)
        subprocess.run(["losetup", "-d", fs.device], check=False, capture_output=True)


@pytest.fixture(params=["ext4", "xfs"])
def loopfs(request: pytest.FixtureRequest, make_loopfs: Callable[..., LoopFS]) -> LoopFS:
    """A fresh mounted ext4 or xfs image (parametrised over both)."""
    return make_loopfs(request.param)
