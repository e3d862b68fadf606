"""The drop-in's and the DALI sources' arguments, refused when built in one line of an
ArgumentError that is also the TypeError/ValueError Python code expects; a source that would yield nothing
says so instead of handing DALI a bare StopIteration; a flat map without a device asks for one."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from cacheutil import SPHERES

from loaders.errors import ArgumentError, BackendError, FormatError, PrepError


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert isinstance(exc, PrepError) and text and "\n" not in text, repr(exc)
    return text


@pytest.fixture(scope="module")
def dropin_args(good_cache: Path, nifti_dataset: Path) -> dict[str, Any]:
    from prep.cache import load_datalist
    from prep.pipeline import load_pipeline

    data = [entry for _, entry in load_datalist(nifti_dataset)]
    return {"data": data, "transform": load_pipeline(SPHERES).transform, "cache_dir": good_cache}


@pytest.mark.parametrize(
    ("change", "kind", "said"),
    [
        ({"cache_dir": 5}, TypeError, "cache_dir=5 is not a path"),
        ({"transform": str(SPHERES)}, TypeError, "spheres.py' is a path, not a transform; pass the Compose"),
        ({"transform": SPHERES}, TypeError, "is a path, not a transform"),
        ({"transform": [5]}, TypeError, "transform 5 is not a transform"),
        ({"data": None}, TypeError, "data=None is not a list of datalist entries"),
        ({"data": 5}, TypeError, "data=5 is not a list of datalist entries"),
        ({"data": {"image": "a.nii.gz"}}, TypeError, "is not a list of datalist entries"),
        ({"track_meta": "no"}, TypeError, "track_meta='no' is not a flag"),
        ({"verify": "yes"}, TypeError, "verify='yes' is not a flag"),
        ({"device": "tpu"}, ValueError, "device='tpu' is not 'cpu', 'cuda' or 'cuda:N'"),
        ({"backend": 5}, TypeError, "backend=5 is not a backend name"),
        ({"keys": ["nope"]}, KeyError, "keys ['nope'] are not in the cache (it has ['image', 'label'])"),
        ({"bogus": 1}, TypeError, "unknown option(s) ['bogus']"),
    ],
)
def test_dropin_arguments(dropin_args: dict[str, Any], change: dict[str, Any], kind: type, said: str) -> None:
    from loaders import PreparedPersistentDataset

    with pytest.raises(ArgumentError) as info:
        PreparedPersistentDataset(**{**dropin_args, **change})
    assert isinstance(info.value, kind) and said in _one_line(info.value), str(info.value)


def test_dropin_still_takes_what_persistent_dataset_takes(dropin_args: dict[str, Any]) -> None:
    from loaders import PreparedPersistentDataset

    steps = list(dropin_args["transform"].transforms)  # a list of transforms, as MONAI's Dataset takes
    ds = PreparedPersistentDataset(dropin_args["data"], steps, str(dropin_args["cache_dir"]), hash_func=None,
                                   pickle_protocol=2, keys=["image", "label"])  # fmt: skip
    assert len(ds) == len(dropin_args["data"])


@pytest.mark.parametrize(
    ("change", "kind", "said"),
    [
        ({"batch_size": 2.5}, TypeError, "batch_size=2.5 is not a whole number"),
        ({"batch_size": "2"}, TypeError, "batch_size='2' is not a whole number"),
        ({"batch_size": None}, TypeError, "batch_size=None is not a whole number"),
        ({"batch_size": 0}, ValueError, "batch_size=0 must be at least 1"),
        ({"shuffle": "no"}, TypeError, "shuffle='no' is not a flag"),
        ({"seed": None}, TypeError, "seed=None is not an integer seed"),
        ({"seed": 2**70}, ValueError, "outside 0..2**63-1"),
        ({"shard_id": 1.5}, TypeError, "shard_id=1.5 is not a whole number"),
        ({"num_shards": 0}, ValueError, "num_shards=0 must be at least 1"),
        ({"shard_id": 2, "num_shards": 2}, ValueError, "shard_id 2 is outside num shards 2"),
        ({"shard_id": 0, "num_shards": 16}, ValueError, "shard_id 0 of num_shards 16 holds none of the 15"),
        ({"threads": 0}, ValueError, "threads=0 must be at least 1"),
        ({"file_filters": "*.JPEG"}, TypeError, "file_filters='*.JPEG' is not a list of patterns"),
        ({"file_filters": ["*.png"]}, ValueError, "FileSource: no files under"),
        ({"case_sensitive_filter": "yes"}, TypeError, "case_sensitive_filter='yes' is not a flag"),
        ({"backend": 5}, TypeError, "backend=5 is not a backend name"),
        ({"root": None}, TypeError, "root=None is not a path"),
        ({"root": "/nonexistent/train"}, FileNotFoundError, "root='/nonexistent/train': no such folder"),
    ],
)
def test_file_source_arguments(image_tree: Path, change: dict[str, Any], kind: type, said: str) -> None:
    from loaders.faces.dali import FileSource

    with pytest.raises(ArgumentError) as info:
        FileSource(**{"root": image_tree, **change})
    assert isinstance(info.value, kind) and said in _one_line(info.value), str(info.value)


@pytest.fixture
def seed_map(image_tree: Path, tmp_path: Path) -> Path:
    """A flat research map of the tree (keys "train/<class>/<file>"), made without a device."""
    files = sorted(image_tree.rglob("*.JPEG"))
    flat = {
        f"train/{p.parent.name}/{p.name}": {"startblock": 8 * i, "endblock": 8 * i + 7} for i, p in enumerate(files)
    }
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(flat))
    return path


def test_bmap_source_says_where_the_class_folders_are(seed_map: Path, image_tree: Path) -> None:
    """folder='' over a map whose classes sit under train/: one line naming the folder to pass, not an
    epoch of nothing that DALI ends with a bare StopIteration."""
    from loaders.faces.dali import BmapSource

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flat map's own warning
        with pytest.raises(ArgumentError) as info:
            BmapSource(seed_map, root=image_tree.parent, device_path=seed_map, folder="")
    assert isinstance(info.value, ValueError)
    assert "under folder=''" in _one_line(info.value) and "pass folder='train'" in str(info.value)


def test_flat_map_without_a_device_asks_for_one(seed_map: Path, image_tree: Path) -> None:
    from loaders.blockmap.bmap import BlockMap
    from loaders.faces.dali import BmapSource

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FormatError) as info:
            BmapSource(seed_map, root=image_tree.parent)
        bmap = BlockMap.load(seed_map, root=image_tree.parent)
    assert "names no device" in _one_line(info.value) and "pass device_path=" in str(info.value)
    assert "?" not in str(info.value).replace(str(seed_map), "")
    source = bmap.source("/dev/sdz")  # any disk given: the flat map's LBAs count from its start
    assert (source.path, source.base) == ("/dev/sdz", bmap.partition_start)


@pytest.mark.parametrize(
    ("change", "kind", "said"),
    [
        ({"backend": "posix"}, BackendError, "backend 'posix' cannot read block ranges"),
        ({"backend": 5}, BackendError, "backend 5 cannot read block ranges"),
        ({"bmap": None}, TypeError, "bmap=None is not a path"),
        ({"folder": 5}, TypeError, "folder=5 is not a folder name"),
        ({"root": 5}, TypeError, "root=5 is not a path"),
        ({"device_path": 5}, TypeError, "device_path=5 is not a path"),
        ({"backend_options": "bam"}, TypeError, "backend_options='bam' is not a dict"),
        ({"file_filters": "*.JPEG"}, TypeError, "is not a list of patterns"),
        ({"batch_size": -1}, ValueError, "batch_size=-1 must be at least 1"),
        ({"shard_id": "0"}, TypeError, "shard_id='0' is not a whole number"),
    ],
)
def test_bmap_source_arguments(seed_map: Path, image_tree: Path, change: dict[str, Any], kind: type, said: str) -> None:
    from loaders.faces.dali import BmapSource

    with pytest.raises((ArgumentError, BackendError)) as info:
        BmapSource(**{"bmap": seed_map, "root": image_tree.parent, "device_path": seed_map, **change})
    assert isinstance(info.value, kind) and said in _one_line(info.value), str(info.value)


@pytest.mark.parametrize(
    ("change", "kind", "said"),
    [
        ({"keys": None}, TypeError, "keys=None: CacheSource gives one output per key"),
        ({"keys": ["nope"]}, KeyError, "keys ['nope'] are not in the cache"),
        ({"keys": 5}, TypeError, "keys=5 is not a list of key names"),
        ({"batch_size": 1.5}, TypeError, "batch_size=1.5 is not a whole number"),
        ({"prefetch": -5}, ValueError, "prefetch=-5 must be at least 0"),
        ({"device": "tpu"}, ValueError, "device='tpu'"),
        ({"num_shards": 7}, ValueError, "holds none of the 6"),
    ],
)
def test_cache_source_arguments(good_cache: Path, change: dict[str, Any], kind: type, said: str) -> None:
    from loaders.faces.dali import CacheSource

    with pytest.raises(ArgumentError) as info:
        CacheSource(**{"cache_dir": good_cache, **change})
    assert isinstance(info.value, kind) and said in _one_line(info.value), str(info.value)
