"""A folder of the output swapped for a link during a `prep cache` run redirects no write (issue 48): the run
opens its folders once and writes relative to those descriptors (`prep.outdirs`); each task opens its own and
compares them with the run's. Every swap here is a real rename + symlink, made after the start-up check."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cacheutil import SPHERES

import prep.cache
import prep.worker
from loaders.cache.spec import JOURNAL_DIR, SHARD_DIR
from prep.cache import prepare_cache
from prep.errors import PrepError, UnsafeOutputError
from prep.outdirs import OutputDirs


def _swap(out: Path, name: str, moved: Path, elsewhere: Path) -> None:
    """Move the real folder out of the output and put a link to `elsewhere` in its place."""
    os.rename(out / name, moved)
    (out / name).symlink_to(elsewhere, target_is_directory=True)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*"))


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(output, the folder a link points to, where the real folder is moved)."""
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "out", tmp_path / "elsewhere", tmp_path / "moved"


def _once(fn: Callable[..., Any], then: Callable[[], None]) -> Callable[..., Any]:
    """`fn`, calling `then` after its first call returns."""
    done: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if not done:
            done.append(True)
            then()
        return result

    return wrapped


@pytest.mark.parametrize("name", [SHARD_DIR, JOURNAL_DIR])
def test_a_folder_swapped_after_the_start_up_check_is_refused_in_one_line(
    nifti_dataset: Path, places: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    out, elsewhere, moved = places
    prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)
    shards_before = _files(out / SHARD_DIR)
    (out / JOURNAL_DIR).mkdir()  # a committed cache has none: give the swap a real one to move
    swap = _once(prep.cache.check_output, lambda: _swap(out, name, moved, elsewhere))
    monkeypatch.setattr(prep.cache, "check_output", swap)
    with pytest.raises(UnsafeOutputError) as info:
        prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False, force=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{out / name}: is a symlink now"), message
    assert "choose another --output" in message
    assert _files(elsewhere) == []  # nothing written outside
    if name == SHARD_DIR:  # the shards already prepared are where the swap moved them, untouched
        assert _files(moved) == shards_before


@pytest.mark.parametrize("name", [SHARD_DIR, JOURNAL_DIR])
def test_a_folder_swapped_while_a_task_writes_redirects_nothing(
    nifti_dataset: Path, places: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Swapped after the first task opened its folders (at its first item's input check): its shards and
    journal lines go on into the folders it opened; the next task, opening its own, refuses the link in one
    line naming it. Nothing lands outside, and what was written is in the real (moved) folder."""
    out, elsewhere, moved = places
    swap = _once(prep.worker.check_entry, lambda: _swap(out, name, moved, elsewhere))
    monkeypatch.setattr(prep.worker, "check_entry", swap)
    with pytest.raises(PrepError) as info:
        prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{out / name}: is a symlink"), message
    assert _files(elsewhere) == []
    written = sorted(moved.iterdir())
    assert written and all(p.stat().st_size > 0 for p in written if p.suffix in (".bin", ".jsonl"))


def test_a_task_refuses_a_folder_other_than_the_one_the_run_opened(tmp_path: Path) -> None:
    """A worker process opens its own descriptors: a real folder renamed into the name since is refused."""
    out = tmp_path / "out"
    out.mkdir()
    with OutputDirs(out) as run:
        run.fd(SHARD_DIR)
        ids = run.ids()
        os.rename(out / SHARD_DIR, tmp_path / "moved")
        (out / SHARD_DIR).mkdir()
        with OutputDirs(out, ids) as task, pytest.raises(UnsafeOutputError) as info:
            task.fd(SHARD_DIR)
    message = str(info.value)
    assert message.startswith(f"{out / SHARD_DIR}: is not the folder this `prep cache` run opened"), message
    assert "\n" not in message
