"""numpy's legacy normal draw of one large array (`RandomState.normal`, as MONAI's `RandGaussianNoise` draws a whole
image of noise per item) made by several threads, with the same numbers and the same final state.

The legacy normal is the polar method: pairs of uniform doubles (two 32-bit words each) are drawn until a pair
lands inside the unit circle, and each accepted pair gives two numbers (the second kept for the next call). So
where the k-th number starts in the generator's stream depends on the rejections before it. A scan finds it: the
stream's raw words are generated in bulk (`random_raw`, no numbers made) and the acceptance test is run on them
vectorised (the same IEEE operations as numpy's C code), each thread scanning a segment of the stream from a
state jumped to (`loaders.tail.mtjump`). The array is then cut into one piece per thread at accepted pairs, each
piece drawn by numpy's own `normal` from the state the scan found for its start, and the pieces joined.
Exactness does not rest on the scan: each piece's end state must equal the next piece's start; where one does
not, None is returned and the caller draws the array in one call.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from typing import Any

import numpy as np

from loaders.tail.mtjump import JUMP_FROM, jump

__all__ = ["LEAST", "split_normal"]

LEAST = 1 << 19  # numbers: below this one call draws them (the scan and the threads would cost more)
_TWO_26 = 67108864.0
_ACCEPT = (
    math.pi / 4 / 4
)  # accepted pairs a word: a pair attempt takes four words and lands inside the circle pi/4 of the time


def _accepted(words: np.ndarray) -> np.ndarray:
    """For each pair attempt in `words` (4 words each), whether the polar method accepts it. numpy's C code takes
    a double u = (a * 2^26 + b) / 2^53 from two words (a = w >> 5, b = w' >> 6; an integer below 2^53, so exact) and
    x = 2u - 1, which equals u * 2^-52 - 1 exactly; then r2 = x1 * x1 + x2 * x2, accepted where 0 < r2 < 1."""
    q = words.reshape(-1, 2)
    x = (q[:, 0] >> np.uint64(5)).astype(np.float64)
    x *= _TWO_26
    x += q[:, 1] >> np.uint64(6)
    x *= 2.0**-52
    x -= 1.0
    x *= x
    r2 = x[0::2] + x[1::2]
    return (r2 < 1.0) & (r2 != 0.0)


def _mt(key: np.ndarray, pos: int) -> np.random.MT19937:
    bg = np.random.MT19937()
    bg.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    return bg


def _at(key: np.ndarray, pos: int, words: int) -> np.random.MT19937:
    """An MT19937 standing `words` words on from (key, pos): jumped where that is cheaper than drawing."""
    if words >= JUMP_FROM:
        key, pos = jump(key, pos, words)
        words = 0
    bg = _mt(key, pos)
    if words:
        bg.random_raw(words, output=False)
    return bg


def _scan(key: np.ndarray, pos: int, at: int, words: int) -> np.ndarray:
    """The running count of accepted pairs over the `words` words (a multiple of 4) from word `at` on."""
    return np.cumsum(_accepted(_at(key, pos, at).random_raw(words)))


def _piece(key: np.ndarray, pos: int, at: int, first: tuple[Any, ...] | None, loc: float, scale: float,
           count: int) -> tuple[np.ndarray, tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """`count` numbers from the state `at` words on from (key, pos) (or `first`, the caller's own state): the
    numbers, the state they started from and the state they ended at."""
    if first is None:
        st = _at(key, pos, at).state["state"]
        first = ("MT19937", np.asarray(st["key"]), int(st["pos"]), 0, 0.0)
    r = np.random.RandomState()
    r.set_state(first)
    return r.normal(loc, scale, count), first, r.get_state()


def split_normal(r: np.random.RandomState, loc: float, scale: float, size: Any, pool: Executor, threads: int) -> Any:
    """`r.normal(loc, scale, size)` drawn in `threads` pieces on `pool`, `r` left where one call leaves it; None
    (and `r` untouched) where the pieces' states do not join up or the draw is not one this splits."""
    shape = tuple(np.atleast_1d(np.asarray(size, dtype=np.int64)).tolist()) if size is not None else ()
    n = math.prod(shape)
    state = r.get_state()
    if state[0] != "MT19937" or threads < 2 or n < LEAST or not (np.isscalar(loc) and np.isscalar(scale)):
        return None
    key, pos, has_gauss = np.asarray(state[1]), int(state[2]), int(state[3])
    per = (n - has_gauss) // 2 // threads  # accepted pairs a piece
    bounds = [k * per for k in range(1, threads)]  # pairs before each piece after the first
    # the words the pairs up to the last bound take, with a margin far past their spread, cut into one
    # segment a thread (a multiple of 4 words: a pair attempt takes four)
    seg = 4 * math.ceil((bounds[-1] * 1.02 / _ACCEPT / threads + 4096) / 4)
    runs = [r_.result() for r_ in [pool.submit(_scan, key, pos, j * seg, seg) for j in range(threads)]]
    offsets, seen, j = [], 0, 0
    for b in bounds:
        while j < len(runs) and seen + int(runs[j][-1]) < b:
            seen += int(runs[j][-1])
            j += 1
        if j == len(runs):
            return None  # fewer pairs than the margin allows for: drawn in one call
        offsets.append(j * seg + 4 * (int(np.searchsorted(runs[j], b - seen)) + 1))
    counts = [has_gauss + 2 * per] + [2 * per] * (threads - 2)
    counts.append(n - sum(counts))
    firsts: list[tuple[Any, ...] | None] = [state] + [None] * (threads - 1)
    jobs = [pool.submit(_piece, key, pos, at, f, float(loc), float(scale), c)
            for at, f, c in zip([0, *offsets], firsts, counts)]  # fmt: skip
    pieces = [job.result() for job in jobs]
    for (_, _, end), (_, start, _) in zip(pieces, pieces[1:]):
        if end[2] != start[2] or end[3] != 0 or not np.array_equal(end[1], start[1]):
            return None
    r.set_state(pieces[-1][2])
    out = np.concatenate([p for p, _, _ in pieces])
    return out.reshape(shape)


class SplitNormals(np.random.RandomState):
    """A RandomState whose large `normal` draws are split across the loader's draw threads (`split_normal`);
    every other draw, and any draw the split declines, is numpy's own."""

    def normal(self, loc: Any = 0.0, scale: Any = 1.0, size: Any = None) -> Any:
        from loaders.tail.ahead import draw_threads, drawers

        if size is not None:
            got = split_normal(self, loc, scale, size, drawers(), draw_threads())
            if got is not None:
                return got
        return super().normal(loc, scale, size)
