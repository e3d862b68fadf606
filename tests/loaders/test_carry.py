"""The next epoch begun in process while the last batches of this one are trained on (`loaders.fast.carry`): the
same batches as an epoch begun when asked for, dropped (its draws put back) by anything that changes the next pass."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_state import _loader, _plain, _same, make_cache

from loaders.fast.loader import PreparedLoader

OPTIONS = {
    "tail-thread": {"gpu_budget": 0, "tail_thread": True, "prefetch": 2, "feeder": False},
    "tail-on-caller": {"gpu_budget": "1GiB", "tail_thread": False, "prefetch": 3, "feeder": False},
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cache(tmp_path_factory)


def _epochs(loader: PreparedLoader, n: int, between: Any = None) -> list[list[dict[str, Any]]]:
    out = []
    for e in range(n):
        if e and between is not None:
            between(loader)
        out.append([_plain(b) for b in loader])
    return out


@pytest.mark.parametrize("name", list(OPTIONS))
def test_an_epoch_begun_ahead_gives_the_batches_of_one_begun_when_asked(made: tuple[Path, Path], name: str) -> None:
    options = OPTIONS[name]
    ahead = _loader(made, options)
    first = [_plain(b) for b in ahead]
    carried = ahead._carry
    assert carried is not None and carried.epoch == 1
    assert carried.submitted == min(options["prefetch"], len(carried.chunks))
    rest = _epochs(ahead, 2)

    dropped: list[bool] = []

    def drop(loader: PreparedLoader) -> None:
        dropped.append(loader._carry is not None)
        loader.drop_ahead()

    asked = _epochs(_loader(made, options), 3, between=drop)
    assert dropped == [True, True]
    for e, (got, want) in enumerate(zip([first, *rest], asked)):
        _same(got, want, f"{name}: epoch {e}")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda loader: loader.set_epoch(5), id="set_epoch"),
        pytest.param(lambda loader: loader.set_random_state(9), id="set_random_state"),
        pytest.param(lambda loader: loader.shard(1, 2), id="shard"),
    ],
)
def test_a_change_between_epochs_drops_the_epoch_begun_ahead(made: tuple[Path, Path], change: Any) -> None:
    options = OPTIONS["tail-thread"]
    ahead = _loader(made, options)
    [_plain(b) for b in ahead]
    change(ahead)
    assert ahead._carry is None
    got = [_plain(b) for b in ahead]

    asked = _loader(made, options)
    [_plain(b) for b in asked]
    asked.drop_ahead()
    change(asked)
    _same(got, [_plain(b) for b in asked], "after the change")


def test_the_state_between_epochs_is_that_of_the_last_batch_delivered(made: tuple[Path, Path]) -> None:
    options = OPTIONS["tail-thread"]
    ahead = _loader(made, options)
    [_plain(b) for b in ahead]
    assert ahead._carry is not None
    saved = ahead.state_dict()
    assert ahead._carry is not None  # read, not dropped
    ahead.drop_ahead()
    assert ahead.state_dict() == saved and (saved["epoch"], saved["batch"]) == (1, 0)


def test_only_a_whole_epoch_begins_the_next(made: tuple[Path, Path]) -> None:
    options = OPTIONS["tail-thread"]
    left = _loader(made, options)
    n = len(left)
    for k, _batch in enumerate(left):  # left before its last batch: its next epoch was begun, and is dropped
        if k == n - 2:
            break
    assert left._carry is None and left.state_dict()["batch"] == n - 1
    for k, _batch in enumerate(left):  # the last batch taken, then the loop left: the epoch was delivered whole
        if k == n - 1:
            break
    assert left._carry is not None and (left.state_dict()["epoch"], left.state_dict()["batch"]) == (2, 0)
    left.close()
    assert left._carry is None


def test_each_batch_planned_takes_the_staging_slots_after_the_last_across_epochs(
    made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's reads land in pinned staging slots (on a GPU) that are read into again only once their upload
    was queued. The next epoch begun ahead takes the slots after this epoch's last batch's: numbered by the batch's
    index within its epoch, its first batch took those of this epoch's batch 0 (and of the batch `prefetch` + 2
    after it), which were still waiting for their uploads where an epoch has few batches."""
    from loaders.fast.assembly import _READS, BatchAssembly

    slots: list[int] = []
    fetch = BatchAssembly.fetch

    def spy(self: BatchAssembly, plan: Any) -> Any:
        slots.append(plan.slot)
        return fetch(self, plan)

    monkeypatch.setattr(BatchAssembly, "fetch", spy)
    loader = _loader(made, {**OPTIONS["tail-thread"], "batch_size": 3})
    n = len(loader)
    _epochs(loader, 3)
    deadline = time.monotonic() + 60  # the fourth epoch's reads are submitted to the read thread: a busy box may
    while len(slots) <= 3 * n and time.monotonic() < deadline:  # run them after this thread gets here
        time.sleep(0.01)
    loader.close()
    assert len(slots) > 3 * n  # the fourth epoch begun ahead too
    assert slots == [len(_READS) * i for i in range(len(slots))]
