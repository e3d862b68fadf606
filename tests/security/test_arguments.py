"""Bad arguments to the readers are refused when the object is built (or the call made), each in one line of
an ArgumentError that is also the TypeError/ValueError/KeyError/IndexError Python code expects."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from cacheutil import SPHERES

from loaders import PreparedDataset
from loaders.errors import ArgumentError

torch = pytest.importorskip("torch")
pytest.importorskip("monai")


def _one_line(exc: pytest.ExceptionInfo[BaseException], kind: type) -> None:
    assert isinstance(exc.value, ArgumentError) and isinstance(exc.value, kind), type(exc.value)
    assert "\n" not in str(exc.value) and "Traceback" not in str(exc.value)


@pytest.mark.parametrize(
    ("kwargs", "kind", "says"),
    [
        ({"keys": ["nope"]}, KeyError, "not in the cache (it has"),
        ({"keys": "image"}, TypeError, "not a list of key names"),
        ({"device": "tpu"}, ValueError, "not 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": 5}, TypeError, "not a device name"),
        ({"verify": "yes"}, TypeError, "not a flag"),
        ({"backend": 5}, TypeError, "not a backend name"),
    ],
)
def test_dataset_arguments(good_cache: Path, kwargs: dict[str, Any], kind: type, says: str) -> None:
    with pytest.raises(ArgumentError, match=re.escape(says)) as exc:
        PreparedDataset(good_cache, **kwargs)
    _one_line(exc, kind)


@pytest.mark.parametrize("cache_dir", [None, 5])
def test_cache_dir_must_be_a_path(cache_dir: Any) -> None:
    with pytest.raises(TypeError, match="is not a path") as exc:
        PreparedDataset(cache_dir)
    _one_line(exc, TypeError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a box without a GPU")
def test_a_cuda_device_without_a_gpu(good_cache: Path) -> None:
    with pytest.raises(ValueError, match="sees no CUDA GPU") as exc:
        PreparedDataset(good_cache, device="cuda:0")
    _one_line(exc, ValueError)


@pytest.mark.parametrize(
    ("call", "kind", "says"),
    [
        (lambda ds: ds[10**12], IndexError, "outside a dataset of"),
        (lambda ds: ds[1.5], TypeError, "not an integer item index"),
        (lambda ds: ds.shard(1.5, 2), TypeError, "rank=1.5"),
        (lambda ds: ds.shard(0, 0), ValueError, "world_size=0"),
        (lambda ds: ds.shard(0, 10**12), ValueError, "world_size 1000000000000 is over the 1048576 ranks"),
        (lambda ds: ds.shard(0, 2, seed=2**70), ValueError, "outside 0..2**63-1"),
        (lambda ds: ds.shard(0, 2, shuffle="no"), TypeError, "shuffle='no' is not a flag"),
        (lambda ds: ds.subset([1.5]), TypeError, "not integer positions"),
        (lambda ds: ds.subset([10**9]), IndexError, "outside a dataset"),
        (lambda ds: next(iter(ds.iter_batches(-1))), ValueError, "batch_size=-1"),
        (lambda ds: next(iter(ds.iter_batches(2.5))), TypeError, "batch_size=2.5"),
        (lambda ds: next(iter(ds.iter_batches(2, seed=None))), TypeError, "seed=None"),
        (lambda ds: next(iter(ds.iter_batches(2, prefetch=-5))), ValueError, "prefetch=-5"),
        (lambda ds: next(iter(ds.iter_batches(2, shuffle="no"))), TypeError, "shuffle='no'"),
    ],
)
def test_dataset_calls(good_cache: Path, call: Any, kind: type, says: str) -> None:
    ds = PreparedDataset(good_cache, meta=False)
    with pytest.raises(ArgumentError, match=re.escape(says)) as exc:
        call(ds)
    _one_line(exc, kind)


def _loader(cache: Path, **kwargs: Any) -> Any:
    from loaders import PreparedLoader
    from prep.pipeline import load_pipeline

    args = {"batch_size": 2, "device": "cpu", **kwargs}
    return PreparedLoader(cache, load_pipeline(SPHERES).transform, **args)


@pytest.mark.parametrize(
    ("kwargs", "kind", "says"),
    [
        ({"batch_size": 2.5}, TypeError, "batch_size=2.5"),
        ({"batch_size": "2"}, TypeError, "batch_size='2'"),
        ({"batch_size": None}, TypeError, "batch_size=None"),
        ({"batch_size": 0}, ValueError, "batch_size=0"),
        ({"seed": None}, TypeError, "seed=None"),
        ({"seed": "x"}, TypeError, "seed='x'"),
        ({"seed": 2**70}, ValueError, "outside 0..2**63-1"),
        ({"keys": ["nope"]}, KeyError, "not in the cache"),
        ({"device": "tpu"}, ValueError, "device='tpu'"),
        ({"device": 5}, TypeError, "device=5"),
        ({"switch_interval": 0}, ValueError, "switch_interval=0"),
        ({"prefetch": -5}, ValueError, "prefetch=-5"),
        ({"crop_read": "no"}, TypeError, "crop_read='no'"),
        ({"shuffle": "no"}, TypeError, "shuffle='no'"),
        ({"verify": "yes"}, TypeError, "verify='yes'"),
        ({"backend": 5}, TypeError, "backend=5"),
        ({"gpu_budget": "lots"}, ValueError, "gpu_budget 'lots' is not a size"),
        ({"copy_threads": 0}, ValueError, "copy_threads=0"),
    ],
)
def test_loader_arguments(good_cache: Path, kwargs: dict[str, Any], kind: type, says: str) -> None:
    with pytest.raises(ArgumentError, match=re.escape(says)) as exc:
        _loader(good_cache, **kwargs)
    _one_line(exc, kind)


@pytest.mark.parametrize(
    ("call", "kind", "says"),
    [
        (lambda loader: loader.shard(1.5, 2), TypeError, "rank=1.5 is not a whole number"),
        (lambda loader: loader.shard(2, 2), ValueError, "rank 2 is outside world size 2"),
        (lambda loader: loader.shard(0, 0), ValueError, "world_size=0 must be at least 1"),
        (lambda loader: loader.set_epoch("x"), TypeError, "epoch='x' is not a whole number"),
        (lambda loader: loader.set_epoch(-1), ValueError, "epoch=-1 must be at least 0"),
        (lambda loader: loader.set_random_state("x"), TypeError, "seed='x' is not an integer seed"),
    ],
)
def test_loader_calls(good_cache: Path, call: Any, kind: type, says: str) -> None:
    loader = _loader(good_cache)
    with pytest.raises(ArgumentError, match=re.escape(says)) as exc:
        call(loader)
    _one_line(exc, kind)
    loader.set_random_state(None)  # as Compose.set_random_state(None) takes it


def test_an_empty_epoch_warns_once(good_cache: Path) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _loader(good_cache, batch_size=100, drop_last=True)
    assert len([w for w in record if "every epoch is empty" in str(w.message)]) == 1
