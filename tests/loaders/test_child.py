"""The feeder's child: which hand-over slots it may fill (`loaders.fast.child.Slots`), freed by the parent's tally."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from loaders.fast.child import Slots
from loaders.fast.feeder import Tally


@pytest.fixture
def tally() -> Iterator[Tally]:
    fd = Tally.descriptor()
    t = Tally(fd)
    os.close(fd)
    yield t
    t.close()


def test_slots_are_taken_in_turn_and_freed_in_the_order_the_parent_takes_them(tally: Tally) -> None:
    slots = Slots(3, tally)
    assert [slots.take() for _ in range(3)] == [0, 1, 2]
    for at in (0, 1):
        slots.sent(at)
    slots.sent(None)  # a batch sent without a slot: the parent counts it too
    slots.sent(2)
    tally.set(1)  # the parent took the first batch: slot 0 only
    assert slots.take() == 0
    assert slots.state == ["packed", "sent", "sent"]
    tally.set(3)  # slot 1's batch and the one without a slot
    assert slots.take() == 1
    assert slots.state == ["packed", "packed", "sent"]


def test_a_full_ring_waits_for_the_parent_then_goes_on(tally: Tally) -> None:
    slots = Slots(2, tally)
    for _ in range(2):
        slots.sent(slots.take())
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.take()))
    waiter.start()
    time.sleep(0.05)
    assert got == [] and waiter.is_alive()  # both slots with the parent
    tally.set(1)
    waiter.join(5)
    assert got == [0]


def test_a_new_epoch_frees_what_was_sent_and_dropping_frees_what_was_not(tally: Tally) -> None:
    slots = Slots(3, tally)
    a, b, c = slots.take(), slots.take(), slots.take()
    slots.sent(a)
    slots.sent(b)
    slots.new_epoch()  # the parent asked again: what it was sent is taken or dropped
    assert slots.state == ["free", "free", "packed"]
    slots.drop_unsent()
    assert slots.state == ["free", "free", "free"]
    assert c == 2


def test_closing_ends_a_wait_for_a_slot(tally: Tally) -> None:
    slots = Slots(1, tally)
    slots.sent(slots.take())
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            slots.take()
        except EOFError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    slots.close()
    waiter.join(5)
    assert not waiter.is_alive() and len(errors) == 1
