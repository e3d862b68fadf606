"""Rand3DElasticd in the batched tail (loaders.tail.elastic): MONAI's own transform per item with its dense
offsets drawn ahead on a thread: batch after batch the numbers of MONAI's chain item by item, through a reseed;
with an affine range it stays per item (its grid draws twice per item)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import assert_same, make_batch, reference_batches  # noqa: E402

from loaders.tail import BatchedTail  # noqa: E402
from loaders.tail.ahead import ahead  # noqa: E402
from loaders.tail.batched import TailBatch  # noqa: E402
from loaders.tail.elastic import rand_3d_elastic  # noqa: E402


def _chain(**affine: Any) -> list[Any]:
    return [
        mt.Rand3DElasticd(["image", "label"], sigma_range=(2, 3), magnitude_range=(2, 5), prob=0.6,
                          mode=("bilinear", "nearest"), padding_mode="border", **affine),
        mt.RandFlipd(["image", "label"], spatial_axis=0, prob=0.5),
    ]  # fmt: skip


def _batches(sizes: list[int]) -> list[dict[str, Any]]:
    return [make_batch(n=n, spatial=(12, 10, 8), seed=s) for s, n in enumerate(sizes)]


def test_batches_equal_monai_and_the_offsets_come_drawn_ahead() -> None:
    from monai.transforms import Compose

    batches = _batches([3, 3, 3, 3, 2])
    want = reference_batches(Compose(_chain()).set_random_state(4), batches)
    tail = BatchedTail(Compose(_chain())).set_random_state(4)
    for b, w in zip(batches[:3], want[:3]):
        assert_same(tail(b), w, keys=("image", "label"))
    t = tail.transforms[0]
    early = ahead(t, t.rand_3d_elastic, "rand_offset", lambda *a: [])
    assert early is not None and early.hits > 0
    tail.set_random_state(4)  # what the thread drew from the old states is dropped
    want = reference_batches(Compose(_chain()).set_random_state(4), batches[3:])
    for b, w in zip(batches[3:], want):
        assert_same(tail(b), w, keys=("image", "label"))


def test_an_affine_range_keeps_it_per_item() -> None:
    """RandAffineGrid draws in the elastic's randomize and again when it makes the grid: per item, as MONAI."""
    from monai.transforms import Compose

    t = _chain(rotate_range=(0.1, 0.1, 0.1))[0]
    assert rand_3d_elastic(t, TailBatch(copy.deepcopy(_batches([2])[0]), 2)) is False
    batches = _batches([3, 3])
    want = reference_batches(Compose(_chain(rotate_range=(0.1, 0.1, 0.1))).set_random_state(2), batches)
    tail = BatchedTail(Compose(_chain(rotate_range=(0.1, 0.1, 0.1)))).set_random_state(2)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
