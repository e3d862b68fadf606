"""A datalist's repeated entries are said once and prepared once unless asked; the drop-in still
gives every listed copy, as MONAI's PersistentDataset does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cacheutil import SPHERES
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from prep.cache import load_datalist, prepare_cache
from prep.cli import app

torch = pytest.importorskip("torch")


def _repeating(root: Path, copies: int, size: int = 16) -> Path:
    """Three pairs; the first listed `copies` times in all, the third twice."""
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(root, count=3, size=size, seed=9)
    doc = json.loads(datalist.read_text())
    a, b, c = doc["training"]
    doc["training"] = [a, b, *[a] * (copies - 1), c, c]
    datalist.write_text(json.dumps(doc))
    return datalist


def test_copies_are_prepared_once_and_said_once(tmp_path: Path) -> None:
    datalist = _repeating(tmp_path / "data", copies=5000)
    out = tmp_path / "cache"
    args = ["cache", str(datalist), "--pipeline", str(SPHERES), "--output", str(out), "--workers", "1", "--threads"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("warning:") == 1, result.output
    assert "warning: 5000 datalist entries repeat an earlier entry of their section (first: 'training' {" in (
        result.output
    )
    assert "case_00000.nii.gz" in result.output and "pass --keep-repeats to prepare every copy" in result.output
    cache = PreparedCache(out)
    assert cache.n_items == 3
    names = [Path(cache.meta(i)["source"]["image"]).name for i in range(3)]
    assert names == ["case_00000.nii.gz", "case_00001.nii.gz", "case_00002.nii.gz"]  # as first listed
    again = CliRunner().invoke(app, args)  # up to date, and says it again
    assert again.exit_code == 0 and "already complete" in again.output and again.output.count("warning:") == 1


def test_keep_repeats_prepares_every_copy_and_is_part_of_the_plan(tmp_path: Path) -> None:
    datalist = _repeating(tmp_path / "data", copies=2)
    out = tmp_path / "cache"
    summary = prepare_cache(datalist, SPHERES, out, workers=1, processes=False, keep_repeats=True)
    assert summary.n_items == 5 and "each copy prepared and read as listed (--keep-repeats)" in summary.repeats
    once = prepare_cache(datalist, SPHERES, out, workers=1, processes=False)  # the copies dropped, none prepared
    assert (once.n_items, once.n_new, once.n_kept, once.n_dropped) == (3, 0, 3, 2)
    assert PreparedCache(out).manifest.get("repeats") == "once"
    summary = prepare_cache(datalist, SPHERES, out, workers=1, processes=False, force=True)
    assert summary.n_items == 3 and summary.n_new == 3


def test_a_datalist_without_repeats_says_nothing(tmp_path: Path, nifti_dataset: Path) -> None:
    summary = prepare_cache(nifti_dataset, SPHERES, tmp_path / "cache", workers=1, processes=False)
    assert summary.repeats == "" and not any("warning" in line for line in summary.lines())


def test_drop_in_gives_every_listed_copy_as_persistent_dataset(tmp_path: Path) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset
    from prep.pipeline import load_pipeline

    datalist = _repeating(tmp_path / "data", copies=3, size=48)  # the tail crops 32^3
    prepare_cache(datalist, SPHERES, tmp_path / "cache", workers=1, processes=False)
    data = [entry for _, entry in load_datalist(datalist)]
    assert len(data) == 6 and PreparedCache(tmp_path / "cache").n_items == 3
    transform = load_pipeline(SPHERES).transform
    ref = PersistentDataset(data, transform, tmp_path / "pt")
    ours = PreparedPersistentDataset(data, transform, tmp_path / "cache", backend="posix", track_meta=True)
    assert len(ours) == len(ref) == 6
    for seed in (3, 4):
        transform.set_random_state(seed)
        want = [ref[i] for i in range(len(data))]
        transform.set_random_state(seed)
        got = [ours[i] for i in range(len(data))]
        for w, g in zip(want, got):
            assert len(w) == len(g) == 2  # num_samples=2 crops per item
            for wc, gc in zip(w, g):
                for key in ("image", "label"):
                    assert torch.equal(wc[key].as_tensor(), gc[key].as_tensor())
                    assert torch.equal(wc[key].affine, gc[key].affine)
