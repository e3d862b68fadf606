"""PreparedPersistentDataset fills its own prepared cache: an entry the cache lacks is computed once, written as a
drop-in record (each process its own journal and shard), read back from then on by every process, and taken by
the next `prep cache` run over the grown datalist; values equal MONAI's PersistentDataset throughout."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

from cacheutil import same_as_clean  # noqa: E402
from grownutil import as_they_come, records, same, theirs_options, transform_of  # noqa: E402

MISSING = 3  # entries of the grown datalist the cache lacks (one new at 0, one changed at 5, one new at 6)


def _primed(data: list[Any], transform: Any, folder: Path, extra: dict[str, Any]) -> Any:
    """MONAI's PersistentDataset over `data` whose folder holds the items the prepared cache holds, as it does."""
    from monai.data import PersistentDataset

    before = PersistentDataset(data[1:5], transform, folder, **theirs_options(extra))
    [before[i] for i in range(4)]
    return PersistentDataset(data, transform, folder, **theirs_options(extra))


@pytest.mark.parametrize(
    ("context", "track_meta"), [("fork", True), ("fork", None), ("spawn", None), ("forkserver", True)]
)
def test_workers_write_then_read_back(fresh: dict[str, Any], tmp_path: Path, context: str, track_meta: Any) -> None:
    from monai.data import DataLoader

    from loaders import PreparedPersistentDataset

    data, tmp = fresh["data"], fresh["tmp"]
    theirs, mine = transform_of(tmp), transform_of(tmp)
    extra = {} if track_meta is None else {"track_meta": track_meta}
    ref = _primed(data, theirs, tmp_path / "pt", extra)
    ours = PreparedPersistentDataset(data, mine, fresh["cache"], backend="posix", **extra)
    for epoch, seed in enumerate((9, 10)):  # computed and written, then read back from the drop-in's records
        torch.manual_seed(seed)
        want = list(DataLoader(ref, batch_size=2, num_workers=2, timeout=120, collate_fn=as_they_come))
        torch.manual_seed(seed)
        loader = DataLoader(ours, batch_size=2, num_workers=2, timeout=120, collate_fn=as_they_come,
                            multiprocessing_context=context)  # fmt: skip
        got = list(loader)
        same(want, got, meta=True)
        written = records(fresh["cache"])
        assert len(written) == MISSING, f"epoch {epoch}: each missing entry written once, none again"
    files = list((fresh["cache"] / "journal").glob("fill-*.fill"))
    assert 1 <= len(files) <= 2 and len({f.name for f in files}) == len(files)  # one a worker that wrote
    assert {r["shard"] for r in written} == {f"shards/{f.name[: -len('.fill')]}.bin" for f in files}
    assert not list(fresh["cache"].glob("*.pt"))


def test_a_cache_it_cannot_write_warns_once(fresh: dict[str, Any]) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = fresh["data"], fresh["tmp"]
    (fresh["cache"] / "journal").write_text("")  # where its journal folder belongs: nothing can be written
    theirs, mine = transform_of(tmp), transform_of(tmp)
    ref = PersistentDataset(data, theirs, None, **theirs_options({"track_meta": True}))
    ours = PreparedPersistentDataset(data, mine, fresh["cache"], backend="posix", track_meta=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (5, 6):
            theirs.set_random_state(seed)
            mine.set_random_state(seed)
            same([ref[i] for i in range(len(data))], [ours[i] for i in range(len(data))], meta=True)
    said = [w for w in caught if "cannot write computed items" in str(w.message)]
    assert len(said) == 1 and str(fresh["cache"]) in str(said[0].message), [str(w.message) for w in caught]
    assert not list((fresh["cache"] / "shards").glob("fill-*"))


@pytest.mark.parametrize("damage", ["bytes", "link"])
def test_a_record_not_to_trust_is_computed_again(fresh: dict[str, Any], damage: str) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp, cache = fresh["data"], fresh["tmp"], fresh["cache"]
    PreparedPersistentDataset(data, transform_of(tmp), cache, backend="posix", track_meta=True)[0]
    (record,) = records(cache)
    shard = cache / record["shard"]
    if damage == "bytes":
        raw = bytearray(shard.read_bytes())
        raw[record["tensors"][0]["offset"]] ^= 0xFF
        shard.write_bytes(bytes(raw))
    else:
        elsewhere = fresh["cache"].parent / "elsewhere.bin"
        shard.rename(elsewhere)
        shard.symlink_to(elsewhere)
    theirs, mine = transform_of(tmp), transform_of(tmp)
    ours = PreparedPersistentDataset(data, mine, cache, backend="posix", track_meta=True)
    assert ours._journaled(0) is None  # not trusted
    theirs.set_random_state(3)
    mine.set_random_state(3)
    same(
        PersistentDataset(data[:1], theirs, None, **theirs_options({"track_meta": True}))[0], ours[0], meta=True
    )  # computed again
    assert len(records(cache)) == 2 and ours._journaled(0) is not None  # and written again, in new files


def test_prep_cache_takes_the_dropin_items(fresh: dict[str, Any], tmp_path: Path) -> None:
    from loaders import PreparedDataset, PreparedPersistentDataset
    from prep.cache import prepare_cache

    data, tmp, cache = fresh["data"], fresh["tmp"], fresh["cache"]
    ours = PreparedPersistentDataset(data, transform_of(tmp), cache, backend="posix")
    [ours[i] for i in range(len(data))]  # an epoch: the missing entries written
    assert len(records(cache)) == MISSING
    datalist = tmp_path / "grown.json"
    datalist.write_text(json.dumps({"training": data}))
    summary = prepare_cache(datalist, tmp / "pipeline.py", cache, workers=1, processes=False)
    assert (summary.n_new, summary.n_taken, summary.n_kept, summary.n_items) == (0, MISSING, 4, len(data))
    assert f"{MISSING} taken as the MONAI drop-in wrote them" in summary.lines()[0]
    assert not (cache / "journal").exists()
    same_as_clean(tmp_path, datalist, tmp / "pipeline.py", cache)
    again = PreparedPersistentDataset(data, transform_of(tmp), cache, backend="posix")
    assert all(again._lookup(i) is not None for i in range(len(data)))
    assert len(PreparedDataset(cache, backend="posix")) == len(data)


SHORT_HEAD = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd

# PersistentDataset caches nothing of it (a Compose first counts as random there); the cache's head is the two
transform = Compose([Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"])]),
                     RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0)])
"""


def test_a_head_shorter_than_persistent_datasets(grown: dict[str, Any], tmp_path: Path) -> None:

    from loaders import PreparedPersistentDataset
    from prep.cache import prepare_cache

    data = grown["data"]
    (tmp_path / "pipeline.py").write_text(SHORT_HEAD)
    (tmp_path / "first4.json").write_text(json.dumps({"training": data[1:5]}))
    prepare_cache(tmp_path / "first4.json", tmp_path / "pipeline.py", tmp_path / "cache", workers=1, processes=False)
    theirs, mine = transform_of(tmp_path), transform_of(tmp_path)
    ref = _primed(data, theirs, tmp_path / "pt", {"track_meta": True})
    ours = PreparedPersistentDataset(data, mine, tmp_path / "cache", backend="posix", track_meta=True)
    assert ours._head is not None  # the cache's head is written, not PersistentDataset's
    for seed in (5, 6):
        theirs.set_random_state(seed)
        mine.set_random_state(seed)
        same([ref[i] for i in range(len(data))], [ours[i] for i in range(len(data))], meta=True)
    assert len(records(tmp_path / "cache")) == MISSING
