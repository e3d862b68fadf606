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
- the child makes at most `prefetch` batches the parent has not received (credits), and stops when told.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from loaders.errors import LoaderStateError, PrepError
from loaders.nesting import map_leaves
from loaders.state import same

_CHILD = "from loaders.feeder import serve; serve()"
_ENV = "BLOCKPREP_FEEDER"  # address and authkey of the parent's listener, for the child


class FeederError(PrepError, RuntimeError):
    """The feeder process could not start or failed; the message says why and how to go on."""


def _dumps(obj: Any) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    return bytes(ForkingPickler.dumps(obj))


def _loads(data: bytes) -> Any:
    import torch.multiprocessing  # noqa: F401

    return pickle.loads(data)


def _outgoing(value: Any) -> Any:
    """A batch value as sent: CUDA tensors as themselves (IPC), host tensors by value (numpy), plain
    tensors only (a tensor subclass would pickle its storage, which CUDA storages refuse)."""
    import torch

    def leaf(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        plain = v.as_subclass(torch.Tensor) if type(v) is not torch.Tensor else v
        return plain if plain.is_cuda else _Host(plain.numpy())

    return map_leaves(value, leaf)


def _incoming(value: Any) -> Any:
    import torch

    return map_leaves(value, lambda v: torch.from_numpy(v.array) if isinstance(v, _Host) else v)


class _Host:
    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_Host, (self.array,))


class _Ring:
    """The child's end of the hand-over of a batch's top-level CUDA tensors: `slots` fixed buffers per key,
    shared with the parent once (CUDA IPC), filled in turn. Each fill is followed by an IPC event the parent's
    stream waits on; a slot is filled again only after the parent's fence for it (recorded after the parent
    copied the slot out, before its credit) has passed. Tensors sent one by one instead would each be a fresh
    block of the child's allocator (a sent block is kept in limbo until memory runs short) and a fresh
    cudaIpcOpenMemHandle in the parent, which measured slower (docs/benchmarks.md, the feeder)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.slots: list[dict[str, Any]] = []
        self.events: list[Any] = []
        self.fences: list[Any] = []  # the parent's events, opened here when it sends them
        self.shapes: dict[str, Any] = {}
        self.k = 0

    def pack(self, batch: dict[str, Any], send: Any) -> tuple[int | None, dict[str, Any]]:
        """(slot, the batch to send): the top-level CUDA tensors copied into the slot (marked `_IN_SLOT`), the
        rest as `_outgoing`; slot None where the batch's CUDA tensors are not those the slots were made for."""
        import torch

        cuda = {k: v.as_subclass(torch.Tensor) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.is_cuda}
        shapes = {k: (tuple(v.shape), v.dtype, v.device) for k, v in cuda.items()}
        if not self.slots and cuda:
            self.shapes = shapes
            self.slots = [{k: torch.empty_like(v) for k, v in cuda.items()} for _ in range(self.count)]
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(self.count)]
            send("slots", self.slots, [e.ipc_handle() for e in self.events])
        if not cuda or shapes != self.shapes:
            return None, _outgoing(batch)
        at = self.k % self.count
        self.k += 1
        stream = torch.cuda.current_stream(next(iter(cuda.values())).device)
        if self.k > self.count:  # the slot was filled before: the parent's copy of it must be done
            stream.wait_event(self.fences[at])
        for key, value in cuda.items():
            self.slots[at][key].copy_(value)
        self.events[at].record(stream)
        return at, {k: _IN_SLOT if k in cuda else _outgoing(v) for k, v in batch.items()}

    def open_fences(self, handles: list[Any]) -> None:
        import torch

        device = next(iter(self.slots[0].values())).device
        self.fences = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


_IN_SLOT = "\x00blockprep-slot"


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
        env = dict(os.environ)
        env[_ENV] = f"{self._listener.address}|{key.hex()}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env)
        self._conn: Any = None
        self._slots: list[dict[str, Any]] = []
        self._events: list[Any] = []
        self._fences: list[Any] = []
        self._ready = False  # the child says so once it has built its loader (imports included: seconds)
        try:
            self._conn = self._accept()
            self._conn.send_bytes(payload)
        except BaseException:
            self.close()
            raise

    def _accept(self) -> Any:
        import threading

        box: list[Any] = []
        t = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            if self._proc.poll() is not None and not box:
                raise FeederError(f"PreparedLoader(feeder=True): the feeder process exited ({self._proc.returncode}) "
                                  "before it connected; see its error above, or use feeder=False")  # fmt: skip
        return box[0]

    def _recv(self) -> tuple[Any, ...]:
        try:
            msg: tuple[Any, ...] = _loads(self._conn.recv_bytes())
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
        self._conn.send_bytes(pickle.dumps(msg))

    def wait_ready(self) -> None:
        """Wait until the child has built its loader (its start overlapped whatever the caller did meanwhile);
        FeederError where it could not."""
        if not self._ready:
            self._expect("ready")
            self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready

    def run(self, loader: Any, epoch: int, skip: int, n: int) -> Iterator[dict[str, Any]]:
        """Batches skip..n-1 of `epoch`, made by the child; the loader's `_live` kept as in-process."""
        self.wait_ready()
        snap = loader._draws.take()
        self._send("epoch", epoch, skip, loader.rank, loader.world, dict(snap), loader.prefetch)
        loader._live = [epoch, skip, snap]
        finished = False  # the child has left the epoch (its end, or an error it said)
        try:
            for k in range(skip, n):
                try:
                    msg = self._recv()
                    while msg[0] == "slots":
                        self._open_slots(msg)
                        msg = self._recv()
                except FeederError:
                    finished = True
                    raise
                if msg[0] != "batch":
                    finished = msg[0] == "end"
                    raise FeederError(f"PreparedLoader(feeder=True): the epoch ended after {k} of {n} batches")
                batch = self._unpack(msg[1], _incoming(msg[2]))
                self._send("credit")
                loader._live = [epoch, k + 1, msg[3]]
                yield batch
            finished = True
            self._expect("end")
        finally:
            if not finished and self._conn is not None and self._proc.poll() is None:
                self._stop()
            loader._draws.put(loader._live[2])
            loader._live = None

    def _open_slots(self, msg: tuple[Any, ...]) -> None:
        """The child's slots (kept open for good) and its events; our fences, sent back."""
        import torch

        self._slots = msg[1]
        device = next(iter(self._slots[0].values())).device
        self._events = [torch.cuda.Event.from_ipc_handle(device, h) for h in msg[2]]
        self._fences = [torch.cuda.Event(interprocess=True) for _ in self._slots]
        self._send("fences", [f.ipc_handle() for f in self._fences])

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
            while self._recv()[0] != "end":
                pass
        except FeederError:
            self.close()

    def close(self) -> None:
        """Stop the child (it leaves after its epoch's stop; killed if it does not within 10 s)."""
        if self._listener is None:
            return
        # the child's buffers released here first: a producer that exits while a consumer still maps its CUDA
        # memory prints torch's "Producer process has been terminated before all shared CUDA tensors released"
        self._slots, self._events, self._fences = [], [], []
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
        self._listener.close()
        self._listener = None


def _bound_to_parent() -> None:
    """The child lives and ends with the training process, whatever signals its process group gets: Ctrl-C
    and SLURM's USR1/USR2 (`scancel --signal=USR1 JOBID` reaches every process of the step) are the training
    script's to handle, and would otherwise kill the child (USR1's default) under a script that goes on to
    save its state. It ends when the training process does: its socket closes, which the child sees at its
    next message (no PR_SET_PDEATHSIG: that fires when the creating *thread* ends, which may be long before)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def serve() -> None:
    """The child's end: connect, build the loader, run the epochs asked for."""
    from multiprocessing.connection import Client

    _bound_to_parent()
    address, key = os.environ.pop(_ENV).rsplit("|", 1)
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(key))

    def send(*msg: Any) -> None:
        conn.send_bytes(_dumps(msg))

    try:
        from loaders.loader import PreparedLoader

        loader = PreparedLoader(**pickle.loads(conn.recv_bytes()))
    except BaseException as exc:  # noqa: BLE001  (said to the parent, which raises it)
        send("error", f"{type(exc).__name__}: {exc}")
        return
    send("ready")
    ring = _Ring(loader.prefetch + 2)
    ahead: _Ahead | None = None
    try:
        while True:
            msg = _loads(conn.recv_bytes())
            if msg[0] == "close":
                return
            if msg[0] == "fences":
                ring.open_fences(msg[1])
            if msg[0] == "epoch":
                ahead = _epoch(loader, conn, send, msg, ring, ahead)
    except (EOFError, OSError):
        return  # the parent is gone
    finally:
        if ahead is not None:
            ahead.drop(loader)
        loader.close()


class _Ahead:
    """The next epoch begun before the parent asks for it: its first batch made and the read thread reading on,
    so that an epoch's start (the pipeline filled again: 12-step epochs on `spheres`, `gds-seed`) costs the
    training process nothing. Used only when the parent asks for exactly that epoch (the next, from its
    first batch, same shard, the random states as the last epoch left them); otherwise dropped, its draws
    put back. Nothing of it is sent before it is asked for."""

    def __init__(self, loader: Any, epoch: int, snap: dict[int, Any]) -> None:
        self.key = (epoch, 0, loader.rank, loader.world, snap)
        loader.epoch, loader._resume = epoch, 0
        self.it: Any = iter(loader)
        self.first: list[Any] = []
        try:
            self.first = [next(self.it)]
        except StopIteration:
            pass
        except BaseException:  # noqa: BLE001  (made again when asked for, where the error is said)
            self.it = None
            loader._draws.put(snap)

    def take(self, msg: tuple[Any, ...]) -> Any:
        """The epoch's batches if `msg` asks for this epoch, else None."""
        _, epoch, skip, rank, world, snap, _ = msg
        if self.it is None or (epoch, skip, rank, world) != self.key[:4] or not same(snap, self.key[4]):
            return None
        import itertools

        return itertools.chain(self.first, self.it)

    def drop(self, loader: Any) -> None:
        if self.it is not None:
            self.it.close()  # the read thread stopped; the draws put back to before this epoch
            self.it = None
            loader._draws.put(self.key[4])


def _epoch(loader: Any, conn: Any, send: Any, msg: tuple[Any, ...], ring: _Ring, ahead: _Ahead | None) -> _Ahead | None:
    """One epoch as the parent asked (from `ahead` where it is that epoch); returns the next epoch begun."""
    _, epoch, skip, rank, world, snap, credits = msg
    batches = ahead.take(msg) if ahead is not None else None
    gen = ahead.it if batches is not None and ahead is not None else None
    if batches is None and ahead is not None:
        ahead.drop(loader)
    finished = False
    try:
        if batches is None:
            loader.shard(rank, world)
            loader.epoch, loader._resume = epoch, skip
            loader._draws.put(snap)
            batches = gen = iter(loader)
        for batch in batches:
            stopped = False
            while credits == 0 or conn.poll():
                got = _loads(conn.recv_bytes())
                credits += got[0] == "credit"
                stopped = stopped or got[0] == "stop"
                if got[0] == "fences":
                    ring.open_fences(got[1])
                if stopped:
                    break
            if stopped:
                break
            credits -= 1
            at, out = ring.pack(batch, send)
            send("batch", at, out, dict(loader._live[2]))
        else:
            finished = True
        send("end")
    except (EOFError, OSError):
        raise
    except LoaderStateError as exc:
        send("error", str(exc))
    except BaseException as exc:  # noqa: BLE001
        send("error", f"{type(exc).__name__}: {exc}")
    finally:
        if gen is not None:
            gen.close()  # an epoch left early: the read thread stopped, the draws as of the last batch sent
    return _Ahead(loader, epoch + 1, dict(loader._draws.take())) if finished else None
