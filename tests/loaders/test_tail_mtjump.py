"""numpy's Mersenne Twister jumped ahead (loaders.tail.mtjump): the very key and position drawing leaves, at every
place in a block and across its ends, for few words and for an elastic item's millions."""

from __future__ import annotations

import numpy as np
import pytest

from loaders.tail import mtjump


def _at(seed: int, drawn: int) -> tuple[np.ndarray, int]:
    g = np.random.MT19937(seed)
    g.random_raw(drawn, output=False)
    s = g.state["state"]
    return s["key"], int(s["pos"])


def _drawn(key: np.ndarray, pos: int, words: int) -> tuple[np.ndarray, int]:
    g = np.random.MT19937()
    g.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    g.random_raw(words, output=False)
    s = g.state["state"]
    return s["key"], int(s["pos"])


def _same(a: tuple[np.ndarray, int], b: tuple[np.ndarray, int]) -> bool:
    return bool(np.array_equal(a[0], b[0]) and a[1] == b[1])


def test_the_recurrence_found_is_of_the_generators_order() -> None:
    p = mtjump.charpoly()
    assert p.bit_length() == mtjump.DEGREE + 1 and p & 1  # degree 19,937, constant term 1


@pytest.mark.parametrize("drawn", [0, 1, 311, 623, 624, 625, 1_000])
@pytest.mark.parametrize("words", [0, 1, 623, 624, 625, 1_247, 1_248, 19_937, 100_003, 2 * (3 + 3 * 96**3)])
def test_a_jump_leaves_the_state_drawing_leaves(drawn: int, words: int) -> None:
    key, pos = _at(drawn + 7, drawn)
    assert _same(mtjump.jump(key, pos, words), _drawn(key, pos, words))


def test_a_batchs_starts_jumped_equal_those_drawn() -> None:
    key, pos = _at(3, 401)
    words = 2 * (3 + 3 * 64**3)
    got, want = mtjump.starts(key, pos, words, 4), mtjump.skipped(key, pos, words, 4)
    assert len(got) == len(want) == 5 and all(_same(a, b) for a, b in zip(got, want))


def test_what_the_jumped_state_draws_next_is_what_the_drawn_one_draws() -> None:
    key, pos = _at(9, 100)
    k, p = mtjump.jump(key, pos, 5_000_000)
    g, h = np.random.MT19937(), np.random.MT19937()
    g.state = {"bit_generator": "MT19937", "state": {"key": k, "pos": p}}
    h.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    h.random_raw(5_000_000, output=False)
    assert np.array_equal(g.random_raw(2_000), h.random_raw(2_000))
