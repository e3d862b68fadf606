"""PreparedLoader(workers=W) against MONAI itself: PersistentDataset + MONAI's DataLoader(num_workers=W,
persistent_workers=True) over the same batches and torch seed give the same tensors, epoch after epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders.errors import ArgumentValueError, PrepError
from loaders.fast.loader import PreparedLoader
from tests.loaders.test_folds import SLICES, _same, _transform, _volumes

ELASTIC = SLICES.replace(
    "RandRotated(",
    "Rand2DElasticd(keys=K, spacing=(3, 3), magnitude_range=(0, 1), prob=0.7, "
    'mode=("bilinear", "nearest")), RandRotated(',
).replace("RandRotated,", "Rand2DElasticd, RandRotated,")


@pytest.fixture(scope="module", params=["slices", "elastic"])
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(datalist, pipeline, cache): slices of volumes, batched; or with a transform MONAI runs item by item."""
    from prep.cache import prepare_cache

    root = tmp_path_factory.mktemp(request.param)
    datalist = _volumes(root / "data", 3, "uint8", n=7)
    pipeline = root / "pipeline.py"
    pipeline.write_text(SLICES if request.param == "slices" else ELASTIC)
    prepare_cache(datalist, pipeline, root / "cache", workers=1)
    return datalist, pipeline, root / "cache"


class _Batches:
    """MONAI's batch sampler for the loader's epoch `epoch` (set by the caller: torch's DataLoader iterates its
    sampler twice for its first epoch)."""

    def __init__(self, loader: PreparedLoader) -> None:
        self.loader, self.epoch = loader, 0

    def __iter__(self) -> Any:
        order = [int(i) for i in self.loader.epoch_items(self.epoch)]
        b = self.loader.batch_size
        return iter([order[i : i + b] for i in range(0, len(order) - b + 1, b)])

    def __len__(self) -> int:
        return len(self.loader)


def _monai(datalist: Path, pipeline: Path, tmp: Path, loader: PreparedLoader, epochs: int) -> list[Any]:
    import torch
    from monai.data import DataLoader, PersistentDataset

    from prep.cache import load_datalist

    data = [e for _, e in load_datalist(datalist)]
    ds = PersistentDataset(data, _transform(pipeline), cache_dir=tmp)
    torch.manual_seed(7)
    batches = _Batches(loader)
    dl = DataLoader(ds, batch_sampler=batches, num_workers=2, persistent_workers=True, timeout=120)
    out = []
    for epoch in range(epochs):
        batches.epoch = epoch
        out += list(dl)
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_workers_equal_monai_dataloader_workers(chain: tuple[Path, Path, Path], tmp_path: Path, shuffle: bool) -> None:
    import torch

    datalist, pipeline, cache = chain
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", shuffle=shuffle, workers=2)
    torch.manual_seed(7)
    got = [b for _ in range(3) for b in loader]
    pid = loader._workers._pool._iterator._workers[0].pid
    loader.close()
    want = _monai(datalist, pipeline, tmp_path / "pd", loader, 3)
    assert len(got) == len(want) == 3 * len(loader)
    for g, w in zip(got, want):
        _same(g, w)
    with pytest.raises(ProcessLookupError):  # the workers are stopped by close()
        import os

        os.kill(pid, 0)


def test_another_torch_seed_differs(chain: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """The negative control: the comparison sees the workers' seeds."""
    import torch

    datalist, pipeline, cache = chain
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", workers=2)
    torch.manual_seed(8)
    got = list(loader)
    loader.close()
    want = _monai(datalist, pipeline, tmp_path / "pd", loader, 1)
    assert any(not np.array_equal(g["image"].numpy(), w["image"].as_tensor().numpy()) for g, w in zip(got, want))


def test_set_random_state_seeds_the_workers_once(chain: tuple[Path, Path, Path]) -> None:
    """set_random_state(s): the same batches without touching torch's generator; after the workers start it is
    refused in one line, as are the loader state calls."""
    datalist, pipeline, cache = chain

    def run() -> list[Any]:
        loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", workers=2)
        loader.set_random_state(3)
        out = [b for _ in range(2) for b in loader]
        for call in (lambda: loader.set_random_state(4), loader.state_dict):
            with pytest.raises(PrepError) as info:
                call()
            assert "\n" not in str(info.value) and "workers" in str(info.value)
        loader.close()
        return out

    for a, b in zip(run(), run()):
        _same(a, b)


def test_feeder_and_workers_together_are_refused(chain: tuple[Path, Path, Path]) -> None:
    _, pipeline, cache = chain
    with pytest.raises(ArgumentValueError, match="pass one of the two"):
        PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", workers=2, feeder=True)
    with pytest.raises(PrepError, match="workers=-1"):
        PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", workers=-1)
