"""`loaders.state.Draws` snapshots: always what `RandomState.get_state()` says, read cheaply when nothing drew."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from monai.transforms import Compose, RandFlipd, RandGaussianNoised, RandScaleIntensityd, RandSpatialCropd

from loaders.state import Draws, as_state

KEYS = ["image", "label"]


def _chain() -> Compose:
    chain = Compose([
        RandSpatialCropd(keys=KEYS, roi_size=(8, 8, 8), random_size=False),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        RandGaussianNoised(keys="image", prob=1.0, std=0.1),
    ])  # fmt: skip
    chain.set_random_state(3)
    return chain


def _same(a: Any, b: Any) -> bool:
    a, b = as_state(a), as_state(b)
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _check(draws: Draws) -> dict[int, tuple[Any, ...]]:
    snap = draws.take()
    truth = {i: o.R.get_state() for i, o in enumerate(draws.objs)}
    assert snap.keys() == truth.keys() and all(_same(snap[i], truth[i]) for i in truth)
    return snap


def test_snapshots_equal_get_state_through_draws_gaussians_puts_and_new_generators() -> None:
    chain = _chain()
    draws = Draws(chain)
    item = {"image": torch.rand(1, 16, 16, 16), "label": torch.rand(1, 16, 16, 16)}
    first = _check(draws)
    again = _check(draws)  # nothing drew: every snapshot is the one held
    assert all(again[i] is first[i] for i in first)
    for _ in range(3):
        chain(dict(item))
        _check(draws)
    # a legacy normal caches a second Gaussian (position moved), the next uses it (position unchanged)
    noise = next(o for o in draws.objs if type(o).__name__ == "RandGaussianNoise")
    noise.R.normal()
    cached = _check(draws)
    assert any(as_state(s)[3] for s in cached.values())
    noise.R.normal()
    used = _check(draws)
    assert not any(as_state(s)[3] for s in used.values())
    draws.put(cached)  # back to the state holding the cached Gaussian: the same words, another state
    assert _same(_check(draws)[draws.objs.index(noise)], cached[draws.objs.index(noise)])
    chain.set_random_state(11)  # new generators replace R
    _check(draws)
    noise.R.seed(5)
    _check(draws)


def test_generators_are_read_in_place_on_this_numpy() -> None:
    """The cheap path runs here (else every snapshot is a get_state: correct, ~35 us each): get_state only
    on a generator's first sight, never again, drawn or not."""
    draws = Draws(_chain())
    draws.take()
    assert all(s._mt and s._aug for s in draws._snaps)
    calls: list[int] = []
    for obj in draws.objs:
        obj.R = _Counting(obj.R, calls)
    draws.take()
    assert calls  # new generator objects: found and read whole
    seen = len(calls)
    draws.take()
    assert len(calls) == seen  # nothing drew since: none read whole
    draws.objs[1].R.rand()
    draws.objs[2].R.normal()  # a Gaussian cached: only the bytes past the words changed
    snap = draws.take()
    assert len(calls) == seen  # two drew: read in place all the same
    for i, obj in enumerate(draws.objs):
        truth = np.random.RandomState.get_state(obj.R)
        assert _same(snap[i], truth)
    assert as_state(snap[2])[3] == 1


class _Counting(np.random.RandomState):
    """A RandomState with the same state that counts get_state calls."""

    def __init__(self, r: np.random.RandomState, calls: list[int]) -> None:
        super().__init__()
        self.set_state(r.get_state())
        self._calls = calls

    def get_state(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._calls.append(1)
        return super().get_state(*args, **kwargs)


def test_put_gives_each_its_state_where_a_shared_generator_was_split() -> None:
    """RandSpatialCropSamples shares its RandomState with its inner crop until a draw re-seeds each with
    set_random_state(seed=): a snapshot taken after (two states) put into a copy still sharing one (a feeder's
    training process, which never draws) gives each its own state, so the two sides' snapshots agree."""
    from monai.transforms import RandSpatialCropSamplesd

    from loaders.state import same

    def chain() -> Compose:
        c = Compose([RandSpatialCropSamplesd(keys="image", roi_size=(4, 4), num_samples=2, random_size=False)])
        c.set_random_state(3)
        return c

    drawn, idle = chain(), chain()
    samples = drawn.transforms[0].cropper
    assert samples.R is samples.cropper.R and idle.transforms[0].cropper.R is idle.transforms[0].cropper.cropper.R
    drawn({"image": torch.zeros((1, 9, 9))})  # re-seeds both (each its own) and draws from the inner one
    assert samples.R is not samples.cropper.R
    snap = Draws(drawn).take()
    mine = Draws(idle)
    mine.put(snap)
    assert same(mine.take(), snap)
    assert all(np.array_equal(a, b) for a, b in zip(as_state(mine.take()[2]), samples.R.get_state()))
