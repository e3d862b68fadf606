"""A batch's items moved past in a helper process (loaders.tail.stream): numpy's own states, the ones skipping in
the thread gives; the elastic tail equal to MONAI through it, and without it where the helper cannot run."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from loaders.tail import stream
from loaders.tail.ahead import same_state, skip


def _skipped(r: np.random.RandomState, words: int, items: int) -> list[Any]:
    out = []
    for _ in range(items):
        out.append(r.get_state())
        skip(r, words)
    return out


@pytest.mark.parametrize(
    ("words", "items"), [(1, 1), (2 * 624 + 7, 3), (2 * (3 + 3 * 20**3), 4), (2 * (3 + 3 * 72**3), 3)]
)
def test_the_helpers_starts_are_those_of_skipping_in_the_thread(words: int, items: int) -> None:
    r = np.random.RandomState(11)
    r.uniform(size=3)
    r.standard_normal()  # a cached Gaussian: kept in every state, as skipping keeps it
    q = np.random.RandomState()
    q.set_state(r.get_state())
    stream.close()
    stream.starts(np.random.RandomState(0), words, items)  # the first is drawn here while the helper gets ready
    assert stream.ready(60)
    got = stream.starts(r, words, items)
    want = _skipped(q, words, items)
    assert stream._STATE["helper"] is not None  # the helper ran
    assert all(same_state(a, b) for a, b in zip(got, want)) and len(got) == items
    assert same_state(r.get_state(), q.get_state())
    assert r.uniform() == q.uniform()


def test_while_the_helper_gets_ready_the_thread_draws_and_then_the_helper_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream.close()
    calls: list[str] = []
    for name in ("skipped", "moved"):
        real = getattr(stream.mtjump, name)
        monkeypatch.setattr(stream.mtjump, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    words = 2 * (3 + 3 * 72**3)
    r, q = np.random.RandomState(4), np.random.RandomState(4)
    got = stream.starts(r, words, 2)  # the helper starts and gets ready on a thread: this batch drawn here
    assert calls == ["skipped"] and stream._STATE["warming"] is not None
    assert stream.ready(60) and stream._STATE["warming"] is None
    got += stream.starts(r, words, 2)  # the helper's (its own process: nothing called here)
    assert calls == ["skipped"]
    assert all(same_state(a, b) for a, b in zip(got, _skipped(q, words, 4)))
    stream.close()


def test_a_helper_that_cannot_start_leaves_the_skipping_to_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    stream.close()

    def fails() -> None:
        raise OSError("no process here")

    monkeypatch.setattr(stream, "_Helper", fails)
    monkeypatch.setattr(stream.mtjump, "JUMP_FROM", 1)  # the thread jumps, as the helper would
    r, q = np.random.RandomState(2), np.random.RandomState(2)
    got = stream.starts(r, 1000, 3)
    assert stream._STATE["failed"] and stream._STATE["helper"] is None
    assert all(same_state(a, b) for a, b in zip(got, _skipped(q, 1000, 3)))
    stream.close()  # a later use tries again
    assert not stream._STATE["failed"]


def test_a_helper_that_dies_is_replaced_by_the_thread_and_close_stops_it() -> None:
    r, q = np.random.RandomState(5), np.random.RandomState(5)
    stream.starts(r, 10, 1)
    helper = stream._STATE["helper"]
    assert helper is not None and stream.ready(60)
    helper.proc.kill()
    helper.proc.wait()
    skip(q, 10)
    got = stream.starts(r, 77, 2)
    assert all(same_state(a, b) for a, b in zip(got, _skipped(q, 77, 2)))
    stream.close()
    r2 = np.random.RandomState(1)
    stream.starts(r2, 10, 1)
    proc = stream._STATE["helper"].proc
    stream.close()
    assert proc.poll() is not None and stream._STATE["helper"] is None


def _in_the_child(parents: Any) -> None:
    """In a forked child: none of the parent's helper, and one of its own that works."""
    ok = stream._STATE["helper"] is None
    r, q = np.random.RandomState(3), np.random.RandomState(3)
    ok = ok and all(same_state(a, b) for a, b in zip(stream.starts(r, 50, 2), _skipped(q, 50, 2)))
    ok = ok and stream._STATE["helper"] is not None and stream._STATE["helper"] is not parents
    stream.close()
    os._exit(0 if ok else 1)


def test_a_forked_child_starts_its_own_helper() -> None:
    from forkutil import forked_exit

    stream.starts(np.random.RandomState(0), 10, 1)
    parents = stream._STATE["helper"]
    assert parents is not None
    assert forked_exit(_in_the_child, (parents,), "its own stream helper") == 0
    assert stream._STATE["helper"] is parents and parents.proc.poll() is None  # the parent's is untouched


def test_the_elastic_tail_through_the_helper_equals_monai(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from monai.transforms import Compose, Rand3DElasticd, RandFlipd
    from tailutil import assert_same, make_batch, reference_batches

    from loaders.tail import BatchedTail

    asked: list[tuple[int, int]] = []
    real = stream._asked
    monkeypatch.setattr(
        stream, "_asked", lambda key, pos, words, items: asked.append((words, items)) or real(key, pos, words, items)
    )

    def chain() -> list[Any]:
        return [Rand3DElasticd(["image", "label"], sigma_range=(2, 3), magnitude_range=(2, 5), prob=1.0,
                               mode=("bilinear", "nearest"), padding_mode="border"),
                RandFlipd(["image", "label"], spatial_axis=0, prob=0.5)]  # fmt: skip

    batches = [make_batch(n=3, spatial=(12, 10, 8), seed=s) for s in range(4)]
    want = reference_batches(Compose(chain()).set_random_state(4), batches)
    tail = BatchedTail(Compose(chain())).set_random_state(4)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert asked and all(items == 3 and words == 2 * (3 + 3 * 12 * 10 * 8) for words, items in asked)
