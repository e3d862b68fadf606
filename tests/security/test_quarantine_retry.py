"""A quarantine clears once its file is fixed (a rerun prepares the item, the prepared items
stay as they are), an unchanged one costs a rerun nothing, and the drop-in refuses a quarantined entry when
built, with a fix that works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cacheutil import SPHERES
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from loaders.errors import StaleError
from prep.cache import load_datalist, prepare_cache
from prep.cli import app

pytest.importorskip("monai")


def _with_missing(root: Path) -> tuple[Path, Path]:
    """Three pairs whose second image is missing; returns (datalist, the missing image's path)."""
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(root, count=3, size=40, seed=4)
    missing = root / "imagesTr" / "case_00001.nii.gz"
    shutil.move(missing, root / "kept.nii.gz")
    return datalist, missing


def _tensors(cache: Path) -> dict[str, bytes]:
    """{source image: its image tensor's bytes} of every cached item."""
    c = PreparedCache(cache)
    out = {}
    for i in range(c.n_items):
        entry = next(e for e in c.entries(i) if e.key == "image")
        with open(entry.shard, "rb") as f:
            f.seek(entry.offset)
            out[c.meta(i)["source"]["image"]] = f.read(entry.nbytes)
    return out


def test_a_restored_file_is_prepared_on_the_next_run(tmp_path: Path) -> None:
    datalist, missing = _with_missing(tmp_path / "data")
    out = tmp_path / "cache"
    args = ["cache", str(datalist), "--pipeline", str(SPHERES), "--output", str(out), "--workers", "1", "--threads"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 1 and "missing file" in first.output, first.output
    before, generation = _tensors(out), PreparedCache(out).generation
    assert len(before) == 2

    again = CliRunner().invoke(app, args)  # nothing changed: reported, not rewritten
    assert again.exit_code == 1 and "already complete" in again.output, again.output
    assert PreparedCache(out).generation == generation

    shutil.copy(tmp_path / "data" / "kept.nii.gz", missing)
    fixed = CliRunner().invoke(app, args)
    assert fixed.exit_code == 0, fixed.output
    assert "1 processed in this run" in fixed.output and "2 resumed" in fixed.output, fixed.output
    after = _tensors(out)
    assert len(after) == 3 and all(after[k] == v for k, v in before.items())  # the prepared items untouched
    cache = PreparedCache(out)
    assert cache.generation != generation and not cache.manifest["quarantined"]
    assert [Path(cache.meta(i)["source"]["image"]).name for i in range(3)] == [
        f"case_{i:05d}.nii.gz" for i in range(3)
    ]  # datalist order
    assert CliRunner().invoke(app, ["verify", str(out)]).exit_code == 0


def test_a_larger_bound_prepares_what_a_smaller_one_refused(tmp_path: Path) -> None:
    datalist, _ = _with_missing(tmp_path / "data")
    out = tmp_path / "cache"
    small = prepare_cache(datalist, SPHERES, out, workers=1, processes=False, max_item_bytes=100_000)
    assert small.n_items == 0 and len(small.quarantined) == 3  # 40^3 float32 is 256 kB
    assert all(q["max_item_bytes"] == 100_000 for q in small.quarantined if "--max-item-bytes" in q["reason"])
    same = prepare_cache(datalist, SPHERES, out, workers=1, processes=False, max_item_bytes=100_000)
    assert same.up_to_date and len(same.quarantined) == 3
    large = prepare_cache(datalist, SPHERES, out, workers=1, processes=False, max_item_bytes=10**9)
    assert large.n_items == 2 and [q["reason"] for q in large.quarantined] == ["missing file"]


def test_a_run_killed_after_reopening_resumes(tmp_path: Path) -> None:
    """The cache reopened for a retry (journal lines written, manifest gone) and the run killed there: the
    next run resumes, prepares only the retried item, and loses nothing."""
    from prep.cache_plan import load_plan, reopen
    from prep.pipeline import load_pipeline

    datalist, missing = _with_missing(tmp_path / "data")
    out = tmp_path / "cache"
    prepare_cache(datalist, SPHERES, out, workers=1, processes=False)
    before = _tensors(out)
    shutil.copy(tmp_path / "data" / "kept.nii.gz", missing)
    items, plan, _ = load_plan(load_pipeline(SPHERES), datalist, ("training",), False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert reopen(out, manifest, plan, len(items), 10**9)
    assert not (out / "manifest.json").exists()
    summary = prepare_cache(datalist, SPHERES, out, workers=1, processes=False)
    assert (summary.n_items, summary.n_new, summary.n_resumed) == (3, 1, 2)
    after = _tensors(out)
    assert all(after[k] == v for k, v in before.items())


def test_drop_in_refuses_a_quarantined_entry_when_built(tmp_path: Path) -> None:
    from loaders import PreparedPersistentDataset
    from prep.pipeline import load_pipeline

    datalist, missing = _with_missing(tmp_path / "data")
    out = tmp_path / "cache"
    prepare_cache(datalist, SPHERES, out, workers=1, processes=False)
    data = [entry for _, entry in load_datalist(datalist)]
    transform = load_pipeline(SPHERES).transform
    with pytest.raises(StaleError) as info:
        PreparedPersistentDataset(data, transform, out)
    said = str(info.value)
    assert "data[1] (" in said and "case_00001.nii.gz) was quarantined by `prep cache` (missing file)" in said
    assert "re-run `prep cache` (it prepares such items again)" in said and "\n" not in said
    ds = PreparedPersistentDataset([data[0], data[2]], transform, out)  # without it: builds
    with pytest.raises(StaleError, match=r"data\[0\] .* was quarantined"):
        ds.set_data(data[1:])
    shutil.copy(tmp_path / "data" / "kept.nii.gz", missing)  # the fix the message gives works
    prepare_cache(datalist, SPHERES, out, workers=1, processes=False)
    ds = PreparedPersistentDataset(data, transform, out)
    assert len(ds) == 3 and np.asarray(ds[1][0]["image"]).shape == (1, 32, 32, 32)
