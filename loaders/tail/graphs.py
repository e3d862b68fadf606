"""A batch's tail on a CUDA side stream, its batched transforms' kernels launched as CUDA graphs.

A per-item tail launches a few hundred small kernels a batch (`seg-aug` 242, `seg-elastic` 197 on an H200). Where
they run in a second CUDA context (the feeder's process), each kernel costs the training beside it a turn on the
GPU; the same kernels launched as one CUDA graph cost it about a third as much (`workflows.bench.interference`,
docs/benchmarks.md). So the kernels of consecutive batched transforms are captured on the tail's stream and
launched as one graph (a "segment"): the same kernels, on the same inputs, in the same order, so the same
numbers. A segment ends where the host must read the GPU (`host_read`: the items' ranges some transforms draw
from) and around every transform that runs otherwise (per item through MONAI). Draws made on the host (numpy's, made
ahead on a thread or inline) are made while the segment is captured: only their copies up are in the graph.

A transform whose work cannot be captured (it reads the GPU on the host, or copies from pageable memory: CUDA
refuses that during a capture) fails its capture before anything of the segment has run: the segment is undone
(the batch as it stood at its start, every random state of its transforms put back), and run again uncaptured,
that transform from then on uncaptured. Host tensors copied up during a capture (`keep`) and the graphs are held
until the GPU has run them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from loaders import tunables

_log = logging.getLogger("loaders.tail")

# The MONAI transforms whose batched versions are captured (each checked against MONAI on a GPU, captured).
CAPTURED = frozenset({
    "AsDiscreted", "CastToTyped", "ConcatItemsd", "CopyItemsd", "DeleteItemsd", "EnsureTyped", "NormalizeIntensityd",
    "Rand3DElasticd", "RandAdjustContrastd", "RandAffined", "RandAxisFlipd", "RandBiasFieldd", "RandCoarseDropoutd",
    "RandFlipd", "RandGaussianNoised", "RandGaussianSharpend", "RandHistogramShiftd", "RandRotate90d", "RandRotated",
    "RandScaleIntensityd", "RandShiftIntensityd", "RandStdShiftIntensityd", "SqueezeDimd",
})  # fmt: skip

_here = threading.local()  # the segments of the batch this thread's tail is running, if any
in_feeder = False  # this process is a feeder's (`in_a_feeder`): where TAIL_GRAPHS="feeder" captures


def in_a_feeder() -> None:
    """This process is a feeder's: where TAIL_GRAPHS="feeder", its tails capture. A segment in which no item's
    transform launched anything (every flip skipped) is an empty graph, which torch warns of: not here."""
    global in_feeder
    import warnings

    in_feeder = True
    warnings.filterwarnings("ignore", message="The CUDA Graph is empty", category=UserWarning)


class Rewind(Exception):
    """A capture failed: the tail goes on from transform `index`, the batch and random states as they were there."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Graphs:
    """One tail's graphs: the memory pool they allocate from, the transforms not captured (their capture failed),
    and the graphs and host tensors the GPU may still be using."""

    def __init__(self) -> None:
        self.pool: Any = None  # a new one after a failed capture (torch keeps the failed one's pool recording)
        self.last: Any = None  # the latest graph of the pool: a pool no graph holds may not be captured into again
        self.refused: dict[int, str] = {}  # transform index -> why its capture failed
        self.inflight: deque[tuple[Any, list[Any]]] = deque()  # (event after a replay, what it uses)
        self.launched = 0  # segments launched
        self.undone: list[list[Any]] = []  # the host tensors of undone segments' copies (`Segments._undo`)
        self.ahead: Any = None  # (graph, stream): the next batch's first capture, opened when the last was queued
        self.redo: Any = None  # () -> {key: tensor}: the batch's assembly made again, where it was captured ahead

    def begin(self, tb: Any) -> Segments | None:
        """This batch's segments, where its tail runs on a CUDA stream that may capture (the capture opened ahead,
        holding the batch's assembly, their first); else None (a capture opened ahead ended, the assembly made again
        outside it)."""
        import torch

        tensors = [v for v in tb.data.values() if isinstance(v, torch.Tensor)]
        stream = self._stream(tensors[0].device) if tensors and tensors[0].is_cuda else None
        if self.ahead is not None:
            graph, opened = self.ahead
            if stream is not None and stream == opened:
                self.ahead, redo, self.redo = None, self.redo, None
                return Segments(self, stream, adopted=(graph, _Mark(0, _fields(tb), []), redo))
            self.abandon_ahead(tb)
        return None if stream is None else Segments(self, stream)

    def _stream(self, device: Any) -> Any:
        """The current stream of `device` where a tail on it captures (this process's choice, a CUDA side stream not
        capturing but for the capture opened ahead, no profiler running, a torch that can undo a capture); else
        None."""
        wanted = tunables.TAIL_GRAPHS
        if wanted is False or (wanted == "feeder" and not in_feeder):
            return None
        import torch

        if torch._C._autograd._profiler_enabled() or not _undoable():
            return None
        stream = torch.cuda.current_stream(device)
        ahead = self.ahead is not None and self.ahead[1] == stream
        if stream == torch.cuda.default_stream(device) or (torch.cuda.is_current_stream_capturing() and not ahead):
            return None  # the legacy default stream cannot capture; a capture already running is the caller's
        warm = _here.__dict__.setdefault("warm", set())
        if device.index not in warm:
            _warm(device)
            warm.add(device.index)
        return stream

    def open_ahead(self, device: Any) -> None:
        """The next batch's first capture opened now, on the current stream, where this tail captured the batch just
        queued: a capture's start launches two small kernels (torch sets the graph's random seed and offset), and
        now they reach the GPU with the batch just queued, not alone before the next (each arrival of a feeder's
        work is a turn of its context on the GPU: docs/benchmarks.md). The next batch's assembly is captured into it
        (`made_ahead`), and its tail goes on in it."""
        import torch

        if self.ahead is not None or self.launched == 0 or not tunables.CAPTURE_AHEAD:
            return
        stream = self._stream(torch.device(device))
        if stream is None or torch.cuda.is_current_stream_capturing():
            return
        if self.pool is None:
            self.pool, self.last = torch.cuda.graph_pool_handle(), None
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.ahead = (graph, stream)

    def made_ahead(self, redo: Any) -> bool:
        """Whether a capture is open ahead (what the batch's assembly just launched is in it); `redo` makes that
        assembly again, outside any capture, where the capture is ended unlaunched."""
        if self.ahead is None:
            return False
        self.redo = redo
        return True

    def abandon_ahead(self, tb: Any = None) -> None:
        """The capture opened ahead ended, never launched; what the batch's assembly made in it is made again (into
        `tb`, where given)."""
        if self.ahead is None:
            return
        (graph, _), self.ahead = self.ahead, None
        redo, self.redo = self.redo, None
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - an invalidated capture: its pool ends with it
            self._end_pool()
        if redo is not None and tb is not None:
            tb.data.update(redo())

    def _end_pool(self) -> None:
        import torch

        with contextlib.suppress(Exception):  # where it raised before telling the allocator the capture ended
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), self.pool)
        self.pool = None

    def settle(self) -> None:
        """Forget what the GPU has finished with."""
        while self.inflight and self.inflight[0][0].query():
            self.inflight.popleft()


def _undoable() -> bool:
    """Whether this torch can end a failed capture's pool (`_cuda_endAllocateToPool`): a capture left recording
    would hold the allocator in capture mode, its freed blocks never reused."""
    import torch

    return hasattr(torch._C, "_cuda_endAllocateToPool")


@dataclasses.dataclass
class _Mark:
    """Where the open segment began: the transform's index, the batch's fields then, and the random states of
    the transforms run since (each taken before it ran)."""

    index: int
    batch: dict[str, Any]
    states: list[list[tuple[Any, Any]]]


class Segments:
    """The segments of one batch's tail (`BatchedTail.run`): `captured` runs a transform's batched version
    inside the open segment, `close` launches it."""

    def __init__(self, graphs: Graphs, stream: Any, adopted: tuple[Any, _Mark, Any] | None = None) -> None:
        self.graphs, self.stream = graphs, stream
        self.graph: Any = None
        self.mark: _Mark | None = None
        self.keep: list[Any] = []
        self.redo: Any = None  # the assembly made again, where the open segment (opened ahead) holding it is undone
        if adopted is not None:  # the capture opened ahead: the batch's assembly in it, its first transform next
            self.graph, self.mark, self.redo = adopted

    def takes(self, index: int, transform: Any) -> bool:
        return index not in self.graphs.refused and type(transform).__name__ in CAPTURED

    def captured(self, index: int, transform: Any, handler: Any, tb: Any) -> bool:
        """`handler(transform, tb)` captured into the open segment (opened here if none is). On a failure the
        segment is undone and `Rewind` raised, this transform refused from then on."""
        if self.mark is None:
            self.mark = _Mark(index, _fields(tb), [])
        self.mark.states.append(_states(transform))
        if self.graph is None:
            self._open()
        _here.segments = self
        try:
            return bool(handler(transform, tb))
        except Rewind:
            raise
        except Exception as e:  # noqa: BLE001 - any failure inside a capture is undone and run again uncaptured
            raise self._undo(tb, [index], e) from e
        finally:
            _here.segments = None

    def close(self, tb: Any) -> None:
        """Launch the open segment, if any (a failure at its end undoes it: every transform in it refused)."""
        if self.graph is not None:
            try:
                self._launch()
            except Exception as e:  # noqa: BLE001
                assert self.mark is not None
                raise self._undo(tb, [self.mark.index + j for j in range(len(self.mark.states))], e) from e
        self.mark, self.redo = None, None

    def _open(self) -> None:
        import torch

        if self.graphs.pool is None:
            self.graphs.pool, self.graphs.last = torch.cuda.graph_pool_handle(), None
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.graphs.pool, capture_error_mode="thread_local")

    def _launch(self) -> None:
        import warnings

        import torch

        with warnings.catch_warnings():  # a segment that launched nothing (every item skipped) is an empty graph
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty", category=UserWarning)
            self.graph.capture_end()
        graph, self.graph = self.graph, None
        keep, self.keep = self.keep, []
        graph.replay()
        event = torch.cuda.Event()
        event.record(self.stream)
        self.graphs.settle()
        self.graphs.inflight.append((event, [graph, keep]))
        self.graphs.last = graph
        self.graphs.launched += 1

    def _undo(self, tb: Any, refused: list[int], error: Exception) -> Rewind:
        """The open segment undone: its capture ended, the batch and random states as at its start."""
        import torch

        graph, self.graph = self.graph, None
        # the host tensors its copies used are never freed: freeing a pinned block a captured copy used records an
        # event on the stream (during the capture torch aborts; after it, a later query of that event fails
        # another capture). A transform is undone once before it is refused, so these are few.
        self.graphs.undone.append(self.keep)
        self.keep = []
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.capture_end()  # ends the stream's capture (the capture itself is invalid)
            with contextlib.suppress(Exception):  # where it raised before telling the allocator the capture ended
                torch._C._cuda_endAllocateToPool(self.stream.device.index, self.graphs.pool)
            self.graphs.pool = None
        mark, self.mark = self.mark, None
        assert mark is not None
        vars(tb).update(_fields_copy(mark.batch))
        redo, self.redo = self.redo, None
        if redo is not None:  # the batch's assembly was in the segment undone: made again, outside any capture
            tb.data.update(redo())
        for states in reversed(mark.states):
            for rng, state in states:
                rng.set_state(state)
        why = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        self.graphs.refused.update(dict.fromkeys(refused, why))
        _log.debug("tail graphs: transform(s) %s not captured from now on: %s", refused, why)
        return Rewind(mark.index)


@contextlib.contextmanager
def host_read(tb: Any) -> Iterator[None]:
    """Around a read of the GPU by the host inside a captured transform that has launched nothing before it:
    what is captured so far is launched first, and the segment goes on from that transform after the read."""
    segments: Segments | None = getattr(_here, "segments", None)
    if segments is None or segments.graph is None or segments.mark is None:
        yield
        return
    mark = segments.mark
    current = (mark.index + len(mark.states) - 1, mark.states[-1])
    segments.close(tb)
    yield
    segments.mark = _Mark(current[0], _fields(tb), [current[1]])
    segments._open()


def _warm(device: Any) -> None:
    """cuBLAS's and cuDNN's handles for this thread and stream made before its first capture (made inside one,
    they fail it)."""
    import torch

    a = torch.ones((2, 2), device=device)
    torch.nn.functional.conv1d((a @ a).reshape(1, 1, 4), torch.ones((1, 1, 3), device=device))


def keep(value: Any) -> None:
    """Hold `value` (a host tensor a captured copy reads) until the GPU has run its segment, or for as long as the
    graph being captured (`holding`) lives."""
    held = getattr(_here, "held", None)
    if held is not None:
        held.append(value)
        return
    segments: Segments | None = getattr(_here, "segments", None)
    if segments is not None and segments.graph is not None:
        segments.keep.append(value)


def capturing_for_good() -> bool:
    """Whether this thread captures a graph replayed for good (`holding`): no batch's draws may go into it."""
    return getattr(_here, "held", None) is not None


@contextlib.contextmanager
def holding(held: list[Any]) -> Iterator[None]:
    """What `keep` is given meanwhile (on this thread) goes into `held`: the host tensors a graph captured once and
    replayed for good copies from (`loaders.tail.replay`: constants of the batch's shapes, never its draws)."""
    before = getattr(_here, "held", None)
    _here.held = held
    try:
        yield
    finally:
        _here.held = before


def _fields(tb: Any) -> dict[str, Any]:
    return _fields_copy(vars(tb))


def _fields_copy(fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    for name in ("data", "per_item", "inputs", "origin", "groups"):
        out[name] = type(fields[name])(fields[name])
    out["items"] = None if fields["items"] is None else [dict(d) for d in fields["items"]]
    out["checks"] = list(fields["checks"])
    return out


def _states(transform: Any, depth: int = 3) -> list[tuple[Any, Any]]:
    """Every numpy RandomState `transform` draws from (its own and its inner transforms'), with its state now."""
    found: dict[int, Any] = {}

    def walk(obj: Any, left: int) -> None:
        rng = getattr(obj, "R", None)
        if isinstance(rng, np.random.RandomState):
            found.setdefault(id(rng), rng)
        if left == 0 or not hasattr(obj, "__dict__"):
            return
        for v in vars(obj).values():
            if hasattr(v, "randomize") or hasattr(v, "R"):
                walk(v, left - 1)

    walk(transform, depth)
    return [(rng, rng.get_state()) for rng in found.values()]
