"""The host feeder (`BLOCKPREP_HOST_FEED=1`): a feeder's child that never touches CUDA, and the training process
that replays its batches' tails.

A feeder's child with a CUDA context of its own costs the training step a turn of that context on the GPU at each
arrival of its work (docs/benchmarks.md: `seg-aug` fed made 0.87-0.88 of the ceiling with its augmentations and
without them alike). Here the child builds its loader on the CPU: it reads and crops each batch out of the page cache
(or the disk), stacks it, and makes its tail's draws alone (`loaders.tail.replay`: MONAI's `randomize`, item by
item); the training process copies the batch up from page-locked shared memory and replays the tail's work from
those draws as CUDA graphs (`BatchedTail.replay_drawn`). One context, and the training process's host work a
batch is its copies up and one graph launch a transform.

The batch's large arrays (its tensors, an elastic deformation's offsets) and every array of its tail's draws go
through a ring of slots in one shared memory file (a memfd of the child's, opened by the parent through /proc and
registered with CUDA there once): the child writes each into a free slot, the parent's copies up read it (page-locked
already: no staging copy for a draw of a few numbers either), and the parent's tally frees the slot once those copies
have run (`HostSlots.taken`). Everything else goes by value in the message.

On a GPU the parent takes each batch on a thread of its own (`Taker`): its message, its copies up and its tail's
graph launches run while the training thread waits for its step's kernels (torch lets go of the interpreter lock
in a wait), so that `next()` only hands over a batch made ready beside the step, just in time.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loaders.fast.feeder import outgoing

__all__ = ["HostRing", "HostSlots", "InHost", "TakeTimes", "Taker"]

_SMALL = 4 << 10  # arrays below this go by value in the message (a tail's draws of any size go in the slot)
_ALIGN = 4096


@dataclass(frozen=True)
class InHost:
    """An array the parent reads out of the message's slot: at byte `at` of it, of `dtype` (numpy's) and `shape`."""

    at: int
    dtype: str
    shape: tuple[int, ...]


def _array(value: Any) -> np.ndarray | None:
    """A host tensor or array as a numpy array (None for anything else)."""
    import torch

    from loaders.cache.dtypes import to_numpy

    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        plain = value.as_subclass(torch.Tensor) if type(value) is not torch.Tensor else value
        return to_numpy(plain.contiguous())
    return value if isinstance(value, np.ndarray) else None


def _numpy(value: Any) -> Any:
    a = _array(value)
    return value if a is None else a


_PIECE = 4 << 20  # bytes a copy thread writes at a time
_COPIERS: Any = None


def _copy_in(view: np.ndarray, arrays: list[tuple[int, np.ndarray]]) -> None:
    """Each array's bytes written into `view` at its offset, in pieces on a few threads (numpy copies without the
    interpreter lock): an elastic deformation's offsets are 42 MB a `seg-elastic` batch, and one thread copying
    them took 42% of the child's main thread (py-spy, H200)."""
    from concurrent.futures import ThreadPoolExecutor

    global _COPIERS
    pieces = []
    for at, a in arrays:
        flat = a.reshape(-1).view(np.uint8)
        pieces += [(at + i, flat[i : i + _PIECE]) for i in range(0, flat.nbytes, _PIECE)]

    def put(piece: tuple[int, np.ndarray]) -> None:
        view[piece[0] : piece[0] + piece[1].nbytes] = piece[1]

    if len(pieces) < 4:
        for piece in pieces:
            put(piece)
        return
    if _COPIERS is None:
        _COPIERS = ThreadPoolExecutor(4, thread_name_prefix="blockprep-host-copy")
    list(_COPIERS.map(put, pieces))


class _Large:
    """An array being packed: its index among the batch's large arrays."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class HostRing:
    """The child's end: `count` slots of one memfd, made at the first batch at twice its large arrays' bytes (and
    32 MiB more: the draws of a batch whose augmentations fire more); a batch they do not fit goes by value."""

    def __init__(self, count: int, tally: Any) -> None:
        from loaders.fast.child import Slots

        self.count = count
        self.free = Slots(count, tally)
        self.slot_bytes = 0
        self.view: np.ndarray | None = None
        self._fd = -1
        self._mm: Any = None

    def pack(self, batch: dict[str, Any], send: Any) -> tuple[int | None, dict[str, Any]]:
        """(slot, the batch to send): its large arrays written into a free slot as `InHost`, the rest by value."""
        from loaders.tail.replay import DRAWN, Drawings

        large: list[np.ndarray] = []

        def take(value: Any, least: int = _SMALL) -> Any:
            a = _array(value)
            if a is None or a.nbytes < least:
                return value
            large.append(a)
            return _Large(len(large) - 1)

        def drawn_value(value: Any) -> Any:  # a draw's arrays of any size: page-locked at once in the parent
            return take(value, 1)

        drawn = batch.get(DRAWN)
        if drawn is not None:  # host tensors as numpy arrays: never torch's shared memory, which needs a shared key
            drawn = Drawings([_drawn_map(d, _numpy) for d in drawn.drawn])
            batch = {**batch, DRAWN: drawn}
        top = {k: take(v) if k != "_items" else v for k, v in batch.items() if k != DRAWN}
        if drawn is not None:
            drawn = Drawings([_drawn_map(d, drawn_value) for d in drawn.drawn])
        places, need = [], 0
        for a in large:  # each at a page, a small draw at 64 bytes
            align = _ALIGN if a.nbytes >= _SMALL else 64
            need = -(-need // align) * align
            places.append(need)
            need += a.nbytes
        if large and self.view is None:
            self._make(need, send)
        if not large or need > self.slot_bytes:
            return None, outgoing(batch)
        at = self.free.take()
        base = at * self.slot_bytes
        assert self.view is not None
        _copy_in(self.view, [(base + off, a) for a, off in zip(large, places)])

        def placed(value: Any) -> Any:
            if isinstance(value, _Large):
                a = large[value.index]
                return InHost(places[value.index], a.dtype.str, tuple(a.shape))
            return value

        out = {k: placed(v) if isinstance(v, _Large) else outgoing(v) for k, v in top.items()}
        if drawn is not None:
            out[DRAWN] = Drawings([_drawn_map(d, placed) for d in drawn.drawn])
        return at, out

    def _make(self, need: int, send: Any) -> None:
        size = -(-(2 * need + (32 << 20)) // (2 << 20)) * (2 << 20)
        self._fd = os.memfd_create("blockprep-host-feed", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, size * self.count)
        self._mm = mmap.mmap(self._fd, size * self.count)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)
        self.slot_bytes = size
        send("hostslots", os.getpid(), self._fd, size, self.count)

    def open_fences(self, handles: list[Any]) -> None:
        """Nothing: the parent's tally says when a slot's copies have run."""


def _drawn_map(d: Any, fn: Any) -> Any:
    """A transform's draws (a `Drawn`, or a per-item plan's list of them) with `fn` applied to each value."""
    from loaders.tail.plans import Drawn

    if isinstance(d, list):
        return [_drawn_map(x, fn) for x in d]
    return Drawn(d.kind, {name: fn(v) for name, v in d.values.items()})


class HostSlots:
    """The parent's end: the child's slots mapped and registered with CUDA (page-locked) once; a batch's
    `InHost` values read as views of its slot; the tally set for a batch once the copies up that read it have run
    (checked at the next batch, so that the host never waits for them)."""

    def __init__(self, pid: int, fd: int, slot_bytes: int, count: int) -> None:
        import torch

        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(own, slot_bytes * count)
        finally:
            os.close(own)
        self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        self.registered = False
        if torch.cuda.is_initialized():  # a loader on a GPU: page-locked, so that its copies up need no staging
            rc = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.flat.numel(), 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the host feeder's slots failed (error {int(rc)})")
            self.registered = True
        self.pending: tuple[Any, int] | None = None  # (the last batch's copies' event, the count to set then)

    def views(self, at: int, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with its `InHost` values as views of slot `at` (page-locked host tensors)."""
        from loaders.reading.staging import view
        from loaders.tail.replay import DRAWN, Drawings

        base = at * self.slot_bytes

        def placed(value: Any) -> Any:
            if not isinstance(value, InHost):
                return value
            return view(self.flat, base + value.at, np.dtype(value.dtype), value.shape)

        out = {k: placed(v) for k, v in batch.items()}
        if isinstance(out.get(DRAWN), Drawings):
            out[DRAWN] = Drawings([_drawn_map(d, placed) for d in out[DRAWN].drawn])
        return out

    def taken(self, tally: Any, count: int, event: Any) -> None:
        """Batch number `count` taken: its slot free once `event` (its copies up) has passed; the tally of the batch
        before set now."""
        self.settle(tally)
        self.pending = (event, count)

    def settle(self, tally: Any) -> None:
        """The last batch's tally set, once its copies up have run (waits for them: they ran long since)."""
        if self.pending is None:
            return
        event, count = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        tally.set(count)

    def close(self) -> None:
        import torch

        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.registered = False


@dataclass
class TakeTimes:
    """When the caller took its last batches and how long the last takes ran: kept by the feeder across epochs, so
    that an epoch's second take is timed as the last epoch's were."""

    asks: list[float] = field(default_factory=list)  # when the caller took each (the last KEPT + 1)
    spent: list[float] = field(default_factory=list)  # seconds each take ran (the last KEPT)
    margin: float | None = None  # seconds a take aims to be done before the caller asks (None: not set yet)

    def margin_now(self) -> float:
        """The margin the next take is timed by (`loaders.tunables.HOST_TAKE_MARGIN`)."""
        from loaders import tunables

        if tunables.HOST_TAKE_MARGIN != "auto":
            return float(tunables.HOST_TAKE_MARGIN) / 1e3
        if self.margin is None:
            self.margin = MARGIN_START
        return self.margin

    def asked(self, waited: float) -> None:
        """The caller took a batch after waiting `waited` seconds for it: an "auto" margin up by `MARGIN_UP` where it
        waited, else down by `MARGIN_DOWN` (within `MARGIN_LEAST`..`MARGIN_MOST`)."""
        import time

        self.asks = [*self.asks[-Taker.KEPT :], time.perf_counter()]
        if self.margin is None:
            return
        if waited > LATE:
            self.margin = min(self.margin + MARGIN_UP, MARGIN_MOST)
        else:
            self.margin = max(self.margin - MARGIN_DOWN, MARGIN_LEAST)


# an "auto" take margin, seconds: where it starts, its steps, its bounds; a caller waiting longer than LATE is late
MARGIN_START, MARGIN_UP, MARGIN_DOWN, MARGIN_LEAST, MARGIN_MOST = 0.003, 0.001, 0.00025, 0.0002, 0.010
LATE = 0.0002


class Taker:
    """A host feeder's batches `first`..`n`-1 of an epoch taken on a thread (`take(k)`, once `poll(timeout)` says the
    child's next message has come), on `device`, one ahead of the caller's `next`. Its errors are raised by `next`;
    `stop` ends it wherever it is (what it took and nobody asked for is dropped, as a stopped epoch's).

    Each batch is taken as late as it can be and still be ready when asked for: by the shortest of the caller's
    last periods (from one `next` to the next) less the median of its last takes and a margin (`TakeTimes.margin_now`;
    the median, not the longest take: a
    take that captured a new graph, many times the others, would pull the next ones into the caller's launches, where
    they slow both; such a take is late once instead). A training loop that reads its loss waits for its step's
    kernels at the step's end, without the interpreter lock: the take runs then, and not at the step's start, where
    the loop's launches hold the lock and the GPU waits for each (the queue of the step before ran empty at its
    read)."""

    KEPT = 8  # periods and takes the timing is drawn from

    def __init__(self, take: Callable[[int], Any], poll: Callable[[float], bool], device: Any, first: int,
                 n: int, times: TakeTimes | None = None) -> None:  # fmt: skip
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stopped = threading.Event()
        self._asked = threading.Event()  # the caller took the last batch
        self._times = TakeTimes() if times is None else times
        self._thread = threading.Thread(target=self._run, args=(take, poll, device, first, n), daemon=True,
                                        name="blockprep-host-take")  # fmt: skip
        self._thread.start()

    def _run(self, take: Callable[[int], Any], poll: Callable[[float], bool], device: Any, first: int, n: int) -> None:
        import contextlib
        import time

        import torch

        on = torch.device(device)
        try:
            with torch.cuda.device(on) if on.type == "cuda" else contextlib.nullcontext():
                for k in range(first, n):
                    if k > first and not self._turn():  # the first at once
                        return
                    while not poll(0.05):
                        if self._stopped.is_set():
                            return
                    began = time.perf_counter()
                    got = take(k)
                    spent = self._times.spent
                    self._times.spent = [*spent[-self.KEPT + 1 :], time.perf_counter() - began]
                    if not self._put(got):
                        return
        except BaseException as exc:  # noqa: BLE001  (raised in the caller's thread by `next`)
            self._put(exc)

    def _turn(self) -> bool:
        """Wait until the caller has taken the last batch and the next one is due (False: stopped meanwhile)."""
        import time

        while not self._asked.wait(0.05):
            if self._stopped.is_set():
                return False
        self._asked.clear()
        asks, spent = self._times.asks, self._times.spent
        if len(asks) >= 3 and spent:
            period = min(b - a for a, b in zip(asks, asks[1:]))
            due = asks[-1] + period - sorted(spent)[len(spent) // 2] - self._times.margin_now()
            while (left := due - time.perf_counter()) > 0:
                if self._stopped.wait(min(left, 0.05)):
                    return False
        return not self._stopped.is_set()

    def _put(self, item: Any) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Any:
        """The next batch taken (as `take` gave it); what ended the thread raised here."""
        import time

        began = time.perf_counter()
        while True:
            try:
                got = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the host feeder's taking thread left before the epoch's last batch") from None
        self._times.asked(time.perf_counter() - began)
        self._asked.set()
        if isinstance(got, BaseException):
            raise got
        return got

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
