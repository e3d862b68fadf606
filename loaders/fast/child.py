"""The feeder's child end: a process of its own that builds the `PreparedLoader` from the parent's arguments and
runs the epochs the parent asks for (`loaders.fast.feeder` is the parent's end and the messages both speak)."""

from __future__ import annotations

import os
import pickle
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from loaders import tunables
from loaders.cache.nesting import map_leaves
from loaders.errors import LoaderStateError
from loaders.fast.feeder import ENV, IN_SLOT, BatchSent, EpochAsk, Tally, dumps, incoming, loads, outgoing
from loaders.state import same
from loaders.tail.checks import raise_checks

__all__ = ["Packed", "Ring", "Slots", "serve"]


@dataclass
class Packed:
    """A batch packed where its tail ran (`Ring.pack_ahead`): its CUDA tensors in slot `at`, the rest to send, and
    its tail's checks, waited for before it is sent (`loaders.tail.checks.raise_checks`)."""

    at: int
    out: dict[str, Any]
    checks: list[Any]


class Slots:
    """Which of the ring's slots may be filled, shared by the thread that fills them and the one that sends: free,
    packed (filled, not sent), or sent until the parent has taken that batch. The parent takes batches in the order
    they were sent and counts them in the tally, so the tally frees the sent slots in that order; a batch sent without
    a slot is counted there too. `count` at least the batches that may be packed and not sent (the loader's prefetch
    and one begun ahead) plus those sent and not taken (the credits) keeps a free slot at hand."""

    def __init__(self, count: int, tally: Any) -> None:
        self.count, self.tally = count, tally
        self.state = ["free"] * count
        self.order: deque[int | None] = deque()  # each batch sent and not yet taken: its slot, or None
        self.taken = tally.get() if tally is not None else 0
        self.last = count - 1
        self.closed = False
        self.cond = threading.Condition()

    def take(self) -> int:
        """A free slot, marked packed: the next after the last taken that is free (waits while none is)."""
        wait = 1e-4
        with self.cond:
            while True:
                self._release()
                for step in range(1, self.count + 1):
                    at = (self.last + step) % self.count
                    if self.state[at] == "free":
                        self.state[at], self.last = "packed", at
                        return at
                if self.closed:
                    raise EOFError("the feeder closed while its tail waited for a hand-over slot")
                self.cond.wait(wait)
                wait = min(2 * wait, 1e-3)

    def sent(self, at: int | None) -> None:
        with self.cond:
            if at is not None:
                self.state[at] = "sent"
            self.order.append(at)

    def _release(self) -> None:
        now = self.tally.get() if self.tally is not None else self.taken
        while self.taken < now and self.order:
            at = self.order.popleft()
            self.taken += 1
            if at is not None:
                self.state[at] = "free"
        self.taken = max(self.taken, now)

    def new_epoch(self) -> None:
        """The parent asks for an epoch: every batch it was sent before is taken or dropped, so their slots are free."""
        with self.cond:
            self.state = ["free" if s == "sent" else s for s in self.state]
            self.order.clear()
            self.taken = self.tally.get() if self.tally is not None else self.taken
            self.cond.notify_all()

    def drop_unsent(self) -> None:
        """Every batch packed and not sent was dropped (an epoch left early, the next one begun ahead dropped)."""
        with self.cond:
            self.state = ["free" if s == "packed" else s for s in self.state]
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _cuda_of(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The batch's top-level CUDA tensors (plain tensors), and their shapes, dtypes and devices."""
    import torch

    cuda = {k: v.as_subclass(torch.Tensor) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.is_cuda}
    return cuda, {k: (tuple(v.shape), v.dtype, v.device) for k, v in cuda.items()}


def _nested_cuda(batch: dict[str, Any], top: dict[str, Any]) -> bool:
    """Whether a CUDA tensor lies in the batch below its top level (outside `top`)."""
    import torch

    found: list[bool] = []
    map_leaves([v for k, v in batch.items() if k not in top],
               lambda v: found.append(isinstance(v, torch.Tensor) and v.is_cuda))  # fmt: skip
    return any(found)


class Ring:
    """The child's end of the hand-over of a batch's top-level CUDA tensors: `slots` fixed buffers per key,
    shared with the parent once (CUDA IPC), each filled when free (`Slots`: the parent has taken the batch it
    held). Each fill is followed by an IPC event the parent's stream waits on; a slot is filled again only after
    the parent's fence for it (recorded after the parent copied the slot out, before its credit) has passed.
    Tensors sent one by one instead would each be a fresh block of the child's allocator (a sent block is kept in
    limbo until memory runs short) and a fresh cudaIpcOpenMemHandle in the parent, which measured slower
    (docs/benchmarks.md, the feeder)."""

    def __init__(self, count: int, tally: Any = None) -> None:
        self.count = count
        self.slots: list[dict[str, Any]] = []
        self.events: list[Any] = []
        self.fences: list[Any] = []  # the parent's events, opened here when it sends them
        self.shapes: dict[str, Any] = {}
        self.free = Slots(count, tally)
        self.used = [False] * count  # filled before: the parent's fence for it must be waited on
        self.made = threading.Lock()  # the slots made once, by whichever thread packs first

    def pack(self, batch: dict[str, Any], send: Any) -> tuple[int | None, dict[str, Any]]:
        """(slot, the batch to send): the top-level CUDA tensors copied into a free slot (marked `IN_SLOT`), the
        rest as `_outgoing`; slot None where the batch's CUDA tensors are not those the slots were made for."""
        return self._pack(batch, *_cuda_of(batch), send)

    def pack_ahead(self, batch: dict[str, Any], checks: list[Any], send: Any) -> Any:
        """`batch` packed where its tail ran, right after its work was queued (so that it reaches the GPU with that
        work, not at the parent's credit: each arrival of the child's work is a turn of its context on the GPU,
        docs/benchmarks.md); the batch as it is where it cannot be (not the slots' tensors, CUDA tensors below the
        top level, which go by IPC after the main thread's hand-over, or a slot to fill again before the parent's
        fences came): the main thread packs it then."""
        cuda, shapes = _cuda_of(batch)
        at: int | None = None
        if (cuda and shapes == (self.shapes or shapes) and (self.fences or not any(self.used))
                and not _nested_cuda(batch, cuda)):  # fmt: skip
            at, out = self._pack(batch, cuda, shapes, send)
        if at is None:
            raise_checks(checks)
            return batch
        return Packed(at, out, checks)

    def _pack(self, batch: dict[str, Any], cuda: dict[str, Any], shapes: dict[str, Any], send: Any) -> Any:
        import torch

        with self.made:
            if not self.slots and cuda:
                self._make(cuda, shapes, send)
        if not cuda or shapes != self.shapes:
            return None, outgoing(batch)
        at = self.free.take()
        stream = torch.cuda.current_stream(next(iter(cuda.values())).device)
        if self.used[at]:  # the slot was filled before: the parent's copy of it must be done
            stream.wait_event(self.fences[at])
        self.used[at] = True
        for key, value in cuda.items():
            self.slots[at][key].copy_(value)
        self.events[at].record(stream)
        return at, {k: IN_SLOT if k in cuda else outgoing(v) for k, v in batch.items()}

    def _make(self, cuda: dict[str, Any], shapes: dict[str, Any], send: Any) -> None:
        import torch

        self.shapes = shapes
        self.slots = [{k: torch.empty_like(v) for k, v in cuda.items()} for _ in range(self.count)]
        with torch.cuda.device(next(iter(cuda.values())).device):  # the slots' device, not the current one
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(self.count)]
            handles = [e.ipc_handle() for e in self.events]  # made here: an event is made on its first use
        send("slots", self.slots, handles)

    def open_fences(self, handles: list[Any]) -> None:
        import torch

        device = next(iter(self.slots[0].values())).device
        self.fences = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


def _bound_to_parent() -> None:
    """The child lives and ends with the training process, whatever signals its process group gets: Ctrl-C
    and SLURM's USR1/USR2 (`scancel --signal=USR1 JOBID` reaches every process of the step) are the training
    script's to handle, and would otherwise kill the child (USR1's default) under a script that goes on to
    save its state. It ends when the training process does: its socket closes, which the child sees at its
    next message (no PR_SET_PDEATHSIG: that fires when the creating *thread* ends, which may be long before)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _host_threads() -> None:
    """A host feeder's torch threads: its work is stacking and copying batches, which a few threads do at memory
    speed; torch's default (a thread a core) left them spinning beside the training process's (py-spy, H200)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, min(4, cores // 4)))


PROFILE = "BLOCKPREP_FEEDER_PROFILE"  # a folder: the child's thread profiled (cProfile), feeder-PID.prof there


def serve() -> None:
    """The child's end: connect, build the loader, run the epochs asked for (under cProfile where `PROFILE`
    names a folder: what the loader's thread spends in the child, read with `pstats`; written once its loader is
    built, when the parent says close (before the loader's cleanup) and at the end)."""
    folder = os.environ.pop(PROFILE, "")
    if not folder:
        return _serve(lambda: None)
    import cProfile

    prof = cProfile.Profile()
    path = os.path.join(folder, f"feeder-{os.getpid()}.prof")

    def dump() -> None:
        prof.disable()
        prof.dump_stats(path)
        prof.enable()

    try:
        prof.runcall(_serve, dump)
    finally:
        prof.dump_stats(path)


def _serve(checkpoint: Any) -> None:
    from multiprocessing.connection import Client

    _bound_to_parent()
    from loaders.tail import graphs

    graphs.in_a_feeder()  # the tail's kernels as CUDA graphs here (loaders.tunables.TAIL_GRAPHS)
    address, key, fd = os.environ.pop(ENV).rsplit("|", 2)
    tally = Tally(int(fd))
    os.close(int(fd))
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(key))
    sending = threading.Lock()  # the main thread's messages, and the slots the tail thread may make

    def send(*msg: Any) -> None:
        data = dumps(msg)
        with sending:
            conn.send_bytes(data)

    try:
        from loaders.fast.loader import PreparedLoader  # its imports' errors are said to the parent too

        spec = pickle.loads(conn.recv_bytes())
        # "go": the parent's first batch is made (`Feeder.go`), so this CUDA context holds it up not; or the
        # arguments it changed (a host feeder chosen by the training loop's first periods: `loaders.fast.feeding`)
        said = conn.recv_bytes()
        if said != b"go":
            spec.update(pickle.loads(said))
        host = spec.pop("host_feed", False)
        from loaders.tail import uniforms

        # described draws: for the parent where it makes them; never in a CUDA context of this child's own but
        # where BLOCKPREP_DEVICE_DRAWS=1 (its GPU time-sliced with the training step's)
        uniforms.tell(bool(spec.pop("device_draws", False)) if host else tunables.DEVICE_DRAWS is True)
        if host:  # `loaders.fast.hostfeed`: no CUDA here; batches made on the CPU, their tails' draws alone
            spec.update(device="cpu", gpu_budget=0)
            _host_threads()
        loader = PreparedLoader(**spec)
        if host and hasattr(loader.assembly.tail, "draw_only"):
            loader.assembly.tail.draw_only = True
    except (EOFError, OSError):  # the parent closed the loader before it needed this one: nothing to say
        return
    except BaseException as exc:  # noqa: BLE001  (said to the parent, which raises it)
        _trace()
        send("error", f"{type(exc).__name__}: {exc}")
        return
    if loader.gpu:  # what the tail makes on "the current device" goes to the loader's (one process per device)
        import torch

        torch.cuda.set_device(loader.device)
    try:
        send("ready")
    except OSError:  # the parent closed the loader while this one was built: nothing to do
        loader.close()
        return
    checkpoint()  # the profile as of the loader built (its start)
    # packed ahead: the loader's prefetch and a batch begun ahead, and the parent's credits (its prefetch) sent
    ahead_packed = loader.gpu and loader.tail_thread and tunables.PACK_AHEAD
    ring: Any = Ring(2 * loader.prefetch + 4 if ahead_packed else loader.prefetch + 2, tally)
    if host:  # packed and not sent (prefetch + 1), sent and not counted taken (the credits: prefetch + 1), one free
        from loaders.fast.hostfeed import HostRing

        ring = HostRing(2 * loader.prefetch + 3, tally)
    if ahead_packed:
        loader.pack_ahead = lambda batch, checks: ring.pack_ahead(batch, checks, send)
    loader.capture_ahead = loader.gpu and loader.tail_thread and tunables.CAPTURE_AHEAD
    if ahead_packed:
        loader.assembly.defer_checks()  # waited for after the batch's hand-over is queued
    ahead: _Ahead | None = None
    try:
        while True:
            msg = loads(conn.recv_bytes())
            if msg[0] == "close":
                checkpoint()
                return
            if msg[0] == "fences":
                ring.open_fences(msg[1])
            if msg[0] == "tier":
                loader.tier.adopt({item: incoming(tensors) for item, tensors in msg[1].items()})
            if msg[0] == "epoch":
                ahead = _epoch(loader, _Turns(conn, tally, msg[1].credits, ring), send, msg[1], ahead)
    except (EOFError, OSError):
        return  # the parent is gone
    finally:
        ring.free.close()  # a tail waiting for a slot gives up
        if ahead is not None:
            ahead.drop(loader)
        loader.close()


def _trace() -> None:
    """The error being handled, its whole traceback printed to standard error where BLOCKPREP_FEEDER_TRACE=1."""
    if tunables.FEEDER_TRACE:
        import traceback

        traceback.print_exc()


class _Ahead:
    """The next epoch begun before the parent asks for it: its first batch made and the read thread reading on,
    so that an epoch's start (the pipeline filled again: 12-step epochs on `spheres`, `gds-seed`) costs the
    training process nothing. Used only when the parent asks for exactly that epoch (the next, from its
    first batch, same shard, the random states as the last epoch left them); otherwise dropped, its draws
    put back. Nothing of it is sent before it is asked for."""

    def __init__(self, loader: Any, epoch: int, snap: dict[int, Any]) -> None:
        self.ask = EpochAsk(epoch, 0, loader.rank, loader.world, snap, 0)
        loader.epoch, loader.cursor.resume = epoch, 0
        self.it: Any = iter(loader)
        self.first: list[Any] = []
        try:
            self.first = [next(self.it)]
        except StopIteration:
            pass
        except BaseException:  # noqa: BLE001  (made again when asked for, where the error is said)
            self.it = None
            loader.cursor.draws.put(snap)

    def take(self, ask: EpochAsk) -> Any:
        """The epoch's batches if `ask` asks for this epoch, else None."""
        mine = self.ask
        where = (ask.epoch, ask.skip, ask.rank, ask.world) != (mine.epoch, mine.skip, mine.rank, mine.world)
        if self.it is None or where or not same(ask.snap, mine.snap):
            return None
        import itertools

        return itertools.chain(self.first, self.it)

    def drop(self, loader: Any) -> None:
        if self.it is not None:
            self.it.close()  # the read thread stopped; the draws put back to before this epoch
            self.it = None
            loader.cursor.draws.put(self.ask.snap)


class _Turns:
    """When the child may send its next batch of an epoch: while fewer than `credits` it sent are not yet taken by
    the parent (the shared tally), unless told to stop. While it may not, it looks for the parent's messages and
    at the tally in turn, waiting a little longer each time (0.1 ms to 1 ms: a batch ahead of the parent waits
    while the parent trains; it is noticed within a millisecond of its turn, and its CPU is left alone meanwhile)."""

    def __init__(self, conn: Any, tally: Tally, credits: int, ring: Ring) -> None:
        self.conn, self.tally, self.credits, self.ring = conn, tally, credits, ring
        self.base = tally.get()  # taken before this epoch (the parent writes it only while it takes batches)
        self.sent = 0

    def next(self) -> bool:
        """True where the batch may go (counted as sent), False where the parent said stop."""
        wait = 1e-4
        while True:
            while self.conn.poll():
                got = loads(self.conn.recv_bytes())
                if got[0] == "fences":
                    self.ring.open_fences(got[1])
                if got[0] == "stop":
                    return False
            if self.sent - (self.tally.get() - self.base) < self.credits:
                self.sent += 1
                return True
            self.conn.poll(wait)
            wait = min(2 * wait, 1e-3)


def _epoch(loader: Any, turns: _Turns, send: Any, ask: EpochAsk, ahead: _Ahead | None) -> _Ahead | None:
    """One epoch as the parent asked (from `ahead` where it is that epoch); returns the next epoch begun."""
    ring = turns.ring
    ring.free.new_epoch()  # what the parent was sent before is taken or dropped
    batches = ahead.take(ask) if ahead is not None else None
    gen = ahead.it if batches is not None and ahead is not None else None
    if batches is None and ahead is not None:
        ahead.drop(loader)
    finished = False
    try:
        if batches is None:
            loader.shard(ask.rank, ask.world)
            loader.drop_ahead()
            ring.free.drop_unsent()  # batches packed ahead and dropped with the epoch begun ahead
            loader.epoch = ask.epoch
            loader.cursor.start_at(ask.skip, ask.snap)
            batches = gen = iter(loader)
        for batch in batches:
            if not turns.next():
                break
            at: int | None
            if isinstance(batch, Packed):
                raise_checks(batch.checks)  # the tail's flags, read back by now
                at, out = batch.at, batch.out
            else:
                at, out = ring.pack(batch, send)
            ring.free.sent(at)  # before the parent may take it
            send("batch", BatchSent(at, out, dict(loader.cursor.live.snap)))
        else:
            finished = True
        send("end")
    except (EOFError, OSError):
        raise
    except LoaderStateError as exc:
        send("error", str(exc))
    except BaseException as exc:  # noqa: BLE001
        _trace()
        send("error", f"{type(exc).__name__}: {exc}")
    finally:
        if gen is not None:
            gen.close()  # an epoch left early: the read thread stopped, the draws as of the last batch sent
        if not finished:
            ring.free.drop_unsent()  # what was packed ahead of the last batch sent is dropped
    # the states as of the last batch sent (the loader's own next epoch may already be drawing past them)
    return _Ahead(loader, ask.epoch + 1, dict(loader.cursor.now(loader.epoch).snap)) if finished else None
