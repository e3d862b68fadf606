"""A `PreparedLoader`'s batches made in a process of its own (`PreparedLoader(..., feeder=True)`).

In the training process, every millisecond of the loader's Python (the crops' and transforms' draws through
MONAI's `randomize`, the tail's launches, the hand-over) holds the same interpreter lock as the training
loop's kernel launches, and comes off the steps where the loop is bound by launching kernels (the `spheres`
workload: docs/benchmarks.md, Training: the loader in a process of its own). With a feeder, a child
process runs the loader itself (its own read thread, tier and CUDA context on the same device) and hands each
batch over: CUDA tensors as CUDA IPC handles (no copy; torch's own reductions), small host tensors by value.
The training process only receives.

The child is started with `python -c` (not `multiprocessing`, which would re-run an unguarded training script
in the child), on the parent's `sys.path`; it rebuilds the loader from the same arguments and the pickled
transform. Results are those of the in-process loader, batch for batch:
- before each epoch the parent sends its random states (so `set_random_state` and `load_state_dict` on the
  parent's loader hold), the epoch, the batches to skip and the shard;
- every batch comes with the child's random states as of that batch, kept by the parent as of the last batch
  delivered: `state_dict` and an epoch left early behave as in-process;
- the child makes at most `prefetch` batches the parent has not taken, and stops when told. The batches taken are
  counted in 8 bytes both processes map (`Tally`), not sent as messages: a message a batch, and the child woken
  by each, cost the training process 0.06-0.08 ms a step on an H200 box (`profile_train --phases`).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import pickle
import secrets
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loaders.cache.dtypes import to_numpy, to_tensor
from loaders.cache.nesting import map_leaves
from loaders.errors import PrepError

# the child's end (loaders.fast.child) runs in a process of its own, started by name
_CHILD = "from loaders.fast.child import serve; serve()"
ENV = "BLOCKPREP_FEEDER"  # address and authkey of the parent's listener and the tally's descriptor, for the child
IN_SLOT = "\x00blockprep-slot"  # a batch value the parent copies out of the slot the message names


@dataclass(frozen=True)
class EpochAsk:
    """The parent's "epoch" message: batches `skip`.. of `epoch` for rank `rank` of `world`, from the random
    states `snap`, at most `credits` made ahead of what the parent received."""

    epoch: int
    skip: int
    rank: int
    world: int
    snap: dict[int, Any]
    credits: int


@dataclass(frozen=True)
class BatchSent:
    """The child's "batch" message: the batch (its top-level CUDA tensors in slot `slot`, or none where None)
    and the random states as of it."""

    slot: int | None
    batch: dict[str, Any]
    snap: dict[int, Any]


class Tally:
    """The batches the parent has taken, as a count both processes map (a shared 8-byte counter, written by the
    parent only): the child may be at most its credits ahead of it. An aligned 8-byte word is read and written
    whole on the platforms torch runs on; it orders nothing else (the batches' data have their own events)."""

    def __init__(self, fd: int) -> None:
        self._map: Any = mmap.mmap(fd, 8)

    @staticmethod
    def descriptor() -> int:
        """A new counter's file descriptor (memory only where the system has memfd), zero."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("blockprep-tally")
        else:
            with tempfile.TemporaryFile() as f:  # unlinked already: gone once both ends close it
                fd = os.dup(f.fileno())
        os.ftruncate(fd, 8)
        return fd

    def get(self) -> int:
        return int(struct.unpack_from("<q", self._map)[0])

    def set(self, n: int) -> None:
        struct.pack_into("<q", self._map, 0, n)

    def close(self) -> None:
        self._map.close()


class FeederError(PrepError, RuntimeError):
    """The feeder process could not start or failed; the message says why and how to go on."""


def dumps(obj: Any) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    return bytes(ForkingPickler.dumps(obj))


def loads(data: bytes) -> Any:
    import torch.multiprocessing  # noqa: F401

    return pickle.loads(data)


def outgoing(value: Any) -> Any:
    """A batch value as sent: CUDA tensors as themselves (IPC), host tensors by value (numpy), plain
    tensors only (a tensor subclass would pickle its storage, which CUDA storages refuse)."""
    import torch

    def leaf(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        plain = v.as_subclass(torch.Tensor) if type(v) is not torch.Tensor else v
        return plain if plain.is_cuda else Host(to_numpy(plain))

    return map_leaves(value, leaf)


def incoming(value: Any) -> Any:
    return map_leaves(value, lambda v: to_tensor(v.array) if isinstance(v, Host) else v)


class Host:
    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (Host, (self.array,))


def payload(spec: dict[str, Any]) -> bytes:
    """The child's `PreparedLoader` arguments as sent, or a one-line FeederError where they cannot be sent."""
    import cloudpickle  # dask's: functions of a script or a pipeline file (lambdas too) go by value

    try:
        return bytes(cloudpickle.dumps(spec))
    except Exception as exc:  # noqa: BLE001  (locks, open files, handles held by the transform)
        raise FeederError(
            f"PreparedLoader(feeder=True): the transform cannot be sent to a process of its own ({exc}); "
            "keep locks and open files out of it, or use feeder=False"
        ) from None


class Feeder:
    """The parent's end: starts the child, runs epochs through it, stops it on `close`."""

    def __init__(self, payload: bytes) -> None:
        from multiprocessing.connection import Listener

        key = secrets.token_bytes(16)
        self._listener: Any = Listener(family="AF_UNIX", authkey=key)
        fd = Tally.descriptor()
        self._tally, self._taken = Tally(fd), 0
        env = dict(os.environ)
        env[ENV] = f"{self._listener.address}|{key.hex()}|{fd}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, pass_fds=(fd,))
        finally:
            os.close(fd)  # the child has its own; the map keeps its own
        self._conn: Any = None
        self._slots: list[dict[str, Any]] = []
        self._events: list[Any] = []
        self._fences: list[Any] = []
        self._host: Any = None  # a host feeder's slots (`loaders.fast.hostfeed.HostSlots`)
        self._ahead: Any = None  # the CUDA stream a host feeder's batches are replayed from, ahead of the caller's
        self._take_times: Any = None  # a host feeder's takes' timing, kept across epochs (`hostfeed.TakeTimes`)
        self._finished = False
        self._ready = False  # the child says so once it has built its loader (imports included: seconds)
        # the child connects once its interpreter and this package's imports are up (seconds on a GPU box): a
        # thread accepts it and sends its arguments, so the loader's first batches are not made to wait for it
        self._box: list[Any] = []  # the connection, its arguments sent; or what ended the accept
        # the child builds its loader (its CUDA context) once told to go: a context made while this process makes
        # its first batch holds up that batch's pinned and device allocations (the driver serializes them: 3.6 s
        # against 0.16 on an H200, docs/benchmarks.md), so it is told once the first batch is made (`go`)
        self._go_said: bytes | None = None  # b"go", or the loader's arguments changed, pickled
        self._go_lock = threading.Lock()
        self._accepting = threading.Thread(target=self._connect, args=(payload,), daemon=True,
                                           name="blockprep-feeder-accept")  # fmt: skip
        self._accepting.start()

    def _connect(self, payload: bytes) -> None:
        try:
            conn = self._listener.accept()
            conn.send_bytes(payload)
        except BaseException as exc:  # noqa: BLE001  (the listener closed while the child started, or it left)
            self._box.append(exc)
            return
        with self._go_lock:
            self._box.append(conn)
            if self._go_said is not None:
                self._say_go(conn, self._go_said)

    def go(self, changed: dict[str, Any] | None = None) -> bool:
        """Let the child build its loader (and its CUDA context): now where it has connected, else once it does;
        `changed`: arguments of its loader changed first (a host feeder's, `loaders.fast.feeding`). True where this
        call said it (the first), False where it was said already."""
        with self._go_lock:
            if self._go_said is not None:
                return False
            self._go_said = b"go" if changed is None else pickle.dumps(changed)
            if self._box and not isinstance(self._box[0], BaseException):
                self._say_go(self._box[0], self._go_said)
            return True

    @staticmethod
    def _say_go(conn: Any, said: bytes) -> None:
        with contextlib.suppress(OSError):  # a child gone: said when it is next asked for
            conn.send_bytes(said)

    def _connected(self, wait: bool) -> bool:
        """Whether the child has connected and has its arguments (waited for with `wait`); FeederError where it
        exited or could not connect first."""
        while self._conn is None:
            if self._box:
                got = self._box[0]
                if isinstance(got, BaseException):
                    raise FeederError(f"PreparedLoader(feeder=True): the feeder process could not connect ({got}); "
                                      "use feeder=False")  # fmt: skip
                self._conn = got
                break
            if self._proc.poll() is not None:
                raise FeederError(f"PreparedLoader(feeder=True): the feeder process exited ({self._proc.returncode}) "
                                  "before it connected; see its error above, or use feeder=False")  # fmt: skip
            if not wait:
                return False
            self._accepting.join(0.1)
        return True

    def _recv(self) -> tuple[Any, ...]:
        try:
            msg: tuple[Any, ...] = loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise FeederError(
                f"PreparedLoader(feeder=True): the feeder process is gone ({exc}, exit {self._proc.poll()}); use "
                "feeder=False to see the error in this process"
            ) from None
        if msg[0] == "error":
            raise FeederError(f"PreparedLoader(feeder=True): {msg[1]}")
        return msg

    def _expect(self, kind: str) -> tuple[Any, ...]:
        msg = self._recv()
        if msg[0] != kind:
            raise FeederError(f"PreparedLoader(feeder=True): the feeder said {msg[0]!r} where {kind!r} was due")
        return msg

    def _send(self, *msg: Any) -> None:
        """A message to the child, pickled as the child's are (`dumps`: torch's reductions, so a CUDA tensor goes
        as its IPC handle; plain pickle would copy its bytes through the socket, the lent tier's gigabytes)."""
        self._conn.send_bytes(dumps(msg))

    def wait_ready(self) -> None:
        """Wait until the child has built its loader (its start overlapped whatever the caller did meanwhile);
        FeederError where it could not."""
        if not self._ready:
            self.go()
            self._connected(wait=True)
            self._expect("ready")
            self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready

    def poll_ready(self) -> bool:
        """Whether the child has built its loader, without waiting; FeederError where it could not (its error
        said, or the process gone)."""
        if not self._ready and self._connected(wait=False) and self._conn.poll():
            self._expect("ready")
            self._ready = True
        if not self._ready and self._proc.poll() is not None:
            raise FeederError(f"PreparedLoader(feeder=True): the feeder process exited ({self._proc.returncode}) "
                              "before its loader was built; see its error above, or use feeder=False")  # fmt: skip
        return self._ready

    @property
    def pid(self) -> int:
        """The child's process id."""
        return int(self._proc.pid)

    def run(self, loader: Any, epoch: int, skip: int, n: int) -> Iterator[dict[str, Any]]:
        """Batches skip..n-1 of `epoch`, made by the child; the loader's cursor kept as in-process."""
        self.wait_ready()
        if self._host is not None:
            self._host.settle(self._tally)  # the last epoch's last slot: its copies up have run
        snap = loader.cursor.begin(epoch, skip)
        # a host feeder's slot is counted taken a batch late (once its copies up have run), and batches are taken
        # ahead of the caller's: two credits more
        credits = loader.prefetch + (2 if getattr(loader, "_host_feed", False) else 0)
        self._send("epoch", EpochAsk(epoch, skip, loader.rank, loader.world, dict(snap), credits))
        self._finished = False  # the child has left the epoch (its end, or an error it said)
        ahead: collections.deque[tuple[dict[str, Any], Any, Any]] = collections.deque()
        taker = self._taker(loader, skip, n)
        try:
            got = skip  # batches received from the child
            for k in range(skip, n):
                if taker is not None:
                    ahead.append(taker.next())
                elif not ahead:
                    ahead.append(self._take(loader, got, n))
                    got += 1
                # a host feeder's next batch, where it has come: its copies up and its tail's work queued now, to
                # run beside the caller's step on this one rather than after it
                if taker is None and self._host is not None and got < n and self._conn.poll():
                    ahead.append(self._take(loader, got, n))
                    got += 1
                batch, snap, event = ahead.popleft()
                batch = loader._handover(batch, event)
                loader.cursor.delivered(epoch, k + 1, snap)
                yield batch
            if taker is not None:
                taker.stop()
            self._finished = True
            self._expect("end")
        finally:
            if taker is not None:
                taker.stop()
            if not self._finished and self._conn is not None and self._proc.poll() is None:
                self._stop()
            loader.cursor.end()

    def _taker(self, loader: Any, skip: int, n: int) -> Any:
        """A host feeder's batches taken on a thread (`loaders.fast.hostfeed.Taker`) on a GPU; None: taken here."""
        from loaders import tunables

        wanted = tunables.HOST_TAKE_THREAD
        if not getattr(loader, "_host_feed", False) or wanted is False or (wanted == "gpu" and not loader.gpu):
            return None
        from loaders.fast.hostfeed import Taker, TakeTimes

        if self._take_times is None:
            self._take_times = TakeTimes()
        return Taker(lambda k: self._take(loader, k, n), self._conn.poll, loader.device, skip, n, self._take_times)

    def _take(self, loader: Any, k: int, n: int) -> tuple[dict[str, Any], Any, Any]:
        """Batch `k`'s message, the batch out of its slot; a host feeder's replayed on a stream of this end's, with
        the event the caller's stream waits for (None: made on the caller's stream)."""
        try:
            msg = self._recv()
            while msg[0] in ("slots", "hostslots"):
                self._open_slots(msg)
                msg = self._recv()
        except FeederError:
            self._finished = True
            raise
        if msg[0] != "batch":
            self._finished = msg[0] == "end"
            raise FeederError(f"PreparedLoader(feeder=True): the epoch ended after {k} of {n} batches")
        sent: BatchSent = msg[1]
        if self._host is None:
            batch = self._unpack(sent.slot, incoming(sent.batch))
            self._taken += 1
            self._tally.set(self._taken)  # the child's credit: one batch more may be made
            return batch, sent.snap, None
        if not loader.gpu:  # a host feeder's batch: its tail replayed here, its slot freed after
            return self._replayed(loader, sent.slot, incoming(sent.batch)), sent.snap, None
        torch = loader.torch
        if self._ahead is None:
            from loaders.tail.device import tail_stream

            self._ahead = tail_stream(loader.device)
        with torch.cuda.stream(self._ahead):
            batch = self._replayed(loader, sent.slot, incoming(sent.batch))
            event = torch.cuda.Event()
            event.record(self._ahead)
        return batch, sent.snap, event

    def lend_tier(self, items: dict[int, dict[str, Any]]) -> None:
        """The training process's device tier sent to the child through CUDA IPC (kept alive here: the child
        ends before this process's tier is cleared, `PreparedLoader.close`)."""
        self.wait_ready()
        self._send("tier", {item: outgoing(tensors) for item, tensors in items.items()})

    def _replayed(self, loader: Any, at: int | None, batch: dict[str, Any]) -> dict[str, Any]:
        """A host feeder's batch (`loaders.fast.hostfeed`): read out of its slot, its tail's work replayed from the
        child's draws on the loader's device, the rest copied up; counted taken once those copies have run."""
        import torch

        from loaders.reading.staging import values_to

        if at is not None:
            batch = self._host.views(at, batch)
        replay = getattr(loader.assembly.tail, "replay_drawn", None)
        event = None
        if replay is not None:
            batch = replay(batch, loader.device)
            event = loader.assembly.tail.replay_done
        if at is not None and event is None:  # the slot's views not read by a replay: copied out of it here
            batch = {k: v.clone() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
                     for k, v in batch.items()}  # fmt: skip
        if loader.gpu:
            batch = values_to(batch, loader.device)
        self._taken += 1
        self._host.taken(self._tally, self._taken, event)
        return batch

    def _open_slots(self, msg: tuple[Any, ...]) -> None:
        """The child's slots (kept open for good) and its events; our fences, sent back. A host feeder's: its
        shared memory mapped and page-locked here (`loaders.fast.hostfeed.HostSlots`)."""
        import torch

        if msg[0] == "hostslots":
            from loaders.fast.hostfeed import HostSlots

            self._host = HostSlots(*msg[1:])
            return

        self._slots = msg[1]
        device = next(iter(self._slots[0].values())).device
        self._events = [torch.cuda.Event.from_ipc_handle(device, h) for h in msg[2]]
        with torch.cuda.device(device):  # the slots' device, whichever is current here (a loader on cuda:1)
            self._fences = [torch.cuda.Event(interprocess=True) for _ in self._slots]
            handles = [f.ipc_handle() for f in self._fences]  # made here: an event is made on its first use
        self._send("fences", handles)

    def _unpack(self, at: int | None, batch: dict[str, Any]) -> dict[str, Any]:
        """Slot `at`'s tensors copied out on the current stream (after the child's fill, before our fence)."""
        if at is None:
            return batch
        import torch

        slot = self._slots[at]
        stream = torch.cuda.current_stream(next(iter(slot.values())).device)
        stream.wait_event(self._events[at])
        for key, value in slot.items():
            batch[key] = value.clone()
        self._fences[at].record(stream)
        return batch

    def _stop(self) -> None:
        """Tell the child to leave the epoch; drop what it sent meanwhile."""
        try:
            self._send("stop")
            while (msg := self._recv())[0] != "end":
                if msg[0] in ("slots", "hostslots"):  # made by the child meanwhile: its later batches name them
                    self._open_slots(msg)
        except FeederError:
            self.close()

    def close(self) -> None:
        """Stop the child (it leaves after its epoch's stop; killed if it does not within 10 s, and at once while it
        is still starting: it holds nothing yet)."""
        if self._listener is None:
            return
        # the child's buffers released here first: a producer that exits while a consumer still maps its CUDA
        # memory prints torch's "Producer process has been terminated before all shared CUDA tensors released"
        self._slots, self._events, self._fences = [], [], []
        if self._host is not None:
            self._host.close()
            self._host = None
        if not self._ready and self._proc.poll() is None:  # still starting (imports, CUDA): nothing of it to keep
            self._proc.kill()
        if self._conn is None and self._box and not isinstance(self._box[0], BaseException):
            self._conn = self._box[0]  # connected, never used: told to leave as below
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._send("close")
            self._conn.close()
            self._conn = None
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._unblock_accept()
        self._listener.close()
        self._listener = None
        self._tally.close()
        self._accepting.join(1.0)

    def _unblock_accept(self) -> None:
        """An accept still waiting (the child left before it connected) woken: closing a listening socket does
        not wake a thread blocked on it in Linux, shutting it down does."""
        import socket

        sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)
        if self._accepting.is_alive() and sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
