"""`prep cache` never writes through a link it did not make (issue 48, finding 1): a `.lock` symlink, a `shards/`
symlink, a hard link or a FIFO in the output is refused in one line naming it, and nothing outside is touched."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cacheutil import SPHERES
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from loaders.cache.journals import JournalWriter
from loaders.cache.writing import ShardWriter, atomic_write_bytes, write_items
from loaders.errors import UnsafeFileError
from prep.cache import prepare_cache
from prep.cli import app
from prep.errors import PrepError, UnsafeOutputError
from prep.journal import CacheLock


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the output that a write through a link would destroy."""
    path = tmp_path / "victim.txt"
    path.write_bytes(b"precious bytes\n")
    return path


def _link(target: Path) -> Callable[[Path], None]:
    return lambda at: at.symlink_to(target)


def _hard(target: Path) -> Callable[[Path], None]:
    return lambda at: os.link(target, at)


PLANTS = {
    "lock-symlink": (".lock", _link),
    "lock-hardlink": (".lock", _hard),
    "manifest-symlink": ("manifest.json", _link),
    "journal-file-symlink": ("journal/w0.jsonl", _link),
    "shard-symlink": ("shards/shard-0.bin", _link),
}


@pytest.mark.parametrize("case", sorted(PLANTS))
def test_a_planted_link_is_refused_and_its_target_untouched(
    nifti_dataset: Path, tmp_path: Path, victim: Path, case: str
) -> None:
    name, plant = PLANTS[case]
    out = tmp_path / "out"
    (out / name).parent.mkdir(parents=True)
    plant(victim)(out / name)
    result = CliRunner().invoke(app, ["cache", str(nifti_dataset), "--pipeline", str(SPHERES), "--output", str(out)])
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert f"{out / name}: is " in line and "choose another --output" in line, result.output
    assert victim.read_bytes() == b"precious bytes\n"


def test_a_shards_folder_symlink_is_refused_and_the_folder_stays_empty(nifti_dataset: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "shards").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeOutputError, match=f"{out / 'shards'}: is a symlink .* where it writes a folder"):
        prepare_cache(nifti_dataset, SPHERES, out, workers=1)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_fifo_lock_is_refused_without_opening_it(nifti_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / ".lock")
    keep = os.open(out / ".lock", os.O_RDWR)  # a reader and writer: an open would return, never hang the test
    try:
        with pytest.raises(UnsafeOutputError, match=r"\.lock: is a FIFO"):
            prepare_cache(nifti_dataset, SPHERES, out, workers=1)
    finally:
        os.close(keep)


def test_a_committed_cache_with_a_planted_link_is_refused_and_still_reads(
    nifti_dataset: Path, tmp_path: Path, victim: Path
) -> None:
    root = write_items(tmp_path / "c", [{"image": np.ones((1, 2, 3, 4), np.float32)}]).root
    (root / ".lock").symlink_to(victim)
    with pytest.raises(UnsafeOutputError, match=r"\.lock: is a symlink"):
        prepare_cache(nifti_dataset, SPHERES, root, workers=1, force=True)
    assert victim.read_bytes() == b"precious bytes\n"
    assert PreparedCache(root).n_items == 1  # nothing prepared was lost


@pytest.mark.parametrize("plant", [_link, _hard], ids=["symlink", "hardlink"])
def test_the_writers_refuse_a_link_made_after_the_check(tmp_path: Path, victim: Path, plant) -> None:  # type: ignore[no-untyped-def]
    """A link planted between the folder check and the open: each writer opens with O_NOFOLLOW and fstat."""
    for i, make in enumerate([
        lambda p: CacheLock(p.parent).acquire(),
        lambda p: ShardWriter(p),
        lambda p: JournalWriter(p),
    ]):  # fmt: skip
        at = tmp_path / f"w{i}" / (".lock" if i == 0 else "f")
        at.parent.mkdir()
        plant(victim)(at)
        with pytest.raises(UnsafeFileError, match=f"{at}: (is a symlink|has [0-9] names)"):
            make(at)
        assert victim.read_bytes() == b"precious bytes\n"
        assert issubclass(UnsafeFileError, PrepError)


def test_an_atomic_write_replaces_a_planted_temp_link_never_writes_through_it(tmp_path: Path, victim: Path) -> None:
    target = tmp_path / "index.npy"
    (tmp_path / f".index.npy.tmp.{os.getpid()}").symlink_to(victim)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and victim.read_bytes() == b"precious bytes\n"
