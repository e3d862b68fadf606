"""PreparedPersistentDataset returns what MONAI's PersistentDataset returns for the same pipeline and seed."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders.cache.spec import MANIFEST
from loaders.errors import StaleError

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

from grownutil import PIPELINE  # noqa: E402


def _pipeline(path: Path, a_max: float = 1000.0) -> Path:
    path.write_text(PIPELINE.replace("a_max=1000.0", f"a_max={a_max!r}"))
    return path


@pytest.fixture(scope="module")
def prepared(nifti_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from prep.cache import load_datalist, prepare_cache

    tmp = tmp_path_factory.mktemp("monai")
    pipeline = _pipeline(tmp / "pipeline.py")
    prepare_cache(nifti_dataset, pipeline, tmp / "cache", workers=1, processes=False)
    data = [entry for _, entry in load_datalist(nifti_dataset)]
    return {"tmp": tmp, "pipeline": pipeline, "cache": tmp / "cache", "data": data}


def _transform(pipeline: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(pipeline).transform


def _same_item(ref: Any, got: Any) -> None:
    from monai.data import MetaTensor

    if isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref)
        for r, g in zip(ref, got):
            _same_item(r, g)
        return
    assert set(ref) == set(got)
    for key in ("image", "label"):
        r, g = ref[key], got[key]
        assert isinstance(g, MetaTensor) and g.dtype == r.dtype
        assert torch.equal(r.as_tensor(), g.as_tensor())
        assert torch.equal(r.affine, g.affine)
        np.testing.assert_array_equal(r.meta["original_affine"], g.meta["original_affine"])
        assert r.meta["filename_or_obj"] == g.meta["filename_or_obj"]
        assert set(r.meta) == set(g.meta)
        assert [op["class"] for op in r.applied_operations] == [op["class"] for op in g.applied_operations]


def test_matches_monai_persistent_dataset(prepared: dict[str, Any]) -> None:
    from monai.data import Dataset, PersistentDataset

    from loaders import PreparedPersistentDataset

    transform = _transform(prepared["pipeline"])
    data = prepared["data"]
    ref = PersistentDataset(data, transform, prepared["tmp"] / "pt")
    ours = PreparedPersistentDataset(data, transform, prepared["cache"], backend="posix", track_meta=True)
    assert isinstance(ours, Dataset) and len(ours) == len(data)
    transform.set_random_state(11)
    want = [ref[i] for i in range(len(data))]
    transform.set_random_state(11)
    got = [ours[i] for i in range(len(data))]
    _same_item(want, got)
    assert len(ours[1:3]) == 2  # slicing as monai.data.Dataset does


def test_matches_by_source_when_reordered(prepared: dict[str, Any]) -> None:
    from loaders import PreparedPersistentDataset

    transform = _transform(prepared["pipeline"])
    data = list(reversed(prepared["data"]))
    ours = PreparedPersistentDataset(data, transform, prepared["cache"], backend="posix", verify=True, track_meta=True)
    head = ours.dataset[ours._lookup(0)]
    assert head["image"].meta["filename_or_obj"] == data[0]["image"]
    extra = [*data, {"image": "/nope/img.nii.gz", "label": "/nope/lab.nii.gz"}]
    missing = PreparedPersistentDataset(extra, transform, prepared["cache"], backend="posix")
    assert missing._lookup(6) is None  # computed when read, as PersistentDataset would (test_monai_grown.py)


def test_an_entry_changed_in_place_is_looked_up_again(prepared: dict[str, Any]) -> None:
    """A position found in place is not read again per item, but an entry the user changed since (in place, or
    by set_data) is looked up again, as PersistentDataset hashes each entry when it reads it."""
    from loaders import PreparedPersistentDataset

    data = [dict(e) for e in prepared["data"]]
    ours = PreparedPersistentDataset(data, _transform(prepared["pipeline"]), prepared["cache"], backend="posix")
    assert ours._lookup(0) == 0 and ours._lookup(0) == 0
    data[0].update(prepared["data"][1])  # in place: now it names item 1's files
    assert ours._lookup(0) == 1
    ours.set_data(list(reversed(prepared["data"])))
    assert ours._lookup(0) == len(prepared["data"]) - 1


def test_a_first_read_of_a_position_reads_its_meta_line_once(
    prepared: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup's meta line goes on to the item's first read (`hand_meta`), with the same output."""
    from loaders import PreparedPersistentDataset
    from loaders.cache.format import PreparedCache

    reads: list[int] = []
    real = PreparedCache.meta
    monkeypatch.setattr(PreparedCache, "meta", lambda self, item: reads.append(item) or real(self, item))
    ours = PreparedPersistentDataset(prepared["data"], _transform(prepared["pipeline"]), prepared["cache"],
                                     backend="posix")  # fmt: skip
    ours[1]
    assert reads == [1]  # the lookup's read, handed on (the item's own read of it made it [1, 1])
    ours[1]
    assert reads == [1]


def test_stale_pipeline_is_refused(prepared: dict[str, Any]) -> None:
    from loaders import PreparedPersistentDataset

    other = _transform(_pipeline(prepared["tmp"] / "other.py", a_max=500.0))
    with pytest.raises(StaleError, match=r"manifest.json: the cache was prepared with a different pipeline head"):
        PreparedPersistentDataset(prepared["data"], other, prepared["cache"])


def test_thread_dataloader_with_list_outputs(prepared: dict[str, Any]) -> None:
    from monai.data import ThreadDataLoader

    from loaders import PreparedPersistentDataset

    ds = PreparedPersistentDataset(prepared["data"], _transform(prepared["pipeline"]), prepared["cache"])
    batches = list(ThreadDataLoader(ds, batch_size=3, num_workers=2))
    assert sum(b["image"].shape[0] for b in batches) == 2 * len(ds)  # two crops per item
    assert batches[0]["image"].shape[1:] == (1, 12, 12, 12)


def test_cache_written_from_monai_head(prepared: dict[str, Any], tmp_path: Path) -> None:
    """A cache exported by user code (writing.write_items) with the head's fingerprint works too."""
    from monai.transforms import Compose

    from loaders import PreparedPersistentDataset
    from loaders.cache import chain
    from loaders.cache.checksums import doc_checksum
    from loaders.cache.writing import write_items

    transform = _transform(prepared["pipeline"])
    head, _ = chain.split(transform)
    data = prepared["data"][:2]
    outs = [Compose(head)(dict(d)) for d in data]
    items = [{k: o[k].as_tensor().numpy() for k in ("image", "label")} for o in outs]
    metas = [{"source": d, "meta": {k: dict(o[k].meta) for k in ("image", "label")}} for d, o in zip(data, outs)]
    write_items(tmp_path / "c", items, metas, {"fingerprint": chain.fingerprint(head)})
    ds = PreparedPersistentDataset(data, transform, tmp_path / "c", backend="posix", track_meta=True)
    transform.set_random_state(5)
    got = ds[1]
    assert got[0]["image"].shape == (1, 12, 12, 12)
    assert got[0]["image"].meta["filename_or_obj"] == data[1]["image"]
    doc = json.loads((tmp_path / "c" / MANIFEST).read_text())
    doc["fingerprint"] = "0" * 64
    doc["checksum"] = doc_checksum(doc)  # a manifest made for another head, not a damaged one
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(StaleError, match="fingerprint 000000000000"):
        PreparedPersistentDataset(data, transform, tmp_path / "c")


def test_torch_dataloader_workers(prepared: dict[str, Any]) -> None:
    from monai.data import DataLoader

    from loaders import PreparedPersistentDataset

    ds = PreparedPersistentDataset(
        prepared["data"], _transform(prepared["pipeline"]), prepared["cache"], "posix", track_meta=True
    )
    ds[0]  # the parent reads first: workers must rebuild the backend, not inherit its thread pool
    batches = list(DataLoader(ds, batch_size=2, num_workers=2, timeout=60))
    assert sum(b["label"].shape[0] for b in batches) == 2 * len(ds)
    assert batches[0]["image"].meta["filename_or_obj"][0] == prepared["data"][0]["image"]


def test_seeding_before_building_keeps_the_draws(prepared: dict[str, Any]) -> None:
    """transform.set_random_state(s), then build the drop-in: same draws as PersistentDataset."""
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data = prepared["data"]
    theirs = _transform(prepared["pipeline"])
    ref = PersistentDataset(data, theirs, prepared["tmp"] / "pt-seed")
    theirs.set_random_state(23)
    want = [ref[i] for i in range(len(data))]
    transform = _transform(prepared["pipeline"])  # the same pipeline, fresh (its readers hold no files yet)
    transform.set_random_state(23)
    ours = PreparedPersistentDataset(
        data, transform, prepared["cache"], backend="posix", track_meta=True
    )  # built after seeding
    got = [ours[i] for i in range(len(data))]
    _same_item(want, got)


def test_relative_datalist_paths_match(
    prepared: dict[str, Any], nifti_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries loaded through a relative datalist path match the cache by real path."""
    from loaders import PreparedPersistentDataset
    from prep.cache import load_datalist, prepare_cache

    transform = _transform(prepared["pipeline"])
    monkeypatch.chdir(nifti_dataset.parent.parent)
    relative = Path(nifti_dataset.parent.name) / nifti_dataset.name
    data = [entry for _, entry in load_datalist(relative)]
    assert not Path(data[0]["image"]).is_absolute()
    ours = PreparedPersistentDataset(
        list(reversed(data)), transform, prepared["cache"], backend="posix", track_meta=True
    )
    head = ours.dataset[ours._lookup(0)]
    assert Path(head["image"].meta["filename_or_obj"]).resolve() == Path(data[-1]["image"]).resolve()
    # and the other way round: a cache prepared from a relative datalist, read with absolute entries elsewhere
    prepare_cache(relative, prepared["pipeline"], prepared["tmp"] / "rel-cache", workers=1, processes=False)
    monkeypatch.chdir(prepared["tmp"])
    absolute = list(reversed(prepared["data"]))
    ours = PreparedPersistentDataset(absolute, transform, prepared["tmp"] / "rel-cache", backend="posix")
    assert ours[0][0]["image"].shape == (1, 12, 12, 12)


FOREGROUND = """
from monai.transforms import (Compose, CropForegroundd, EnsureChannelFirstd, LoadImaged, RandFlipd,
                              RandSpatialCropd, ScaleIntensityd, Spacingd)
KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.5), mode=("bilinear", "nearest")),
    CropForegroundd(keys=KEYS, source_key="label"),
    ScaleIntensityd(keys="image"),
    RandSpatialCropd(keys=KEYS, roi_size=(8, 8, 8), random_size=False),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
])
"""


def _same_types(ref: Any, got: Any, where: str) -> None:
    """Equal types (numpy dtypes, tensor dtypes, containers) all the way down, and equal values."""
    if isinstance(ref, torch.Tensor):
        assert type(got) is type(ref) and got.dtype == ref.dtype, where
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(ref)), where
    elif isinstance(ref, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == ref.dtype, where
        np.testing.assert_array_equal(got, ref, err_msg=where)
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and set(map(str, got)) == set(map(str, ref)), where
        for k in ref:
            _same_types(ref[k], got[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert type(got) is type(ref) and len(got) == len(ref), where
        for i, (r, g) in enumerate(zip(ref, got)):
            _same_types(r, g, f"{where}[{i}]")
    elif isinstance(ref, float) and np.isnan(ref):
        assert isinstance(got, float) and np.isnan(got), where
    else:
        assert type(got) is type(ref) and got == ref, where


def test_meta_types_match_monai(nifti_dataset: Path, tmp_path: Path) -> None:
    """Header fields, applied operations and foreground coordinates come back with MONAI's types (9.13):
    compared with what MONAI's PersistentDataset(track_meta=True) returns from its cache."""
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset
    from prep.cache import load_datalist, prepare_cache

    pipeline = tmp_path / "fg.py"
    pipeline.write_text(FOREGROUND)
    prepare_cache(nifti_dataset, pipeline, tmp_path / "cache", workers=1, processes=False)
    data = [entry for _, entry in load_datalist(nifti_dataset)][:3]
    transform = _transform(pipeline)
    ours = PreparedPersistentDataset(data, transform, tmp_path / "cache", backend="posix", track_meta=True)
    # MONAI 1.4 (the HPC containers' version) always keeps meta and has neither argument
    known = inspect.signature(PersistentDataset).parameters
    extra = {k: v for k, v in {"track_meta": True, "weights_only": False}.items() if k in known}
    ref = PersistentDataset(data, transform, tmp_path / "pt", **extra)
    [ref[i] for i in range(len(data))]  # fill MONAI's cache: later reads come from it
    for i in range(len(data)):
        transform.set_random_state(i)
        want = ref[i]
        transform.set_random_state(i)
        got = ours[i]
        assert set(got) == set(want)
        for key in want:
            assert type(got[key]) is type(want[key]), key
        for key in ("image", "label"):
            _same_types(dict(want[key].meta), dict(got[key].meta), f"{key}.meta")
            _same_types(want[key].applied_operations, got[key].applied_operations, f"{key}.ops")
            assert torch.equal(want[key].as_tensor(), got[key].as_tensor())
        for key in ("foreground_start_coord", "foreground_end_coord"):
            _same_types(want[key], got[key], key)


def test_track_meta_false_is_what_persistent_dataset_reads_back(prepared: dict[str, Any]) -> None:
    """The default, as MONAI's: the head's output as plain tensors, as PersistentDataset(track_meta=False)
    returns it from its cache from the second epoch on; its options are accepted."""
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data = prepared["data"]
    transform = _transform(prepared["pipeline"])
    ours = PreparedPersistentDataset(data, transform, prepared["cache"], backend="posix", hash_func=None)
    ref = PersistentDataset(data, transform, prepared["tmp"] / "pt-plain")
    [ref[i] for i in range(len(data))]  # epoch 1 fills MONAI's cache
    # MONAI 1.4 has no track_meta and keeps meta; the drop-in follows the installed MONAI
    plain = "track_meta" in inspect.signature(PersistentDataset).parameters
    assert (type(ours.dataset[0]["image"]) is torch.Tensor) == plain
    for i in range(len(data)):
        transform.set_random_state(i)
        want = ref[i]
        transform.set_random_state(i)
        got = ours[i]
        for w, g in zip(want, got):
            for key in ("image", "label"):
                assert type(g[key]) is type(w[key]) and set(g[key].meta) == set(w[key].meta)
                assert torch.equal(g[key].as_tensor(), w[key].as_tensor())
                assert torch.equal(g[key].affine, w[key].affine)


def test_drop_in_applies_the_version_rule(prepared: dict[str, Any], tmp_path: Path) -> None:
    """Another MONAI minor is refused; another torch build of the same release is read with a warning."""
    import shutil

    import monai
    import torch

    from loaders import PreparedPersistentDataset
    from loaders.cache.chain import VersionWarning
    from loaders.cache.checksums import doc_checksum

    transform = _transform(prepared["pipeline"])
    cache = tmp_path / "c"
    shutil.copytree(prepared["cache"], cache)
    doc = json.loads((cache / MANIFEST).read_text())
    base = torch.__version__.split("+")[0]

    def write(versions: dict[str, str]) -> None:
        doc["versions"] = {**doc["versions"], **versions}
        doc["checksum"] = doc_checksum(doc)
        (cache / MANIFEST).write_text(json.dumps(doc))

    write({"torch": base + "+cu130"})
    with pytest.warns(VersionWarning, match="torch"):
        PreparedPersistentDataset(prepared["data"], transform, cache)
    major, minor = monai.__version__.split(".")[:2]
    write({"monai": f"{major}.{int(minor) + 1}.0"})
    with pytest.raises(StaleError, match="monai"):
        PreparedPersistentDataset(prepared["data"], transform, cache)


def test_leaf_kinds_round_trip_and_old_lines() -> None:
    """Each stored array comes back as the type the head gave (numpy array/scalar with its dtype, tensor,
    MetaTensor); a line written before "kinds" gives MetaTensors for all, as those caches did."""
    from monai.data import MetaTensor

    from loaders.cache.meta import KINDS, as_kind, key_meta, line_kinds, meta_template, split_output

    out = {
        "image": MetaTensor(torch.arange(8.0).reshape(2, 4), meta={"filename_or_obj": "a.nii"}),
        "coord": np.array([1, 2, 3], dtype=np.int64),
        "scale": np.float32(2.5),
        "plain": torch.ones(3, dtype=torch.int16),
    }
    arrays, parts = split_output(out)
    line = json.loads(json.dumps(parts))
    old = {k: v for k, v in line.items() if k != KINDS}
    for key, want in out.items():
        read = torch.from_numpy(arrays[key].copy())
        template = meta_template(key_meta(line, key), read.ndim)
        got = as_kind(read, line_kinds(line).get(key), template)
        assert type(got) is type(want), key
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want)), key
        assert type(as_kind(read, line_kinds(old).get(key), template)) is MetaTensor, key
        if key == "image":
            assert got.meta["filename_or_obj"] == "a.nii"


def test_dropin_device_is_where_the_head_put_its_tensors() -> None:
    """Seed 000's head ends on the GPU (EnsureTypeD(device="cuda:0"), then SpacingD), and MONAI's
    PersistentDataset gives its tensors back there; the decision needs no GPU to test."""
    import monai.transforms as mt

    from loaders.faces.monai import dropin_device

    keys = ("image", "label")
    head = [mt.LoadImaged(keys=keys), mt.EnsureTyped(keys=keys, device="cuda:0"), mt.Spacingd(keys=keys, pixdim=1.5)]
    tail = [mt.RandFlipd(keys=keys, prob=0.5)]
    assert dropin_device(mt.Compose(head + tail)) == "cuda:0"
    assert dropin_device(head + tail, device="cpu") == "cpu"  # an explicit device wins
    assert dropin_device([*head, mt.ToDeviced(keys=keys, device="cuda:1"), *tail]) == "cuda:1"  # the last one
    assert dropin_device([*head, mt.EnsureTyped(keys=keys), *tail]) == "cuda:0"  # no device: left where it was
    assert dropin_device([head[0], *tail]) == "cpu"
    assert dropin_device([head[0], *tail, mt.ToDeviced(keys=keys, device="cuda:0")]) == "cpu"  # a tail's device


def test_list_transform_becomes_a_compose_and_worker_seeding_works(prepared: dict[str, Any]) -> None:
    """MONAI wraps a list transform in Compose, so the tutorials' worker_init_fn calling
    `dataset.transform.set_random_state` works; the draws then match PersistentDataset's."""
    from monai.data import PersistentDataset
    from monai.transforms import Compose

    from loaders import PreparedPersistentDataset

    data = prepared["data"]
    steps = list(_transform(prepared["pipeline"]).transforms)
    ref = PersistentDataset(data, steps, prepared["tmp"] / "pt-list")
    ours = PreparedPersistentDataset(data, steps, prepared["cache"], backend="posix", track_meta=True)
    assert isinstance(ours.transform, Compose) and isinstance(ref.transform, Compose)
    ref.transform.set_random_state(5)
    want = [ref[i] for i in range(len(data))]
    ours.transform.set_random_state(5)
    _same_item(want, [ours[i] for i in range(len(data))])


def test_set_data_swaps_the_fold_as_persistent_dataset_does(prepared: dict[str, Any]) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data = prepared["data"]
    transform = _transform(prepared["pipeline"])
    ref = PersistentDataset(data[:3], transform, prepared["tmp"] / "pt-fold")
    ours = PreparedPersistentDataset(data[:3], transform, prepared["cache"], backend="posix", track_meta=True)
    [ours[i] for i in range(3)]  # the lookup of the first fold is built
    ref.set_data(data[3:])
    ours.set_data(data[3:])
    assert len(ours) == len(ref) == len(data) - 3
    transform.set_random_state(3)
    want = [ref[i] for i in range(len(ref))]
    transform.set_random_state(3)
    _same_item(want, [ours[i] for i in range(len(ours))])
    ours.set_data([{"image": "elsewhere.nii.gz", "label": "elsewhere.nii.gz"}])
    assert ours._lookup(0) is None  # not prepared: computed when read (test_monai_grown.py)
