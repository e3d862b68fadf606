"""The one epoch order equals torch's DistributedSampler, and every reader uses it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders.cache.order import epoch_order


def _sampler(n: int, seed: int, epoch: int, rank: int, world: int, shuffle: bool, drop_last: bool) -> list[int]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)
    return list(sampler)


@given(
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    world=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_equals_distributed_sampler(n, seed, epoch, world, shuffle, drop_last, data) -> None:
    rank = data.draw(st.integers(0, world - 1))
    got = epoch_order(n, seed, epoch, rank, world, shuffle, drop_last)
    assert got.dtype == np.int64
    assert got.tolist() == _sampler(n, seed, epoch, rank, world, shuffle, drop_last)


def test_ranks_cover_every_item_once_plus_padding() -> None:
    parts = [epoch_order(10, 3, 1, r, 4) for r in range(4)]
    assert sorted(np.concatenate(parts).tolist()) == sorted(list(range(10)) + epoch_order(10, 3, 1)[:2].tolist())
    assert {len(p) for p in parts} == {3}


def test_unpadded_and_contiguous() -> None:
    assert [len(epoch_order(10, 0, 0, r, 4, pad=False)) for r in range(4)] == [3, 3, 2, 2]
    whole = epoch_order(8, 5, 2)
    assert epoch_order(8, 5, 2, 1, 2, contiguous=True).tolist() == whole[4:].tolist()


@pytest.mark.parametrize("bad", [1.5, "2", None, True])
def test_refuses_non_integers(bad) -> None:
    with pytest.raises(TypeError, match="must be an integer"):
        epoch_order(10, seed=bad)
    with pytest.raises(ValueError, match="outside world size"):
        epoch_order(10, rank=2, world=2)


def test_readers_share_the_order(tmp_path) -> None:
    """PreparedDataset.shard, iter_batches/PreparedBatches and PreparedLoader order an epoch the same way."""
    from pathlib import Path

    from loaders import PreparedBatches, PreparedDataset, PreparedLoader
    from prep.cache import prepare_cache
    from prep.pipeline import load_pipeline
    from prep.synth import nifti_dataset

    spheres = Path(__file__).parents[2] / "workflows" / "pipelines" / "spheres.py"
    cache = tmp_path / "cache"
    prepare_cache(nifti_dataset(tmp_path / "nifti", count=5, size=40, seed=1), spheres, cache, workers=1)
    n = len(PreparedDataset(cache))
    want = epoch_order(n, 11, 3, 1, 2)
    shard = PreparedDataset(cache).shard(1, 2, shuffle=True, seed=11)
    shard.set_epoch(3)
    assert shard.items.tolist() == want.tolist()
    batches = PreparedBatches(PreparedDataset(cache), 1, shuffle=True, seed=11)
    batches.set_epoch(3)
    assert [int(b["_items"][0]) for b in batches] == epoch_order(n, 11, 3).tolist()
    transform = load_pipeline(spheres).transform
    loader = PreparedLoader(cache, transform, batch_size=1, device="cpu", seed=11, drop_last=False).shard(1, 2)
    loader.set_epoch(3)
    assert [int(b["_items"][0]) for b in loader] == want.tolist()
    assert [int(b["_items"][0]) for b in loader] == epoch_order(n, 11, 4, 1, 2).tolist()  # then moves on


def test_epoch_batches_cut_drop_and_start() -> None:
    from loaders.cache.order import epoch_batches

    order = np.arange(10, dtype=np.int64)
    assert [c.tolist() for c in epoch_batches(order, 4, False)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [c.tolist() for c in epoch_batches(order, 4, True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c.tolist() for c in epoch_batches(order, 4, True, start=1)] == [[4, 5, 6, 7]]
    assert [c.tolist() for c in epoch_batches(order, 5, True)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert epoch_batches(order[:0], 4, False) == []


def test_dali_shard_is_contiguous_and_covers() -> None:
    from loaders.cache.order import dali_shard

    parts = [dali_shard(10, s, 3) for s in range(3)]
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
