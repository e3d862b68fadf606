"""numpy's legacy normal draw split across threads (loaders.tail.normals): the same numbers and the same final
state as one `RandomState.normal` call, whatever the size, the cached second number, loc and scale; declined
(the generator untouched) where it cannot be exact; MONAI's RandGaussianNoise drawing through it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from loaders.tail import normals
from loaders.tail.ahead import same_state
from loaders.tail.normals import SplitNormals, split_normal


@pytest.fixture(scope="module")
def pool() -> Any:
    with ThreadPoolExecutor(4) as p:
        yield p


def _pair(seed: int, odd_first: bool) -> tuple[np.random.RandomState, np.random.RandomState]:
    """Two generators in one state; with `odd_first` a number drawn before, so the second of a pair is cached."""
    a, b = np.random.RandomState(seed), np.random.RandomState(seed)
    if odd_first:
        a.normal(size=3)
        b.normal(size=3)
        assert a.get_state()[3] == 1
    return a, b


@pytest.mark.parametrize("size", [(1 << 19,), (1 << 19) + 1, (3, 211, 1031), (4, 112, 112, 64)])
@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("odd_first", [False, True])
def test_split_equals_one_call(size: Any, threads: int, odd_first: bool, pool: Any) -> None:
    want_r, got_r = _pair(threads * 7 + odd_first, odd_first)
    want = want_r.normal(0.5, 0.1, size)
    got = split_normal(got_r, 0.5, 0.1, size, pool, threads)
    assert got is not None
    assert got.shape == want.shape and np.array_equal(got, want)
    assert same_state(got_r.get_state(), want_r.get_state())
    assert np.array_equal(got_r.normal(size=5), want_r.normal(size=5))  # and the stream goes on alike


@pytest.mark.parametrize(
    ("size", "loc", "threads"), [((1000,), 0.0, 4), ((1 << 20,), np.zeros(1 << 20), 4), ((1 << 20,), 0.0, 1)]
)
def test_declined_where_it_would_not_pay_or_cannot_split(size: Any, loc: Any, threads: int, pool: Any) -> None:
    r = np.random.RandomState(3)
    before = r.get_state()
    assert split_normal(r, loc, 1.0, size, pool, threads) is None
    assert same_state(r.get_state(), before)


def test_pieces_that_do_not_join_are_refused(pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces started one word off (as a wrong scan would give) are found by the join check: None, r untouched."""
    true_piece = normals._piece

    def off_by_one(key: Any, pos: int, at: int, first: Any, *rest: Any) -> Any:
        return true_piece(key, pos, at + (first is None), first, *rest)

    monkeypatch.setattr(normals, "_piece", off_by_one)
    r = np.random.RandomState(5)
    before = r.get_state()
    assert split_normal(r, 0.0, 1.0, (1 << 20,), pool, 4) is None
    assert same_state(r.get_state(), before)


def test_monai_noise_drawn_through_split_normals() -> None:
    """MONAI's RandGaussianNoise with a SplitNormals as its generator: the noise and the state of a plain
    RandomState seeded alike, fired or not, item after item."""
    mt = pytest.importorskip("monai.transforms")
    torch = pytest.importorskip("torch")
    img = torch.zeros(4, 112, 112, 64)
    want_t, got_t = mt.RandGaussianNoise(prob=0.7, std=0.1), mt.RandGaussianNoise(prob=0.7, std=0.1)
    want_t.set_random_state(11)
    got_t.R = SplitNormals()
    got_t.R.set_state(want_t.R.get_state())
    fired = 0
    for _ in range(6):
        want_t.randomize(img)
        got_t.randomize(img)
        assert want_t._do_transform == got_t._do_transform
        if want_t._do_transform:
            fired += 1
            assert np.array_equal(want_t.noise, got_t.noise)
        assert same_state(want_t.R.get_state(), got_t.R.get_state())
    assert fired


def test_noise_drawn_ahead_in_pieces_equals_monai(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail's noise drawn ahead by several threads (as on a box of many cores): batch after batch the
    numbers of MONAI's chain item by item, and the pieces really drawn."""
    pytest.importorskip("monai.transforms")
    import copy

    from monai.transforms import Compose, RandGaussianNoised
    from tailutil import assert_same, make_batch, reference_batches

    from loaders.tail import BatchedTail, ahead

    splits: list[int] = []
    real = normals.split_normal

    def counted(*args: Any) -> Any:
        got = real(*args)
        splits.append(got is not None)
        return got

    monkeypatch.setattr(normals, "LEAST", 1000)
    monkeypatch.setattr(normals, "split_normal", counted)
    monkeypatch.setattr(ahead, "draw_threads", lambda: 3)
    chain = [RandGaussianNoised("image", prob=0.6, std=0.2), RandGaussianNoised("image", prob=0.9, std=0.05)]
    batches = [make_batch(n=4, spatial=(16, 16, 16), seed=s) for s in range(5)]
    want = reference_batches(Compose(copy.deepcopy(chain)).set_random_state(9), batches)
    tail = BatchedTail(Compose(copy.deepcopy(chain))).set_random_state(9)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image",))
    assert sum(splits) >= 4  # drawn ahead in pieces, not in one call
