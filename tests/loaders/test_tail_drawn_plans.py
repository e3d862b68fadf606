"""The item-by-item plans (`loaders.tail.drawn_plans`): `RandGaussianSharpend` and `RandCoarseDropoutd` replayed
item by item, against MONAI itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tailutil import assert_same, make_batch, reference_batches

from loaders.tail.plans import plan_of
from loaders.tail.replay import ReplayedTail


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_items_left_as_they_are_and_a_hole_over_an_infinite_range_raise_as_monai(device: str) -> None:
    """The sharpening and the dropout run item by item (graphs on a GPU, one per kind, the items they skip left as
    they are): MONAI's batches; an item holding inf whose holes are filled over its range leaves a false flag
    that raises MONAI's error, also where a graph captured before replays it."""
    import monai.transforms as mt
    from monai.transforms import Compose

    from loaders.tail.checks import raise_failed

    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no GPU here")

    def chain() -> list[Any]:
        return [mt.RandGaussianSharpend("image", prob=0.5), mt.RandCoarseDropoutd("image", prob=0.6, holes=2,
                                                                                  spatial_size=3)]  # fmt: skip

    given = [{"image": make_batch(n=4, spatial=(9, 10, 10), seed=s)["image"].to(device)} for s in range(5)]
    want = reference_batches(Compose(chain()).set_random_state(3), [{"image": b["image"].clone()} for b in given])
    tail = ReplayedTail(Compose(chain()).set_random_state(3).transforms)
    kinds = {type(p).__name__ for p in tail._chain(given[0]).plans}
    assert kinds == {"_SharpenItems", "_SharpenSecond", "_DropoutItems"}
    for b, w in zip(given, want):
        assert_same(tail.run(b), w, keys=("image",))
        raise_failed(tail.checks)
    bad = {"image": given[0]["image"].clone()}
    bad["image"][:, 0, 0, 0, 0] = float("inf")  # every item: whichever the holes fire on
    drawer = ReplayedTail(Compose([mt.RandCoarseDropoutd("image", prob=1.0, holes=2, spatial_size=3)]).transforms)
    drawer.run(given[1])  # its graph captured on a finite batch first
    with pytest.raises(OverflowError, match="Range exceeds valid bounds"):
        drawer.run(bad)
        raise_failed(drawer.checks)


def test_the_sharpenings_graphs_follow_each_filters_lengths_not_their_product() -> None:
    """RandGaussianSharpend replayed in two parts, each keyed by its own filter's kernels' lengths: over many fired
    items the kinds of each part stay within one filter's lengths (27 for three axes of three lengths), far fewer
    than the pairs of filters the items drew."""
    import monai.transforms as mt

    like = {"image": torch.empty((4, 1, 12, 12, 12), device="meta")}
    t = mt.RandGaussianSharpend("image", prob=1.0)
    t.set_random_state(5)
    first, second = plan_of(t, like).parts()
    assert second.follows and not first.follows
    kinds: tuple[set[Any], set[Any], set[Any]] = (set(), set(), set())
    for _ in range(150):
        a, b = first.draw_all(4)
        for da, db in zip(a, b):
            kinds[0].add(da.kind)
            kinds[1].add(db.kind)
            kinds[2].add((da.kind, db.kind))
    assert {k[0] for k in kinds[0]} == {"blurred"} and {k[0] for k in kinds[1]} == {"sharpened"}
    assert len(kinds[0]) <= 27 and len(kinds[1]) <= 27
    assert len(kinds[2]) > len(kinds[0]) + len(kinds[1])


def test_holes_land_where_monai_puts_them_in_an_item_of_any_layout() -> None:
    """The dropout's holes written by flat index into a contiguous copy: an item laid out channels-last comes out
    as the contiguous one does, and as MONAI's own transform makes it."""
    import monai.transforms as mt

    from loaders.tail.replay import _up

    x = make_batch(n=1, spatial=(9, 10, 10), seed=2)["image"].repeat(1, 2, 1, 1, 1)
    like = {"image": torch.empty(x.shape, dtype=x.dtype, device="meta")}
    t = mt.RandCoarseDropoutd("image", prob=1.0, holes=3, spatial_size=(2, 3, 4), fill_value=0.5)
    want = mt.RandCoarseDropoutd("image", prob=1.0, holes=3, spatial_size=(2, 3, 4), fill_value=0.5)
    want.set_random_state(4)
    t.set_random_state(4)
    plan = plan_of(t, like)
    assert type(plan).__name__ == "_DropoutItems"
    (d,) = plan.draw_items(1)
    ref = want({"image": x[0].clone()})["image"].as_subclass(torch.Tensor)
    for item in (x, x.to(memory_format=torch.channels_last_3d)):
        got = plan.apply({"image": item}, _up(d, "cpu"), d.kind)["image"]
        assert torch.equal(got[0], ref)
