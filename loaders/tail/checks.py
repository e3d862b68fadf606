"""A batched tail's checks: device flags its transforms leave (`TailBatch.checks`: a flag false where MONAI would
have raised, with the error it would have raised), read back once the tail's work is queued.

`raise_failed` waits for them where the tail ran. A feeder's child defers them (`Deferred`): the flags are copied
without waiting into page-locked host rows (`FlagRows`), and `raise_checks` waits for that copy where the batch is
sent, so that the tail's work and the batch's hand-over reach the GPU as one arrival (docs/benchmarks.md)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["Deferred", "FlagRows", "raise_checks", "raise_failed"]


def raise_failed(checks: list[tuple[Any, BaseException]]) -> None:
    """The first check whose flag is false raised (every flag read in one wait, after the tail's work)."""
    if not checks:
        return
    import torch

    ok = torch.stack([torch.as_tensor(flag).reshape(()) for flag, _ in checks]).cpu().tolist()
    _raise_first(ok, [error for _, error in checks])


def _raise_first(ok: list[Any], errors: list[BaseException]) -> None:
    for good, error in zip(ok, errors):
        if not good:
            raise error


class Deferred:
    """One batch's checks in flight: their flags being copied into a host row, the event after that copy, and the
    errors to raise. The row is given back when this is gone (read, or dropped with its batch)."""

    def __init__(self, flags: Any, done: Any, errors: list[BaseException]) -> None:
        self.flags, self.done, self.errors = flags, done, errors

    def raise_failed(self) -> None:
        self.done.synchronize()
        _raise_first(self.flags.tolist(), self.errors)


def raise_checks(pending: list[Any]) -> None:
    """Deferred checks (`BatchedTail.take_deferred`) waited for; the first failed raised. Not on a thread whose
    stream is capturing (a wait there would end the capture)."""
    for deferred in pending:
        deferred.raise_failed()


class FlagRows:
    """Rows of page-locked host memory, registered with CUDA once, that a tail's flags are copied into without
    waiting. Not torch's pinned-memory cache: on the GPU box (torch 2.11) a pinned allocation on the tail thread,
    after its CUDA graphs had copied pinned host memory, raised `CUDA error: invalid argument`. Rows are handed out
    in turn and given back when their `Deferred` is gone; the copies into them are queued on one stream, in order,
    so a row given back while its copy is in flight is written again only after it."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        import torch

        self.width = width
        self.host = torch.zeros((rows, width), dtype=torch.bool)
        self.free = list(range(rows))
        self.lock = threading.Lock()
        cudart = torch.cuda.cudart()
        portable = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
        self.registered = int(cudart.cudaHostRegister(self.host.data_ptr(), self.host.numel(), portable)) == 0
        if self.registered:  # the tensor held by the finalizer until its memory is unregistered
            weakref.finalize(self, _unregister, self.host)

    def read(self, checks: list[tuple[Any, BaseException]]) -> Deferred | None:
        """The checks' flags copied without waiting into a free row; None where none is free, the checks are more
        than a row, or the rows could not be page-locked (then they are read where they are: `raise_failed`)."""
        import torch

        if not self.registered or len(checks) > self.width:
            return None
        with self.lock:
            if not self.free:
                return None
            row = self.free.pop()
        flags = torch.stack([torch.as_tensor(flag).reshape(()).to(torch.bool) for flag, _ in checks])
        host = self.host[row, : len(checks)]
        host.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        deferred = Deferred(host, done, [error for _, error in checks])
        weakref.finalize(deferred, self._give_back, row)
        return deferred

    def _give_back(self, row: int) -> None:
        with self.lock:
            self.free.append(row)


def _unregister(host: Any) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
