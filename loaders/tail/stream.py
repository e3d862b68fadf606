"""A random stream moved past a batch's items in a helper process: each item's start state, at once.

`Rand3DElasticd` draws 5.3 M generator words an item (96^3 offsets), and one stream gives every item its words in
turn: the items' start states come from moving the stream past each item's words (`ahead.skip`, numpy's
`random_raw` with no output, 8.3 ms an item on an H200 box's core). numpy releases the interpreter lock while it
does, but takes it back after each item, behind the tail's and the training loop's Python: a switch interval
(5 ms) lost per item, twice the skip's own time where those threads are busy (py-spy on `seg-elastic`: the
stream's thread busy 99% of its samples, 97% of them in the skip). Here a small process of its own (numpy only,
started once, no lock shared) gives every item of a batch its start and the end at once, each jumped to from the
batch's start (`loaders.tail.mtjump`: 2-3 ms an item, whatever its words) where an item's words are many, else
moved past by drawing: the thread that asks waits once a batch, with the lock released. The states are numpy's own
(the key and position drawing would leave), so the draws are those of skipping in the thread, and each item's
draw is checked to end where the next begins. The process starts at the first batch and gets ready on a thread
(its polynomials for such batches: about a second), the batches meanwhile drawn in the thread (a tenth of that
each), so the first batch does not wait for it; where it cannot start or dies, the thread jumps itself.
"""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from loaders.tail import mtjump

# The helper runs loaders/tail/mtjump.py as a script (numpy only: nothing of the training script or of this package
# is imported there; runpy leaves sys.path as it is).
_HELPER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class _Helper:
    """The helper process, started on first use; None where it could not start."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # no BLAS threads at import
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER, mtjump.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def ask(self, key: np.ndarray | None, pos: int, words: int, items: int) -> list[tuple[np.ndarray, int]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        body = pickle.dumps((key, pos, words, items), protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack("<I", len(body)) + body)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(4)
        if len(head) < 4:
            raise OSError("the stream helper ended")
        got: list[tuple[np.ndarray, int]] = pickle.loads(self.proc.stdout.read(struct.unpack("<I", head)[0]))
        return got

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # EOF: it leaves
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"helper": None, "failed": False, "warming": None}


def starts(r: np.random.RandomState, words: int, items: int) -> list[tuple[Any, ...]]:
    """Each of `items` items' start state (`r.get_state()` form) where each takes `words` words of `r`'s
    Mersenne Twister, in turn; `r` is left at the end of the last, as skipping item by item would leave it."""
    name, key, pos, has_gauss, gauss = r.get_state(legacy=True)
    key = np.asarray(key, dtype=np.uint32)
    got = _asked(key, int(pos), words, items)
    if got is None:  # in this thread: drawn while the helper gets ready (it starts and finds its polynomials in
        # about a second; drawing a batch takes a tenth of that), jumped where the helper cannot run
        got = (mtjump.skipped if _STATE["warming"] is not None else mtjump.moved)(key, int(pos), words, items)
    states: list[Any] = [(name, k, p, has_gauss, gauss) for k, p in got]
    r.set_state(states[-1])
    return states[:-1]


def advance(r: np.random.RandomState, words: int) -> None:
    """Move `r` on by `words` words in this thread (jumped where they are many), as drawing them would."""
    name, key, pos, has_gauss, gauss = r.get_state(legacy=True)
    (k, p) = mtjump.moved(np.asarray(key, dtype=np.uint32), int(pos), words, 1)[1]
    r.set_state((str(name), k, p, int(has_gauss), float(gauss)))


def _asked(key: np.ndarray, pos: int, words: int, items: int) -> list[tuple[np.ndarray, int]] | None:
    """The helper's answer; None while it gets ready (started here, made ready on a thread) or where it failed."""
    with _LOCK:
        if _STATE["failed"] or _STATE["warming"] is not None:
            return None
        try:
            if _STATE["helper"] is None:
                _STATE["helper"] = helper = _Helper()
                warming = _STATE["warming"] = threading.Thread(
                    target=_warm, args=(helper, words, items), name="loaders-stream-ready", daemon=True
                )
                warming.start()
                return None
            return _STATE["helper"].ask(key, pos, words, items)  # type: ignore[no-any-return]
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            _failed_locked()
            return None


def _warm(helper: _Helper, words: int, items: int) -> None:
    """On a thread: the helper finds what batches like this one ask for; then it answers them."""
    try:
        helper.ask(None, 0, words, items)
        ok = True
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        ok = False
    with _LOCK:
        if _STATE["helper"] is helper:
            _STATE["warming"] = None
            if not ok:
                _failed_locked()


def _failed_locked() -> None:
    _STATE["failed"] = True  # said nowhere: the thread moves the stream itself, the same states
    _close_locked()


def ready(timeout: float) -> bool:
    """Wait up to `timeout` s for the helper to be ready (started by a first `starts`); whether it is."""
    warming = _STATE["warming"]
    if warming is not None:
        warming.join(timeout)
    return _STATE["helper"] is not None and _STATE["warming"] is None and not _STATE["failed"]


def close() -> None:
    """Stop the helper (at exit; a later use starts a new one)."""
    with _LOCK:
        _close_locked()
        _STATE.update(failed=False, warming=None)


def _close_locked() -> None:
    helper, _STATE["helper"] = _STATE["helper"], None
    if helper is not None:
        helper.close()


def _forget_the_parents_helper() -> None:
    """In a forked child: the parent's helper and its pipes are the parent's; the child starts its own."""
    global _LOCK
    _LOCK = threading.Lock()
    _STATE.update(helper=None, failed=False, warming=None)


atexit.register(close)
os.register_at_fork(after_in_child=_forget_the_parents_helper)
