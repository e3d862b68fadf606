"""feeder="auto" decided by measurement (`loaders.fast.trial`): the loop's periods with the batches made here
and fed by the child, the verdict, and the batches coming back to the training process unchanged."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_state import _loader, _plain, _same, make_cache

from loaders.fast.trial import DEVICE, HERE, HOST, KEEP, FeederTrial, host_at_start
from loaders.tunables import HOST_FEED_FIRST, HOST_FEED_LOOK, HOST_FEED_PERIOD, TRIAL_SKIP


def _epoch(trial: FeederTrial, made: list[int], plan: str, step_s: float, fed_s: float, here_s: float = 0.0) -> None:
    """One epoch through `trial.watch`: `plan` says per batch where it is made (h: here, f: fed); the consumer
    takes `step_s` a step, a fed batch keeps it waiting `fed_s` more, one made here `here_s`."""

    def batches() -> Iterator[str]:
        for where in plan:
            if where == "h":
                made[0] += 1
            time.sleep(here_s if where == "h" else fed_s)
            yield where

    for _ in trial.watch(batches(), lambda: made[0]):
        time.sleep(step_s)


@pytest.mark.parametrize(("fed_s", "here_s", "back"), [(0.02, 0.0, True), (0.0, 0.02, False)])
def test_the_verdict_follows_the_measured_periods(fed_s: float, here_s: float, back: bool) -> None:
    """Fed batches that keep the loop waiting bring the batches back; fed ones that do not keep the feeder. The
    child's first whole epoch (its tier filling) is not counted, nor a period across the hand-over."""
    trial, made = FeederTrial(window=64, least=6, margin=0.03), [0]
    _epoch(trial, made, "hhhhhhhh", 0.002, fed_s, here_s)
    _epoch(trial, made, "hhhfffff", 0.002, fed_s, here_s)  # handed over mid-epoch: not a whole fed epoch
    assert len(trial.here) == 9 and not trial.fed and trial.whole_fed == 0
    _epoch(trial, made, "ffffffff", 0.002, fed_s, here_s)  # the child's first whole epoch: not counted
    assert trial.whole_fed == 1 and not trial.fed and trial.decide() is None
    _epoch(trial, made, "ffffffff", 0.002, fed_s, here_s)
    assert len(trial.fed) == 7
    assert trial.decide() == (HERE if back else KEEP)
    assert trial.verdict is not None and trial.verdict.startswith("batches made" if back else "feeder kept")
    assert trial.decide() is None  # said once


def test_no_batches_made_here_keeps_the_feeder() -> None:
    """wait_feeder() before training: every batch the child's, nothing to compare with."""
    trial, made = FeederTrial(least=4), [0]
    for _ in range(3):
        _epoch(trial, made, "fffff", 0.0, 0.01)
    assert trial.decide() == KEEP and "too few made in this process" in str(trial.verdict)


@pytest.mark.parametrize(
    ("fed_s", "host_s", "move"),
    [(0.0, 0.0, DEVICE), (0.0, 0.03, DEVICE), (0.03, 0.0, KEEP), (0.03, 0.06, HERE)],
)
def test_a_host_feeder_is_tried_after_the_first_child(fed_s: float, host_s: float, move: str) -> None:
    """With a host feeder to try, the first verdict waits: the host feeder's child is started, its periods counted
    from its first batches (its first few left out), and kept only where it beats the first verdict's choice by
    the margin; else that choice comes back (this process, or the first child)."""
    trial, made = FeederTrial(window=64, least=6, margin=0.1, host=True), [0]
    _epoch(trial, made, "hhhhhhhh", 0.005, fed_s, 0.01)
    _epoch(trial, made, "ffffffff", 0.005, fed_s, 0.01)  # the first child's first whole epoch
    _epoch(trial, made, "ffffffff", 0.005, fed_s, 0.01)
    assert trial.decide() == HOST and trial.verdict is None and not trial.fed
    _epoch(trial, made, "hhffff", 0.005, host_s, 0.01)  # the host feeder's child starting, then its first batches
    assert len(trial.fed) == 3 and trial.decide() is None  # too few past its first
    _epoch(trial, made, "f" * (TRIAL_SKIP + 6), 0.005, host_s, 0.01)
    assert trial.decide() == move
    said = str(trial.verdict)
    assert said.startswith("host feeder kept" if move == KEEP else "feeder kept" if move == DEVICE else "batches made")
    assert "host feeder" in said and trial.decide() is None


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cache(tmp_path_factory)


def _wanted_and_fed(made: tuple[Path, Path], options: dict[str, Any], epochs: int) -> tuple[Any, list[Any], Any]:
    """(the in-process loader, its first `epochs` epochs' batches, a loader with feeder=True and the same options)."""
    want_loader = _loader(made, {**options, "feeder": False})
    want = [[_plain(b) for b in want_loader] for _ in range(epochs)]
    return want_loader, want, _loader(made, {**options, "feeder": True})


def _epochs_same(got: list[Any], want: list[Any]) -> None:
    for e, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"epoch {e}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_batches_back_from_the_feeder_are_the_in_process_loaders(made: tuple[Path, Path], device: str) -> None:
    """The verdict taken at an epoch's end brings the batches back to this process from the same random states:
    every epoch, before, during and after the feeder, equal to the in-process loader's; the child is closed.
    On a GPU the tier filled here was lent to the child (kept here) and serves again as it was."""
    options: dict[str, Any] = {"gpu_budget": "1GiB", "prefetch": 2, "device": device}
    want_loader, want, fed = _wanted_and_fed(made, options, 5)
    fed._trial = FeederTrial(least=1, margin=-1.0)  # any fed period longer than none: always back
    try:
        it = iter(fed)
        got = [[_plain(next(it)), _plain(next(it))]]  # made here while the child imports
        assert fed.made_here == 2
        fed.wait_feeder()
        child = fed._feeder._proc
        got[0] += [_plain(b) for b in it]
        lent = fed.tier_bytes
        assert (lent > 0) == (device != "cpu")  # lent to the child and kept here on a GPU; given up on the CPU
        got += [[_plain(b) for b in fed] for _ in range(2)]  # the child's first whole epoch, then one measured
        assert fed.feeder_pid is None and child.poll() is not None  # decided at the second one's end
        assert str(fed.feeder_verdict).startswith("batches made in this process again")
        if device != "cpu":
            assert fed.tier_bytes == lent  # the tier lent is this process's again, not filled a second time
        got += [[_plain(b) for b in fed] for _ in range(2)]
        _epochs_same(got, want)
        assert fed.state_dict() == want_loader.state_dict()
    finally:
        fed.close()
        want_loader.close()


@pytest.mark.parametrize(("margin", "said"), [(-1.0, "host feeder kept"), (100.0, "feeder kept")])
def test_a_host_feeder_tried_and_kept_or_left_gives_the_in_process_loaders_batches(
    made: tuple[Path, Path], margin: float, said: str
) -> None:
    """Every move of the trial at an epoch's end (the first child closed, a host feeder's started, then kept, or
    closed and the first kind started again) leaves the batches the in-process loader's, epoch after epoch."""
    want_loader, want, fed = _wanted_and_fed(made, {"gpu_budget": 0, "prefetch": 2, "device": "cpu"}, 7)
    # margin -1: the first child kept (any period), the host feeder kept (any); 100: the first child kept, the host
    # feeder left for it
    fed._trial = FeederTrial(least=1, margin=margin, host=True)
    try:
        got: list[list[Any]] = []
        hosts: list[bool] = []
        for _ in range(7):
            fed.wait_feeder()
            got.append([_plain(b) for b in fed])
            hosts.append(fed._host_feed)
        assert str(fed.feeder_verdict).startswith(said), fed.feeder_verdict
        assert hosts[-1] == (said == "host feeder kept") and True in hosts
        assert fed.feeder_pid is not None and fed._feeder._proc.poll() is None
        _epochs_same(got, want)
        assert fed.state_dict() == want_loader.state_dict()
    finally:
        fed.close()
        want_loader.close()


def test_a_host_feeder_that_cannot_start_leaves_the_first_childs_batches(
    made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host feeder's child that fails to build its loader is said once, and the first verdict's choice (here a
    child with a device, started again) makes the batches: the in-process loader's, every epoch."""
    from loaders.fast import feeding

    monkeypatch.setattr(feeding, "_host", lambda spec, device: {**spec, "host_feed": True, "no_such_option": 1})
    want_loader, want, fed = _wanted_and_fed(made, {"gpu_budget": 0, "prefetch": 2, "device": "cpu"}, 5)
    fed._feeder_auto = True  # as feeder="auto" would on a GPU: a child's failure said, not raised
    fed._trial = FeederTrial(least=1, margin=100.0, host=True)
    try:
        got: list[list[Any]] = []
        for _ in range(5):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                fed.wait_feeder()
            assert all("the host feeder is not tried" in str(w.message) for w in said)
            got.append([_plain(b) for b in fed])
        assert str(fed.feeder_verdict).endswith("a host feeder's child could not start"), fed.feeder_verdict
        assert fed.feeder_pid is not None and not fed._host_feed
        _epochs_same(got, want)
    finally:
        fed.close()
        want_loader.close()


def test_a_host_feeder_is_chosen_for_a_drawable_tail_and_a_long_step() -> None:
    """The latest periods against `HOST_FEED_PERIOD`: from an epoch after the first made here, or from enough of
    the first; nothing said before, and never a host feeder for a tail that is not drawable (or not known to be)."""
    long, short = [HOST_FEED_PERIOD * 1.2] * (HOST_FEED_LOOK + 1), [HOST_FEED_PERIOD * 0.8] * (HOST_FEED_LOOK + 1)
    assert host_at_start(long[:-1], True, later=True) is None
    assert host_at_start(long, True, later=True) is True and host_at_start(short, True, later=True) is False
    assert host_at_start(long, True, later=False) is None  # the first epoch's: lengthened by its tier's filling
    first = [1.0] * HOST_FEED_FIRST
    assert host_at_start(first[:-1], True, later=False) is None
    assert host_at_start(first[:-HOST_FEED_LOOK] + short[:HOST_FEED_LOOK], True, later=False) is False
    assert host_at_start(long, False, later=True) is False and host_at_start(long, None, later=True) is False


@pytest.mark.parametrize(("least", "host"), [(0.02, True), (10.0, False)])
def test_the_childs_kind_is_chosen_by_the_first_periods(
    made: tuple[Path, Path], least: float, host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """feeder="auto" on a GPU (`HOST_FEED` "chosen"; forced here on the CPU): the child is told to build its loader
    once the training loop's periods with the batches made here say which kind: a host feeder's where the tail is
    drawable and the step at least `least` (each step here 0.04 s), else the first kind. The in-process loader's
    batches either way."""
    from loaders.fast import trial

    monkeypatch.setattr(trial, "HOST_FEED_PERIOD", least)
    want_loader, want, fed = _wanted_and_fed(made, {"gpu_budget": 0, "prefetch": 2, "device": "cpu"}, 12)
    fed._choosing, fed._periods = True, []
    try:
        got: list[list[Any]] = []
        while fed._choosing and len(got) < 10:
            got.append([])
            for b in fed:
                got[-1].append(_plain(b))
                time.sleep(0.04)  # the training step
        assert not fed._choosing and fed.assembly.tail.drawable() is True
        fed.wait_feeder()
        got += [[_plain(b) for b in fed] for _ in range(2)]
        assert fed._host_feed == host and (fed._feeder._host is not None) == host  # the host slots, or none
        assert fed.made_here < sum(map(len, got))  # some from the child
        _epochs_same(got, want)
    finally:
        fed.close()
        want_loader.close()
