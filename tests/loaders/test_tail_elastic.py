"""The elastic transforms in the batched tail (loaders.tail.elastic). Rand3DElasticd: MONAI's own transform per
item with its dense offsets drawn ahead on a thread: batch after batch the numbers of MONAI's chain item by item,
through a reseed; with an affine range it stays per item (its grid draws twice per item). Rand2DElasticd: MONAI's
own grids, one resample for the batch: the numbers of MONAI's chain item by item."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import assert_same, make_batch, reference_batches  # noqa: E402

from loaders.tail import BatchedTail, elastic  # noqa: E402
from loaders.tail.ahead import ahead  # noqa: E402
from loaders.tail.elastic import rand_2d_elastic, rand_3d_elastic  # noqa: E402
from loaders.tail.tailbatch import TailBatch  # noqa: E402


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


@pytest.mark.parametrize("size", [None, (10, 9, 8)], ids=["own-size", "spatial_size"])
def test_the_items_draw_at_once_and_each_key_resamples_once(size: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream skips each item's words and the items draw on the draw threads: the count of words is MONAI's
    own (checked once per shape against its draw); MONAI's grids, one grid_sample per key: MONAI's numbers."""
    from concurrent.futures import Future

    from monai.transforms import Compose

    batches = _batches([4, 4, 3])
    want = reference_batches(Compose(_chain(spatial_size=size)).set_random_state(7), batches)
    tail = BatchedTail(Compose(_chain(spatial_size=size))).set_random_state(7)
    t = tail.transforms[0]
    calls = _counted_grid_samples(monkeypatch)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert calls == [n for n in (4, 4, 3) for _ in ("image", "label")], calls
    grid = size or (12, 10, 8)
    assert elastic._WORDS[(type(t.rand_3d_elastic), grid)] == 2 * (3 + 3 * math.prod(grid))
    drawn = elastic._draws(t, t.rand_3d_elastic, 2, elastic._Like(grid))
    assert all(isinstance(d, Future) for d in drawn)


def test_a_dtype_left_to_each_key_resamples_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    from monai.transforms import Compose

    batches = [{**b, "label": b["label"].float()} for b in _batches([3, 2])]  # MONAI samples each in its dtype
    mine, theirs = Compose(_chain()), Compose(_chain())
    for c in (mine, theirs):
        c.transforms[0].rand_3d_elastic.resampler.dtype = None
    want = reference_batches(theirs.set_random_state(8), batches)
    tail = BatchedTail(mine).set_random_state(8)
    calls = _counted_grid_samples(monkeypatch)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert calls == [1] * 10, calls


def test_an_item_whose_draws_end_elsewhere_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrong data is never given: a count of words that is not MONAI's fails the item's draw loudly."""
    t = _chain()[0]
    t.set_random_state(3)
    monkeypatch.setitem(elastic._WORDS, (type(t.rand_3d_elastic), (6, 6, 6)), 2 * (3 + 3 * 216) - 2)
    drawn = elastic._draws(t, t.rand_3d_elastic, 2, elastic._Like((6, 6, 6)))
    with pytest.raises(RuntimeError, match="other than the words skipped"):
        elastic.resolved(drawn[0])


@pytest.mark.parametrize("device", [None, "cpu"], ids=["the-items", "set"])
def test_without_an_affine_range_the_grids_are_made_here(device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No affine range: each item's grid made as MONAI's transform makes it, without MONAI's transform (whose
    filter and affine move between host and device): MONAI's numbers, and MONAI's dict transform never runs."""
    from monai.transforms import Compose
    from monai.transforms.spatial import dictionary

    batches = _batches([3, 4, 2])
    want = reference_batches(Compose(_chain(device=device)).set_random_state(8), batches)
    tail = BatchedTail(Compose(_chain(device=device))).set_random_state(8)

    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("MONAI's Rand3DElasticd ran")

    monkeypatch.setattr(dictionary.Rand3DElasticd, "__call__", refused)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    inner = tail.transforms[0].rand_3d_elastic
    assert tail.fallbacks == [] and str(inner.device) == "cpu"  # set as MONAI's transform sets it


AFFINE = [{"rotate_range": (0.1, 0.1, 0.1)}, {"rotate_range": (0, 0, 0.2), "scale_range": 0.1}]


@pytest.mark.parametrize("affine", AFFINE, ids=["rotate", "rotate-z-scale"])
def test_an_affine_range_is_drawn_by_monai_on_each_item(
    affine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RandAffineGrid draws in the elastic's randomize and again when it makes the grid, from its own stream: the
    offsets drawn ahead send its draws aside, MONAI's transform makes both per item; one resample per key."""
    from monai.transforms import Compose

    batches = _batches([3, 3, 2])
    want = reference_batches(Compose(_chain(**affine)).set_random_state(2), batches)
    tail = BatchedTail(Compose(_chain(**affine))).set_random_state(2)
    calls = _counted_grid_samples(monkeypatch)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert calls == [n for n in (3, 3, 2) for _ in ("image", "label")], calls
    t = tail.transforms[0]
    early = ahead(t, t.rand_3d_elastic, "rand_offset", lambda *a: [])
    assert early is not None and early.hits > 0


def test_an_affine_grid_sharing_the_offsets_stream_stays_per_item() -> None:
    """One RandomState for the grid and the offsets: their draws interleave item by item, as MONAI makes them."""
    import numpy as np
    from monai.transforms import Compose

    t = _chain(rotate_range=(0.1, 0.1, 0.1))[0]
    t.rand_3d_elastic.set_random_state(state=np.random.RandomState(5))  # the grid and the elastic share it
    assert rand_3d_elastic(t, TailBatch(copy.deepcopy(_batches([2])[0]), 2)) is False
    batches = _batches([3, 3])
    mine, theirs = Compose(_chain(rotate_range=(0.1, 0.1, 0.1))), Compose(_chain(rotate_range=(0.1, 0.1, 0.1)))
    for c in (mine, theirs):
        c.set_random_state(2)
        c.transforms[0].rand_3d_elastic.set_random_state(state=np.random.RandomState(5))
    want = reference_batches(theirs, batches)
    tail = BatchedTail(mine)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))


def test_one_stream_for_the_dict_and_its_inner_is_jumped_item_by_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dict's prob and the inner's offsets from one RandomState interleave item by item: each item's offsets
    jumped over in this thread (`stream.advance`), every batch MONAI's."""
    import numpy as np
    from monai.transforms import Compose

    from loaders.tail import mtjump

    jumps = []
    real = mtjump.starts
    monkeypatch.setattr(mtjump, "JUMP_FROM", 1)  # these small items' words jumped too
    monkeypatch.setattr(mtjump, "starts", lambda *a: jumps.append(a[2]) or real(*a))
    batches = _batches([3, 2, 3])
    mine, theirs = Compose(_chain()), Compose(_chain())
    for c in (mine, theirs):
        c.set_random_state(3)
        c.transforms[0].set_random_state(state=np.random.RandomState(9))  # the dict and its inner share it
    assert mine.transforms[0].R is mine.transforms[0].rand_3d_elastic.R
    want = reference_batches(theirs, batches)
    tail = BatchedTail(mine)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert len(jumps) == 8 and set(jumps) == {2 * (3 + 3 * 12 * 10 * 8)}  # one jump an item


def _chain_2d(**kw: Any) -> list[Any]:
    return [
        mt.Rand2DElasticd(["image", "label"], spacing=(4, 5), magnitude_range=(1, 3), prob=0.6,
                          mode=("bilinear", "nearest"), padding_mode="zeros", **kw),
        mt.RandFlipd(["image", "label"], spatial_axis=1, prob=0.5),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [{}, {"rotate_range": 0.3, "scale_range": (0.1, 0.2)}, {"spatial_size": (14, 12)}],
    ids=["plain", "affine", "resized"],
)
def test_2d_batches_equal_monai_and_resample_once_per_key(kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from monai.transforms import Compose

    batches = [make_batch(n=n, spatial=(18, 16), seed=s) for s, n in enumerate([4, 3, 4])]
    want = reference_batches(Compose(_chain_2d(**kw)).set_random_state(5), batches)
    tail = BatchedTail(Compose(_chain_2d(**kw))).set_random_state(5)
    calls = _counted_grid_samples(monkeypatch)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert calls == [n for n in (4, 3, 4) for _ in ("image", "label")], calls  # per item it would be 1s


def _counted_grid_samples(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The items of each grid_sample call from now on."""
    calls: list[int] = []
    real = torch.nn.functional.grid_sample

    def counted(x: Any, *a: Any, **k: Any) -> Any:
        calls.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "grid_sample", counted)
    return calls


def test_2d_without_its_keys_draws_nothing_and_a_dtype_left_to_each_key_stays_per_item() -> None:
    t = _chain_2d(allow_missing_keys=True)[0]
    state = t.R.get_state()[1].copy()
    assert rand_2d_elastic(t, TailBatch({"other": torch.zeros(2, 1, 8, 8)}, 2)) is True
    assert (t.R.get_state()[1] == state).all()
    t.rand_2d_elastic.resampler.dtype = None  # MONAI then resamples each key in its own dtype
    assert rand_2d_elastic(t, TailBatch(copy.deepcopy(make_batch(n=2, spatial=(8, 8))), 2)) is False


@pytest.mark.gpu
def test_2d_batches_equal_monai_on_a_gpu() -> None:
    from monai.transforms import Compose

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    batches = [{k: v.to("cuda:0") for k, v in make_batch(n=4, spatial=(18, 16), seed=s).items()} for s in range(2)]
    want = reference_batches(Compose(_chain_2d(rotate_range=0.3)).set_random_state(5), batches)
    tail = BatchedTail(Compose(_chain_2d(rotate_range=0.3))).set_random_state(5)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []


@pytest.mark.gpu
def test_3d_batches_equal_monai_on_a_gpu() -> None:
    from monai.transforms import Compose

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    batches = [{k: v.to("cuda:0") for k, v in b.items()} for b in _batches([4, 4])]
    want = reference_batches(Compose(_chain()).set_random_state(6), batches)
    tail = BatchedTail(Compose(_chain())).set_random_state(6)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
