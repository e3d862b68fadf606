"""MONAI's draws made ahead on a thread: a transform whose draws are costly (`RandGaussianNoised` draws a whole
image of numpy normals per item: 3.2 M numbers, 60-160 ms, for a 4x112x112x64 crop) has the next batch's draws
ready when the batch reaches it.

Exactness does not rest on a guess. The thread draws with *copies* of the transform and of its inner transform,
whose random states continue from the real ones; each batch of draws records the states it started from and
ended at. A batch's draws are used only when the real transforms' states equal the recorded start (so nothing
else drew or reseeded in between) and the batch has the predicted size and shape; the real states are then set
to the recorded end, exactly where drawing inline would leave them. Anything else (a reseed, a loaded loader
state, the last smaller batch) discards what was drawn ahead and draws inline. numpy releases the GIL while it
fills an array, so the thread's draws overlap the loader's other work.

Where an item's draws take a known number of the generator's words whatever they draw (uniform numbers only,
checked once per transform and shape against MONAI's own draw: `loaders.tail.elastic`), the items of a batch draw at
once on `draw_threads()` threads: the generator is moved past each item's words (jumped: `loaders.tail.stream`,
`loaders.tail.mtjump`; no numbers made), each item draws from the state its own words start at, and its end state
must be the next item's start.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.reading.ahead import InOrder
from loaders.tunables import AHEAD_BYTES, AHEAD_MOST, DEPTH

Draw = Callable[[Any, Any, int, Any], list[Any]]  # (transform, inner, n, like) -> each item's draw or None
Key = tuple[int, tuple[int, ...]]  # (items, an item's shape)
Expected = Callable[[Key], float]  # a batch's draws' expected bytes


@dataclass(frozen=True)
class _Drawn:
    key: tuple[int, tuple[int, ...]]  # (items, an item's shape)
    before: tuple[Any, Any]  # (transform, inner) random states the draws started from
    after: tuple[Any, Any]
    last: tuple[bool, bool, Any]  # the attributes the last draw left: transform's and inner's _do_transform, value
    drawn: list[Any]


class _Like:
    """What a transform's `randomize(img)` reads of its image: the shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _states(t: Any, inner: Any) -> tuple[Any, Any]:
    return t.R.get_state(), inner.R.get_state()


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    return all(same_state(x, y) for x, y in zip(a, b))


def _copies(t: Any, inner: Any, states: tuple[Any, Any]) -> tuple[Any, Any]:
    """Shallow copies drawing from their own random states, started at `states`."""
    tc, ic = copy.copy(t), copy.copy(inner)
    tc.R, ic.R = np.random.RandomState(), np.random.RandomState()
    tc.R.set_state(states[0])
    ic.R.set_state(states[1])
    return tc, ic


class Ahead:
    """The draws of one (transform, inner transform) pair, `DEPTH` batches ahead of their use, or as many more
    as `expected` (a batch's draws' expected bytes) allows within `AHEAD_BYTES`, up to `AHEAD_MOST`, on a thread
    of its own (two such transforms draw at once, neither queued behind the other's batches)."""

    def __init__(self, t: Any, inner: Any, attr: str, draw: Draw, expected: Expected | None = None) -> None:
        self.t: Any = weakref.proxy(t)  # the registry's key: a strong reference would keep it alive
        self.inner, self.attr, self.draw, self.expected = inner, attr, draw, expected
        self.pending = InOrder(threads=1, name="loaders-draws")
        self.hits = self.misses = 0
        # a transform gone: its batches not yet drawn never are, and its thread ends
        weakref.finalize(t, self.pending.close, wait=False)
        _LIVE.add(self)

    def take(self, n: int, shape: tuple[int, ...]) -> list[Any]:
        """Each of `n` items' draws, as drawing inline now would give them; the real transforms' states (and
        the attributes a draw sets) end where inline drawing would leave them."""
        key, now = (n, tuple(shape)), _states(self.t, self.inner)
        got = self._ready(key, now)
        if got is None:
            self.misses += 1
            drawn = self.draw(self.t, self.inner, n, _Like(key[1]))
            self.pending.forget()  # drawn from states that are no longer the real ones
            self._schedule(key, _states(self.t, self.inner))
            return drawn
        self.hits += 1
        self.t.R.set_state(got.after[0])
        self.inner.R.set_state(got.after[1])
        self.t._do_transform, self.inner._do_transform = got.last[0], got.last[1]
        setattr(self.inner, self.attr, got.last[2])
        if not self.pending:
            self._schedule(key, got.after)
        return got.drawn

    def _ready(self, key: tuple[int, tuple[int, ...]], now: tuple[Any, Any]) -> _Drawn | None:
        if not self.pending:
            return None
        got: _Drawn = self.pending.take()
        if got.key != key or not _same(got.before, now):
            return None
        while len(self.pending) < self.depth(key):
            self._extend(key)
        return got

    def depth(self, key: Key) -> int:
        """Batches of shape `key` drawn ahead."""
        if self.expected is None:
            return DEPTH
        return max(DEPTH, min(AHEAD_MOST, int(AHEAD_BYTES // max(self.expected(key), 1.0))))

    def _schedule(self, key: Key, start: tuple[Any, Any]) -> None:
        """Draw the next `depth` batches on the thread, from copies started at `start`."""
        tc, ic = _copies(self.t, self.inner, start)
        self._copies = (tc, ic)
        for _ in range(self.depth(key)):
            self._extend(key)

    def _extend(self, key: tuple[int, tuple[int, ...]]) -> None:
        tc, ic = self._copies
        self.pending.submit(self._job, tc, ic, key)

    def _job(self, tc: Any, ic: Any, key: tuple[int, tuple[int, ...]]) -> _Drawn:
        before = _states(tc, ic)
        drawn = self.draw(tc, ic, key[0], _Like(key[1]))
        last = (bool(tc._do_transform), bool(ic._do_transform), getattr(ic, self.attr, None))
        return _Drawn(key, before, _states(tc, ic), last, drawn)


_AHEAD: weakref.WeakKeyDictionary[Any, Ahead] = weakref.WeakKeyDictionary()
_LIVE: weakref.WeakSet[Ahead] = weakref.WeakSet()


def _forget_all() -> None:
    """At the interpreter's exit, the batches not yet drawn are dropped: the pool's thread would draw every one
    before the process could end."""
    for early in list(_LIVE):
        early.pending.forget()


# run before concurrent.futures joins its threads at exit (threading's exit calls run last registered first)
getattr(threading, "_register_atexit", lambda _: None)(_forget_all)


def _forget_the_parents_threads() -> None:
    """In a forked child (a DataLoader worker): the parent's draw threads are not there, so what they were
    drawing never comes and their pools would queue work no thread runs. The child starts with none of it and
    draws from the transforms' real states, where the parent's last batch left them."""
    global _DRAWERS, _DRAWERS_LOCK
    _DRAWERS, _DRAWERS_LOCK = None, threading.Lock()
    _AHEAD.clear()
    _LIVE.clear()


def ahead(t: Any, inner: Any, attr: str, draw: Draw, expected: Expected | None = None) -> Ahead | None:
    """The draw-ahead of transform `t` (None where it cannot be exact: the two share one random state)."""
    if t.R is inner.R:
        return None
    got = _AHEAD.get(t)
    if got is None or got.inner is not inner:
        if got is not None:  # its inner transform replaced: what it drew ahead is for the one before
            got.pending.close(wait=False)
        got = _AHEAD[t] = Ahead(t, inner, attr, draw, expected)
    return got


_DRAWERS: ThreadPoolExecutor | None = None
_DRAWERS_LOCK = threading.Lock()
_LOCAL = threading.local()


def draw_threads() -> int:
    """Threads that draw items at once: the cores this process may use, less one for the loader, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores - 1))


def drawers() -> ThreadPoolExecutor:
    global _DRAWERS
    with _DRAWERS_LOCK:
        if _DRAWERS is None:
            _DRAWERS = ThreadPoolExecutor(draw_threads(), thread_name_prefix="loaders-item-draws")
        return _DRAWERS


def skip(r: np.random.RandomState, words: int) -> None:
    """Move `r` on by `words` 32-bit words of its Mersenne Twister, as drawing that many would."""
    r._bit_generator.random_raw(words, output=False)


def skippable(r: Any) -> bool:
    return getattr(r, "_bit_generator", None) is not None and r.get_state()[0] == "MT19937"


def from_state(state: Any) -> np.random.RandomState:
    """This thread's own generator, set to `state` (a new RandomState seeds itself from the OS: kept per thread)."""
    r = getattr(_LOCAL, "r", None)
    if r is None:
        r = _LOCAL.r = np.random.RandomState()
    r.set_state(state)
    return r


def same_state(a: Any, b: Any) -> bool:
    return bool(a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1]))


def resolved(x: Any) -> Any:
    """A draw, waited for where it is still being drawn."""
    return x.result() if isinstance(x, Future) else x


os.register_at_fork(after_in_child=_forget_the_parents_threads)
