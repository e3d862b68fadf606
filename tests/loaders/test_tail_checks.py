"""A batched tail's checks: raised where the tail ran, or deferred (a feeder's child) into page-locked host rows and
raised where the batch is sent; the same error as MONAI's own transform either way."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from tailutil import assert_same, make_batch, reference_batches

from loaders import tunables
from loaders.tail import BatchedTail
from loaders.tail.checks import FlagRows, raise_checks, raise_failed
from loaders.tail.device import tail_stream


def test_the_first_false_flag_raises_its_error() -> None:
    checks = [(torch.tensor(True), ValueError("a")), (torch.tensor(False), KeyError("b")), (False, OSError("c"))]
    with pytest.raises(KeyError, match="b"):
        raise_failed(checks)
    raise_failed(checks[:1])
    raise_failed([])


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")


@pytest.mark.gpu
def test_flags_deferred_after_graphs_that_copied_pinned_memory_are_read_back() -> None:
    """A graph whose capture copied pinned host memory up, replayed; then flags deferred on the same stream: read
    back right, the first false raised, and every row given back once its checks are gone."""
    _gpu()
    stream = tail_stream("cuda:0")
    host = torch.arange(8, dtype=torch.float32).pin_memory()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            up = host.to("cuda:0", non_blocking=True) * 2
        graph.replay()
        rows = FlagRows(rows=4, width=3)
        assert rows.registered
        total = torch.tensor(0.0, device="cuda:0")
        good = rows.read([(up.sum() > 0, ValueError("empty")), (torch.isfinite(total), OverflowError("inf"))])
        total.fill_(float("inf"))
        bad = rows.read([(up.sum() > 0, ValueError("empty")), (torch.isfinite(total), OverflowError("inf"))])
        too_many = rows.read([(up.sum() > 0, ValueError("x"))] * 4)
    assert good is not None and bad is not None and too_many is None  # more checks than a row: read where they are
    raise_checks([good])
    with pytest.raises(OverflowError, match="inf"):
        raise_checks([bad])
    assert len(rows.free) == 2
    del good, bad
    gc.collect()
    assert sorted(rows.free) == [0, 1, 2, 3]
    assert torch.equal(up.cpu(), 2 * host)


@pytest.mark.gpu
@pytest.mark.parametrize("captured", [True, False], ids=["graphs", "one-by-one"])
def test_a_deferred_dropout_check_equals_monai(captured: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`RandCoarseDropoutd` with a random fill, its range check deferred: the batches MONAI's, and an item holding
    inf raises MONAI's error where the deferred checks are raised, not where the tail ran."""
    import monai.transforms as mt
    from monai.transforms import Compose

    from loaders.tail import dropout

    _gpu()
    monkeypatch.setattr(tunables, "TAIL_GRAPHS", captured)

    def chain() -> list[Any]:
        return [mt.RandCoarseDropoutd("image", prob=1.0, holes=2, spatial_size=3), mt.RandFlipd("image", prob=0.5)]

    given = [{"image": make_batch(n=4, seed=s)["image"].to("cuda:0")} for s in range(3)]
    given[2]["image"][1, 0, 1, 1, 1] = float("inf")
    want = reference_batches(Compose(chain()).set_random_state(5), [{"image": b["image"].clone()} for b in given[:2]])
    tail = BatchedTail(Compose(chain())).set_random_state(5)
    tail.defer_checks = True
    stream = tail_stream("cuda:0")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = [tail(b) for b in given]  # the last one's failure not raised yet
    torch.cuda.current_stream().wait_stream(stream)
    pending = tail.take_deferred()
    assert len(pending) == 3 and tail.take_deferred() == []
    raise_checks(pending[:2])
    for g, w in zip(got[:2], want):
        assert_same(g, w, keys=("image",))
    with pytest.raises(OverflowError, match=dropout.RANGE_ERROR):
        raise_checks(pending[2:])
