"""PreparedPersistentDataset over a folder that holds no prepared cache: a new or empty one becomes a pending
prepared cache (its marker, then every item a drop-in record, computed once), equal to MONAI's PersistentDataset
throughout; `prep cache` commits it taking every record. A folder with anything else runs MONAI's own code."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

from cacheutil import same_as_clean  # noqa: E402
from grownutil import PIPELINE, as_they_come, records, same, theirs_options, transform_of  # noqa: E402

from loaders.errors import FormatError, StaleError  # noqa: E402


def _epochs(ds: Any, workers: int, context: str | None) -> list[list[Any]]:
    """Two epochs of `ds` through MONAI's DataLoader, each seeded alike, items as they come."""
    from monai.data import DataLoader

    out = []
    for seed in (9, 10):
        torch.manual_seed(seed)
        loader = DataLoader(ds, batch_size=2, num_workers=workers, timeout=120 if workers else 0,
                            collate_fn=as_they_come, multiprocessing_context=context)  # fmt: skip
        out.append(list(loader))
    return out


@pytest.mark.parametrize(
    ("workers", "context", "track_meta"),
    [(0, None, True), (0, None, None), (2, "fork", True), (2, "fork", None), (2, "spawn", True), (2, "spawn", None)],
)
def test_a_new_folder_equals_persistent_dataset(
    grown: dict[str, Any], tmp_path: Path, workers: int, context: str | None, track_meta: bool | None
) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    extra = {} if track_meta is None else {"track_meta": track_meta}
    ref = PersistentDataset(data, transform_of(tmp), tmp_path / "pt", **theirs_options(extra))
    ours = PreparedPersistentDataset(data, transform_of(tmp), tmp_path / "new", backend="posix", **extra)
    assert sorted(os.listdir(tmp_path / "new")) == ["pending.json"]
    # computed and written the first epoch, read back from the records the second, as PersistentDataset its files
    same(_epochs(ref, workers, context), _epochs(ours, workers, context), meta=True)
    assert len(records(tmp_path / "new")) == len(data)  # each entry written once, by whichever process read it
    assert not list((tmp_path / "new").glob("*.pt"))


def test_a_folder_with_other_files_runs_monai(grown: dict[str, Any], tmp_path: Path) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    for folder in ("pt", "ref"):  # MONAI's .pt file in each folder, as the reference's has it too
        PersistentDataset(data[:2], transform_of(tmp), tmp_path / folder)[0]
    before = sorted(os.listdir(tmp_path / "pt"))
    theirs, mine = transform_of(tmp), transform_of(tmp)
    ref = PersistentDataset(data, theirs, tmp_path / "ref")
    ours = PreparedPersistentDataset(data, mine, tmp_path / "pt", backend="posix")
    assert not ours._prepared
    theirs.set_random_state(5)
    mine.set_random_state(5)
    same([ref[i] for i in range(len(data))], [ours[i] for i in range(len(data))], meta=True)
    after = sorted(os.listdir(tmp_path / "pt"))
    assert set(before) < set(after) and all(n.endswith(".pt") for n in after)  # filled as MONAI fills it


def test_a_marker_of_another_head_is_refused(grown: dict[str, Any], tmp_path: Path) -> None:
    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    PreparedPersistentDataset(data, transform_of(tmp), tmp_path / "new", backend="posix")
    other = tmp_path / "other"
    other.mkdir()
    (other / "pipeline.py").write_text(PIPELINE.replace("a_max=1000.0", "a_max=900.0"))
    with pytest.raises(StaleError) as caught:
        PreparedPersistentDataset(data, transform_of(other), tmp_path / "new", backend="posix")
    said = str(caught.value)
    assert "\n" not in said and str(tmp_path / "new") in said and "another cache_dir, or remove this folder" in said


def _crafted(folder: Path, how: str) -> None:
    marker = folder / "pending.json"
    if how == "garbage":
        marker.write_bytes(b"\x00{not json")
    elif how == "types":  # the right format name, a head of numbers: never a crash of the message that names it
        doc = json.loads(json.dumps({"format": "blockprep-pending-cache", "schema_version": "2.0", "fingerprint": "x",
                                     "section": "training", "head": [1, 2], "versions": {}}))  # fmt: skip
        marker.write_text(json.dumps(doc))
    elif how == "huge":
        marker.write_bytes(b" " * (2 << 20))
    elif how == "link":
        (folder.parent / "elsewhere.json").write_text("{}")
        marker.symlink_to(folder.parent / "elsewhere.json")
    else:
        os.mkfifo(marker)


@pytest.mark.parametrize("how", ["garbage", "types", "huge", "link", "fifo"])
def test_a_crafted_marker_is_one_line(grown: dict[str, Any], tmp_path: Path, how: str) -> None:
    from loaders import PreparedPersistentDataset

    folder = tmp_path / "crafted"
    folder.mkdir()
    _crafted(folder, how)
    with pytest.raises(FormatError) as caught:
        PreparedPersistentDataset(grown["data"], transform_of(grown["tmp"]), folder, backend="posix")
    assert "\n" not in str(caught.value) and str(folder / "pending.json") in str(caught.value)


def test_a_folder_it_cannot_start_warns_once(grown: dict[str, Any], tmp_path: Path) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    folder = tmp_path / "new"
    # the marker's temp file name taken by a folder (the tests run as root, whom no mode bit stops): not writable
    (folder / f".pending.json.tmp.{os.getpid()}" / "in").mkdir(parents=True)
    theirs, mine = transform_of(tmp), transform_of(tmp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = PersistentDataset(data, theirs, None, **theirs_options({"track_meta": True}))
        ours = PreparedPersistentDataset(data, mine, folder, backend="posix", track_meta=True)
        for seed in (5, 6):
            theirs.set_random_state(seed)
            mine.set_random_state(seed)
            same([ref[i] for i in range(len(data))], [ours[i] for i in range(len(data))], meta=True)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and str(folder) in str(w.message)]
    assert len(said) == 1 and "cannot start a prepared cache here" in said[0], said
    assert sorted(os.listdir(folder)) == [f".pending.json.tmp.{os.getpid()}"]  # nothing written


def test_prep_cache_commits_a_pending_cache(grown: dict[str, Any], tmp_path: Path) -> None:
    from monai.transforms import Compose, RandFlipd
    from typer.testing import CliRunner

    from loaders import PreparedLoader, PreparedPersistentDataset
    from prep.cli import app

    data, tmp, folder = grown["data"], grown["tmp"], tmp_path / "new"
    ours = PreparedPersistentDataset(data, transform_of(tmp), folder, backend="posix")
    [ours[i] for i in range(len(data))]  # one epoch: every item written as a drop-in record
    datalist = tmp_path / "data.json"
    datalist.write_text(json.dumps({"training": data}))
    args = ["cache", str(datalist), "--pipeline", str(tmp / "pipeline.py"), "--output", str(folder), "--workers", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"0 processed in this run (0.0 items/s), {len(data)} taken as the MONAI drop-in wrote them" in result.output
    assert not (folder / "pending.json").exists() and not (folder / "journal").exists()
    same_as_clean(tmp_path, datalist, tmp / "pipeline.py", folder)
    again = PreparedPersistentDataset(data, transform_of(tmp), folder, backend="posix")
    assert again.dataset is not None and all(again._lookup(i) == i for i in range(len(data)))
    # the head with a flip after it, one item a batch: the datalist's changed entry pairs an image and a label of
    # different shapes, so the label-driven crop's two samples of it may differ (MONAI's collate refuses them too)
    head_and_flip = transform_of(tmp).transforms[:4] + (RandFlipd(keys=["image", "label"], prob=0.5),)
    loader = PreparedLoader(folder, Compose(head_and_flip), batch_size=1, device="cpu", shuffle=False, drop_last=False)
    assert [int(batch["_items"][0]) for batch in loader] == list(range(len(data)))


def test_prep_cache_refuses_a_pending_cache_of_another_head(grown: dict[str, Any], tmp_path: Path) -> None:
    from loaders import PreparedPersistentDataset
    from prep.cache import prepare_cache

    data, tmp, folder = grown["data"], grown["tmp"], tmp_path / "new"
    ours = PreparedPersistentDataset(data, transform_of(tmp), folder, backend="posix")
    ours[0]
    (tmp_path / "pipeline.py").write_text(PIPELINE.replace("a_max=1000.0", "a_max=900.0"))
    datalist = tmp_path / "data.json"
    datalist.write_text(json.dumps({"training": data}))
    with pytest.raises(StaleError, match="pending cache; re-run with --force to rebuild"):
        prepare_cache(datalist, tmp_path / "pipeline.py", folder, workers=1, processes=False)
    assert (folder / "pending.json").exists() and len(records(folder)) == 1  # left as it was
    summary = prepare_cache(datalist, tmp_path / "pipeline.py", folder, workers=1, processes=False, force=True)
    assert (summary.n_new, summary.n_taken, summary.n_items) == (len(data), 0, len(data))
    assert not (folder / "pending.json").exists()
