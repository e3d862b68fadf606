"""PreparedPersistentDataset over a datalist with entries its cache lacks (grown, or changed since `prep cache`):
those items are computed as MONAI's PersistentDataset computes an item it has no file for (and written into the
cache, read back from the second epoch on, as PersistentDataset reads its file back), and every item equals
PersistentDataset's, against MONAI itself."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

from grownutil import as_they_come, same, theirs_options, transform_of  # noqa: E402


@pytest.mark.parametrize("track_meta", [True, None])
def test_missing_entries_equal_persistent_dataset(fresh: dict[str, Any], track_meta: bool | None) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    grown = fresh
    data, tmp = grown["data"], grown["tmp"]
    theirs, mine = transform_of(tmp), transform_of(tmp)
    extra = {} if track_meta is None else {"track_meta": track_meta}
    folder = tmp / f"pt-{track_meta}"
    ref = PersistentDataset(data, theirs, folder, **theirs_options(extra))
    ours = PreparedPersistentDataset(data, mine, grown["cache"], backend="posix", **extra)
    assert [ours._lookup(i) is None for i in range(len(data))] == [True, False, False, False, False, True, True]
    before = PersistentDataset(data[1:5], theirs, folder, **theirs_options(extra))
    [before[i] for i in range(4)]  # its folder holds the four prepared, as the cache does
    for seed in (5, 6):  # the first fills the folder with the rest, the second reads it all
        theirs.set_random_state(seed)
        want = [ref[i] for i in range(len(data))]
        mine.set_random_state(seed)
        got = [ours[i] for i in range(len(data))]
        # computed and written the first time, read back from the cache from the second epoch on, as
        # PersistentDataset reads its file back (track_meta=False: plain tensors, whose meta the tail makes up)
        same(want, got, meta=True)
    assert not list(grown["cache"].glob("*.pt")) and len(list(folder.glob("*.pt"))) == len(data)
    assert len(list((grown["cache"] / "journal").glob("fill-*.fill"))) == 1  # this process's own


def test_missing_entries_under_dataloader_workers(fresh: dict[str, Any]) -> None:
    from monai.data import DataLoader, PersistentDataset

    from loaders import PreparedPersistentDataset

    grown = fresh
    data, tmp = grown["data"], grown["tmp"]
    theirs, mine = transform_of(tmp), transform_of(tmp)
    ours = PreparedPersistentDataset(data, mine, grown["cache"], backend="posix", track_meta=True)
    ours = pickle.loads(pickle.dumps(ours))  # as a spawn or forkserver worker gets it
    ref = PersistentDataset(data, theirs, tmp / "pt-workers", **theirs_options({"track_meta": True}))
    # items as they come (MONAI's collate of a fresh crop's views fails in a worker, PersistentDataset's too)
    torch.manual_seed(9)
    want = list(DataLoader(ref, batch_size=2, num_workers=2, timeout=60, collate_fn=as_they_come))
    torch.manual_seed(9)
    got = list(DataLoader(ours, batch_size=2, num_workers=2, timeout=60, collate_fn=as_they_come))
    assert len(got) == len(want) == 4
    same(want, got, meta=True)


def test_a_missing_file_fails_as_in_persistent_dataset(grown: dict[str, Any]) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data = [{"image": "/nope/img.nii.gz", "label": "/nope/lab.nii.gz"}]
    transform = transform_of(grown["tmp"])
    with pytest.raises(RuntimeError) as theirs:
        PersistentDataset(data, transform, None)[0]
    with pytest.raises(RuntimeError) as ours:
        PreparedPersistentDataset(data, transform, grown["cache"], backend="posix")[0]
    assert type(ours.value) is type(theirs.value) and str(ours.value.__cause__) == str(theirs.value.__cause__)
    assert "/nope/img.nii.gz" in str(ours.value.__cause__)
