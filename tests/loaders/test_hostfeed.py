"""The host feeder (`BLOCKPREP_HOST_FEED=1`): a child that reads, crops and draws on the CPU, its batches' large
arrays handed over through shared memory and their tails' work replayed in the training process: the in-process
loader's batches, batch for batch, through epochs left early, reseeding and resuming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_feeder import _run
from test_state import _loader, _plain, _same, make_cache

from loaders import tunables
from loaders.fast.hostfeed import HostRing, HostSlots, InHost, Taker
from loaders.tail.plans import Drawn
from loaders.tail.replay import DRAWN, Drawings


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cache(tmp_path_factory)


class _Tally:
    def __init__(self) -> None:
        self.n = 0

    def get(self) -> int:
        return self.n

    def set(self, n: int) -> None:
        self.n = n


def test_a_batch_goes_through_the_slots_as_it_was_made() -> None:
    """Large arrays (the batch's tensors, a per-item draw) and every draw by slot, small entries of the batch and
    the rest by value; the parent's views are the child's numbers; a slot is freed once the batch after it is
    taken."""
    tally = _Tally()
    ring = HostRing(3, tally)
    said: list[tuple[Any, ...]] = []
    image = torch.arange(2 * 4096, dtype=torch.float32).reshape(2, 1, 64, 32, 2)
    offsets = np.random.default_rng(0).random((1, 3, 96, 96, 96), dtype=np.float32)  # copied in pieces
    drawn = Drawings([Drawn(("x",), {"flip": np.array([1, 0])}), [Drawn((), {}), Drawn(("d",), {"offset": offsets})]])
    batch = {"image": image, "_items": torch.tensor([3, 5]), "name": ["a", "b"], "weight": np.ones(3), DRAWN: drawn}
    at, out = ring.pack(batch, lambda *m: said.append(m))
    assert at == 0 and said[0][0] == "hostslots"
    assert isinstance(out["image"], InHost)
    assert isinstance(out[DRAWN].drawn[1][1].values["offset"], InHost)
    assert isinstance(out[DRAWN].drawn[0].values["flip"], InHost)  # a draw of two numbers too
    assert isinstance(out["weight"], np.ndarray)  # a small entry of the batch: by value
    slots = HostSlots(*said[0][1:])
    got = slots.views(at, out)
    assert torch.equal(got["image"], image)
    assert np.array_equal(got[DRAWN].drawn[1][1].values["offset"].numpy(), offsets)
    assert got[DRAWN].drawn[0].values["flip"].tolist() == [1, 0] and got["weight"].tolist() == [1.0, 1.0, 1.0]
    assert got["name"] == ["a", "b"]
    slots.taken(tally, 1, None)
    assert tally.n == 0  # its slot is still read until the next batch is taken
    slots.taken(tally, 2, None)
    assert tally.n == 1
    slots.close()


def test_a_batch_larger_than_the_slots_goes_by_value() -> None:
    ring = HostRing(2, _Tally())
    said: list[tuple[Any, ...]] = []
    ring.pack({"image": torch.zeros(4096)}, lambda *m: said.append(m))
    at, out = ring.pack({"image": torch.ones(40 << 20, dtype=torch.uint8)}, lambda *m: said.append(m))
    assert at is None and len(said) == 1
    assert np.array_equal(out["image"].array, np.ones(40 << 20, dtype=np.uint8))


@pytest.mark.parametrize(
    ("options", "thread"),
    [
        pytest.param({"gpu_budget": 0, "prefetch": 2}, "gpu", id="cpu"),
        pytest.param({"gpu_budget": 0, "prefetch": 2}, True, id="cpu-taken-on-a-thread"),
        pytest.param(
            {"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0"}, "gpu", id="gpu", marks=pytest.mark.gpu
        ),  # fmt: skip
        pytest.param(
            {"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0"}, False, id="gpu-taken-here", marks=pytest.mark.gpu
        ),  # fmt: skip
    ],
)
def test_host_fed_batches_are_the_in_process_loaders(
    made: tuple[Path, Path], options: dict[str, Any], thread: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the batches taken on a thread of this process (`Taker`) and without it."""
    want_loader = _loader(made, {**options, "feeder": False})
    want = _run(want_loader)
    monkeypatch.setattr(tunables, "HOST_FEED", True)
    monkeypatch.setattr(tunables, "HOST_TAKE_THREAD", thread)
    fed = _loader(made, {**options, "feeder": True})
    try:
        fed.wait_feeder()  # every batch from the child
        got = _run(fed)
        for e, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"epoch {e}")
        assert fed._feeder._host is not None  # the batches came through the host slots
        assert fed.state_dict() == want_loader.state_dict()
        resumed = _loader(made, {**options, "feeder": True})
        resumed.load_state_dict(want_loader.state_dict())
        _same([_plain(b) for b in resumed], [_plain(b) for b in want_loader], "resumed")
        resumed.close()
    finally:
        fed.close()
    assert fed._feeder._proc.poll() is not None


_AUGMENTED = """
from monai.transforms import RandAffined, RandCoarseDropoutd, RandGaussianSharpend
transform = Compose(transform.transforms + (
    RandAffined(keys="image", prob=0.6, rotate_range=(0.1, 0.1, 0.1), scale_range=(0.1, 0.1, 0.1)),
    RandGaussianSharpend(keys="image", prob=0.6),
    RandCoarseDropoutd(keys="image", prob=0.6, holes=2, spatial_size=2),
))
"""


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"gpu_budget": 0, "prefetch": 2, "device": "cpu"}, id="cpu"),
        pytest.param({"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0"}, id="gpu", marks=pytest.mark.gpu),
    ],
)
def test_an_affine_a_sharpening_and_a_dropout_drawn_in_the_child(
    made: tuple[Path, Path], options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`seg-aug`'s transforms whose work follows their draws (the affine's products made on the host, the
    sharpening's kernels, the dropout's holes and fills): drawn in the child, worked here from those draws alone,
    the in-process loader's batches."""
    from test_folds import CHAINS

    source = CHAINS["posneg-3d"][2] + _AUGMENTED
    want_loader = _loader(made, {**options, "feeder": False}, source)
    want = _run(want_loader)
    assert want_loader.assembly.tail.drawable() is True
    monkeypatch.setattr(tunables, "HOST_FEED", True)
    fed = _loader(made, {**options, "feeder": True}, source)
    replayed = []
    tail = type(fed.assembly.tail)
    replay = tail.replay_drawn
    monkeypatch.setattr(tail, "replay_drawn", lambda self, *a: replayed.append(1) or replay(self, *a))
    try:
        fed.wait_feeder()
        got = _run(fed)
        for e, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"epoch {e}")
        assert fed._feeder._host is not None and len(replayed) >= sum(len(epoch) for epoch in got)  # some ahead
    finally:
        fed.close()


def test_described_offsets_go_by_value() -> None:
    """A child's described draw (its generator's state, 2.5 KB) goes in the message, not a slot: the parent makes
    the numbers (`loaders.tail.uniforms`)."""
    from loaders.tail.uniforms import Uniforms

    tally = _Tally()
    ring = HostRing(3, tally)
    said: list[tuple[Any, ...]] = []
    key = np.random.RandomState(2).get_state()[1]
    u = Uniforms(key, 17, -1.0, 1.0, (1, 3, 96, 96, 96)).astype(np.float32)
    image = torch.arange(2 * 4096, dtype=torch.float32).reshape(2, 1, 64, 32, 2)
    batch = {"image": image, DRAWN: Drawings([[Drawn(("d",), {"offset": u})]])}
    at, out = ring.pack(batch, lambda *m: said.append(m))
    sent = out[DRAWN].drawn[0][0].values["offset"]
    assert isinstance(sent, Uniforms) and sent.pos == 17 and np.array_equal(sent.key, key)
    assert isinstance(out["image"], InHost)


def test_the_taker_hands_over_in_order_raises_what_ended_it_and_stops_while_waiting() -> None:
    """`Taker`: the batches in order, one ahead of the caller; an error of `take` raised by `next`; `stop` returns
    while the thread waits for a message that never comes, or for the caller to take one."""
    import threading
    import time

    taken: list[int] = []

    def take(k: int) -> int:
        if k == 5:
            raise ValueError("batch 5 is bad")
        taken.append(k)
        return k * 10

    taker = Taker(take, lambda timeout: True, "cpu", 2, 7)
    assert [taker.next(), taker.next()] == [20, 30]
    time.sleep(0.3)
    assert taken == [2, 3, 4]  # one ahead, none past it: 5 raises only once the caller has taken 4
    assert taker.next() == 40
    with pytest.raises(ValueError, match="batch 5 is bad"):
        taker.next()
    taker.stop()

    come = threading.Event()
    waiting = Taker(take, lambda timeout: come.wait(timeout), "cpu", 0, 3)
    time.sleep(0.2)
    waiting.stop()  # nothing came: it leaves from its wait
    assert not waiting._thread.is_alive()
    ahead = Taker(take, lambda timeout: True, "cpu", 0, 4)
    time.sleep(0.2)
    ahead.stop()  # one taken, nobody asking: it leaves from its wait for the caller
    assert not ahead._thread.is_alive() and taken[-1] == 0


def test_the_taker_takes_a_batch_just_in_time_for_the_callers_next() -> None:
    """Once it has seen the caller's period, each take starts that period after the caller's last `next`, less the
    median take and a margin: a caller 50 ms a step with takes of 10 ms finds each taken about 3 ms before asking."""
    import time

    began: list[float] = []

    def take(k: int) -> int:
        began.append(time.perf_counter())
        time.sleep(0.01)
        return k

    taker = Taker(take, lambda timeout: True, "cpu", 0, 8)
    asked = []
    for k in range(8):
        time.sleep(0.05)  # the caller's step
        asked.append(time.perf_counter())
        assert taker.next() == k
    taker.stop()
    # take k+1 began after the caller asked for k (one ahead); from the fourth on, late in the caller's step (about
    # 37 ms after its ask: the median, so that a busy machine's late wake-up does not decide it)
    assert all(b > a for a, b in zip(asked, began[1:]))
    late = sorted(b - a for a, b in zip(asked[3:], began[4:]))
    assert late[len(late) // 2] > 0.02, late


def test_one_long_take_does_not_pull_the_next_ones_into_the_callers_step() -> None:
    """A take many times the others (one that captured a new graph) is late once; the takes after it still start late
    in the caller's step, not at its `next` (as the longest take would have them start)."""
    import time

    began: list[float] = []

    def take(k: int) -> int:
        began.append(time.perf_counter())
        time.sleep(0.04 if k == 3 else 0.005)
        return k

    taker = Taker(take, lambda timeout: True, "cpu", 0, 10)
    asked = []
    for k in range(10):
        time.sleep(0.05)
        asked.append(time.perf_counter())
        assert taker.next() == k
    taker.stop()
    late = sorted(b - a for a, b in zip(asked[4:], began[5:]))  # the takes after the long one
    assert late[len(late) // 2] > 0.025, late


def test_an_epochs_second_take_is_timed_by_the_last_epochs() -> None:
    """The feeder keeps the takes' timing across epochs (`TakeTimes`): the next epoch's first batch is taken at once,
    its second late in the caller's step, as the last epoch's were (not at once, as a taker without a history)."""
    import time

    from loaders.fast.hostfeed import TakeTimes

    began: list[float] = []

    def take(k: int) -> int:
        began.append(time.perf_counter())
        time.sleep(0.005)
        return k

    times = TakeTimes()
    for n in (6, 3):
        began.clear()
        taker = Taker(take, lambda timeout: True, "cpu", 0, n, times)
        asked = []
        for k in range(n):
            time.sleep(0.05)
            asked.append(time.perf_counter())
            assert taker.next() == k
        taker.stop()
    assert began[1] - asked[0] > 0.025, (began, asked)


def test_the_take_margin_follows_the_callers_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An "auto" margin starts at 3 ms, comes down a quarter of a ms with each batch ready when asked for and goes up
    a ms with each the caller waited for, within its bounds; a fixed one (ms) is what it says."""
    from loaders.fast import hostfeed
    from loaders.fast.hostfeed import TakeTimes

    monkeypatch.setattr(tunables, "HOST_TAKE_MARGIN", "auto")
    times = TakeTimes()
    assert times.margin_now() == pytest.approx(0.003)
    for _ in range(4):
        times.asked(0.0)
    assert times.margin_now() == pytest.approx(0.002)
    times.asked(0.005)
    assert times.margin_now() == pytest.approx(0.003)
    for _ in range(100):
        times.asked(0.0)
    assert times.margin_now() == pytest.approx(hostfeed.MARGIN_LEAST)
    for _ in range(100):
        times.asked(0.01)
    assert times.margin_now() == pytest.approx(hostfeed.MARGIN_MOST)
    assert len(times.asks) == hostfeed.Taker.KEPT + 1
    monkeypatch.setattr(tunables, "HOST_TAKE_MARGIN", 1.5)
    assert TakeTimes().margin_now() == pytest.approx(0.0015)


def test_the_next_batch_is_taken_ahead_of_the_callers(made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the child has made it, the next batch is taken (and its tail's work queued) before the caller's batch is
    handed over, so that its work runs beside the caller's step: the same batches, one more taken."""
    import time

    want = [_plain(b) for b in _loader(made, {"gpu_budget": 0, "batch_size": 1, "feeder": False})]
    monkeypatch.setattr(tunables, "HOST_FEED", True)
    fed = _loader(made, {"gpu_budget": 0, "batch_size": 1, "feeder": True})
    try:
        fed.wait_feeder()
        batches = iter(fed)
        got = [_plain(next(batches))]
        time.sleep(3.0)  # the child makes the batches its credits allow
        got.append(_plain(next(batches)))
        assert fed._feeder._taken == 3  # the caller's second, and the third taken ahead of it
        got += [_plain(b) for b in batches]
        _same(got, want, "taken ahead")
    finally:
        fed.close()
