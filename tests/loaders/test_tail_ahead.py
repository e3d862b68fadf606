"""Noise drawn ahead on a thread (loaders.tail.ahead): batch after batch, the same numbers as MONAI's chain item
by item, through reseeds, a smaller last batch, a changed crop shape and a shared random state."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from forkutil import forked_exit  # noqa: E402
from tailutil import assert_same, make_batch, reference_batches  # noqa: E402

from loaders.tail import BatchedTail  # noqa: E402
from loaders.tail.ahead import ahead  # noqa: E402

CHAIN = [
    mt.RandGaussianNoised("image", prob=0.5, std=0.2),
    mt.RandScaleIntensityd("image", factors=0.3, prob=0.5),
    mt.RandGaussianNoised("image", prob=0.7, std=0.05),
]


def _batches(sizes: list[int], spatial: tuple[int, ...] = (12, 10, 8)) -> list[dict[str, Any]]:
    return [make_batch(n=n, spatial=spatial, seed=s) for s, n in enumerate(sizes)]


def _hits(tail: BatchedTail) -> int:
    return sum(a.hits for t in tail.transforms if (a := _of(t)) is not None)


def _of(t: Any) -> Any:
    inner = getattr(t, "rand_gaussian_noise", None)
    return None if inner is None else ahead(t, inner, "noise", lambda *a: [])


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4, 4], [3, 3, 3, 2], [1, 5, 5, 5, 1], [4] * 24 + [3]])
def test_batches_equal_monai_item_by_item(sizes: list[int]) -> None:
    from monai.transforms import Compose

    batches = _batches(sizes)
    want = reference_batches(Compose(copy.deepcopy(CHAIN)).set_random_state(7), batches)
    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(7)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image",))
    assert _hits(tail) > 0  # later batches took draws made ahead


def test_draws_ahead_as_deep_as_their_expected_bytes_allow() -> None:
    """Small crops are drawn up to AHEAD_MOST batches ahead, large ones DEPTH; between, AHEAD_BYTES of the
    noise the batches are expected to draw (float64 numbers on the items the transform fires on)."""
    from monai.transforms import Compose

    from loaders.tunables import AHEAD_BYTES, AHEAD_MOST, DEPTH

    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(1)
    tail(_batches([4])[0])
    early = _of(tail.transforms[0])  # prob 0.5: a batch of 4 items is expected to draw 2 items' noise
    assert early.depth((4, (1, 12, 10, 8))) == AHEAD_MOST
    assert early.depth((4, (4, 512, 512, 256))) == DEPTH
    eight = AHEAD_BYTES // (8 * 2 * 8)  # an item's elements for which 8 batches fill AHEAD_BYTES
    assert early.depth((4, (1, eight))) == 8
    assert len(early.pending) == AHEAD_MOST  # the batches after the first, being drawn


def test_reseed_between_batches_discards_what_was_drawn_ahead() -> None:
    from monai.transforms import Compose

    batches = _batches([4, 4, 4, 4])
    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(3)
    for b in batches[:2]:
        tail(b)
    tail.set_random_state(11)  # what the thread drew from seed 3's states must not be used
    want = reference_batches(Compose(copy.deepcopy(CHAIN)).set_random_state(11), batches[2:])
    for b, w in zip(batches[2:], want):
        assert_same(tail(b), w, keys=("image",))


def _random_states(tail: BatchedTail) -> list[Any]:
    inner = [getattr(t, a) for t in tail.transforms for a in ("rand_gaussian_noise", "scaler") if hasattr(t, a)]
    return [t.R for t in tail.transforms] + [x.R for x in inner]


def test_loaded_states_mid_run_are_followed() -> None:
    """The real transforms' states set from outside (a loader state put back) win over draws made ahead."""
    from monai.transforms import Compose

    batches = _batches([4, 4, 4, 4])
    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(5)
    tail(batches[0])
    saved = [r.get_state() for r in _random_states(tail)]
    first = tail(batches[1])
    tail(batches[2])
    for r, st in zip(_random_states(tail), saved):
        r.set_state(st)
    again = tail(batches[1])
    assert torch.equal(first["image"], again["image"])
    assert not torch.equal(again["image"], batches[1]["image"])


def test_other_crop_shape_draws_inline() -> None:
    from monai.transforms import Compose

    batches = _batches([4, 4], spatial=(12, 10, 8)) + _batches([4, 4], spatial=(6, 6, 6))
    want = reference_batches(Compose(copy.deepcopy(CHAIN)).set_random_state(9), batches)
    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(9)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image",))


def test_one_shared_random_state_is_not_drawn_ahead() -> None:
    import numpy as np

    t = mt.RandGaussianNoised("image", prob=1.0)
    state = np.random.RandomState(0)
    t.set_random_state(state=state)
    assert t.R is t.rand_gaussian_noise.R
    assert ahead(t, t.rand_gaussian_noise, "noise", lambda *a: []) is None


def _in_a_forked_child(tail: BatchedTail, batches: list[dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)  # as torch's DataLoader worker does
    torch.save([tail(copy.deepcopy(b)) for b in batches], out)


@pytest.mark.parametrize("elastic", [False, True], ids=["noise", "noise+elastic"])
def test_a_forked_child_draws_as_the_parent_would(elastic: bool, tmp_path: Any) -> None:
    """A DataLoader worker forked after the tail drew ahead: the parent's draw threads are not in the child, so
    what they were drawing never comes and their pools run nothing (it hung); the child draws from the real
    states instead, batch after batch the numbers the parent gives."""
    chain = CHAIN + ([mt.Rand3DElasticd(["image", "label"], sigma_range=(2, 3), magnitude_range=(2, 5), prob=0.6,
                                        mode=("bilinear", "nearest"))] if elastic else [])  # fmt: skip
    tail = BatchedTail(chain).set_random_state(3)
    batches = _batches([3, 3, 3, 3, 3])
    for b in batches[:2]:
        tail(copy.deepcopy(b))
    assert _hits(tail) > 0  # the next batches' draws are under way on the threads
    out = str(tmp_path / "child.pt")
    assert forked_exit(_in_a_forked_child, (tail, batches[2:], out), "its parent's draw threads") == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's count: a convolution's sums may go in another order on more threads
    try:
        for got, b in zip(torch.load(out), batches[2:]):
            assert_same(got, tail(copy.deepcopy(b)), keys=("image", "label"))
    finally:
        torch.set_num_threads(threads)


def test_each_transform_draws_on_its_own_thread_and_it_ends_with_the_transform() -> None:
    """Two noise transforms draw at once (neither queued behind the other's batches ahead); a tail dropped takes
    its draw threads with it, so loaders built again and again (a validation loader each epoch) leave none."""
    import gc
    import time

    from monai.transforms import Compose

    tail = BatchedTail(Compose(copy.deepcopy(CHAIN))).set_random_state(2)
    for b in _batches([4, 4, 4]):
        tail(b)
    first, second = _of(tail.transforms[0]), _of(tail.transforms[2])
    threads = [*first.pending._pool._threads, *second.pending._pool._threads]
    assert len(threads) == 2 and all(t.name.startswith("loaders-draws") and t.is_alive() for t in threads)
    del tail, first, second
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in threads)
