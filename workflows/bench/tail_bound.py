"""The most any loader could make of a workload's chain on this GPU: the training step beside that chain's own
GPU work, with no host work for it at all.

    python -m workflows.bench.tail_bound --workload seg-elastic --device cuda:0

The workload's tail (its random transforms after the crop, batched) runs on `--batches` batches, its batched
transforms captured as CUDA graphs as the feeder's child captures them; each batch's graphs are kept. Then the
compute-only ceiling's step (one resident batch, synced before and after, as the training benchmark times it) is
timed, row by row:
- alone, first and last;
- beside one batch's graphs replayed at each step's start on a side stream of the training process (one context:
  the tail's kernels may run beside the training's and its Python costs nothing, so no loader that runs this tail
  on this GPU can do better);
- beside the same replayed by a second process, told at each step's start (a context of its own, as the feeder's
  child: the bound of a feeder whose whole batch is one graph), and (`--modes apart:MS`) the same with two tiny
  kernels launched MS ms before each replay (the work in two arrivals, as a capture's start launches two), or
  (`gated:MS`) behind a gate on the stream opened once the replay is queued (meant to make them one arrival; it
  does not: docs/benchmarks.md);
- beside the second process making a whole batch at each step's start as the child does (its reads, assembly and
  tail captured anew and launched; no hand-over, or with `--modes ring:MS` the child's hand-over copy into its ring
  of slots MS ms later, from the default stream, as the child's main thread makes it at the parent's credit), then
  the same with the tail's kernels launched one by one. These rows note the GPU memory segments the process's
  allocator asked the driver for and gave back meanwhile (each a change of the GPU's mappings);
- with `--here`, beside the tail run again at each step's start on a thread of this process, on a side stream
  (replayed from its plans where each transform has one, `loaders.tail.replay`; captured anew each batch; launched
  one by one): its Python in the training's interpreter, its kernels in
  the training's context, the step waiting for it (a tail the training process runs itself);
- then the graphs replayed alone, synced: their GPU time a batch.
Kernels the tail launches uncaptured (a transform run item by item through MONAI) are not in the graphs: the
printed count of graphs a batch says how much was. The graphs are replayed on the inputs they were captured on,
held for the run; the numbers they make are not used. Printed as measured: ms a step, x the first step alone, and
its inverse (the bound of the x-ceiling ratio the training benchmark prints).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Captured:
    """One batch's tail as captured: its graphs, and what they read (held: a replay reads them again)."""

    graphs: list[Any]
    held: list[Any]
    given: Any = None  # (the tail's input batch, its groups): what a row that runs the tail again here starts from

    def replay(self, stream: Any) -> None:
        import torch

        with torch.cuda.stream(stream):
            for graph in self.graphs:
                graph.replay()


def feeder_like(cache: Path, pipeline: Path, batch: int, device: str) -> Any:
    """The workload's loader making its batches in this process as the feeder's child makes them: the tail's
    batched transforms captured as CUDA graphs, on the caller's stream (no tail thread)."""
    from loaders import tunables
    from loaders.fast.loader import PreparedLoader
    from loaders.tail import graphs
    from workflows.bench.train_loop import transform_of

    tunables.TAIL_GRAPHS = True
    tunables.TAIL_REPLAY = False  # the segments' graphs, captured anew each batch (`--here` replays a planned tail)
    graphs.in_a_feeder()  # an empty segment's warning silenced, as in the child
    return PreparedLoader(cache, transform_of(pipeline, 0), batch, device=device, seed=0, feeder=False,
                          tail_thread=False)  # fmt: skip


def captured_batches(cache: Path, pipeline: Path, batch: int, device: str, batches: int) -> tuple[list[Captured], Any]:
    """`batches` batches of the chain's tail captured (those with a graph), and the loader (kept open: its device
    tier holds inputs the graphs read)."""
    import torch

    from loaders.tail import batched, graphs

    now = Captured([], [])
    launch, run = graphs.Segments._launch, batched.BatchedTail.run

    def kept_launch(self: Any) -> None:
        launch(self)
        graph, keep = self.graphs.inflight[-1][1]
        now.graphs.append(graph)
        now.held.append(keep)  # the host tensors its copies read

    def kept_run(self: Any, batch: Any, groups: Any = None) -> Any:
        now.held.append(dict(batch))  # the tail's inputs: a replay reads them (and writes only in its pool)
        now.given = (now.held[-1], groups)
        return run(self, batch, groups)

    graphs.Segments._launch = kept_launch  # type: ignore[method-assign]
    batched.BatchedTail.run = kept_run  # type: ignore[method-assign]
    side = torch.cuda.Stream(device=device)
    loader = feeder_like(cache, pipeline, batch, device)
    out: list[Captured] = []
    try:
        with torch.cuda.stream(side):  # the tail on a side stream (the legacy default stream cannot capture)
            for _ in range(batches):
                for got in loader:
                    side.synchronize()
                    now.held.append(got)
                    if now.graphs:
                        out.append(now)
                    now = Captured([], [])
                    if len(out) == batches:
                        break
                if len(out) == batches:
                    break
    finally:
        graphs.Segments._launch = launch  # type: ignore[method-assign]
        batched.BatchedTail.run = run  # type: ignore[method-assign]
    return out, loader


class StreamGate:
    """Work queued on a CUDA stream held back until the host says: the stream waits (the driver's
    `cuStreamWaitValue32`, no kernel) until a word of pinned host memory reaches a value, which the host then writes.
    What was queued behind it reaches the GPU at once."""

    def __init__(self) -> None:
        import ctypes

        import torch

        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # mapped: its address is the device's too
        self.wait = ctypes.CDLL("libcuda.so.1").cuStreamWaitValue32_v2
        self.wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    def hold(self, stream: Any, value: int) -> None:
        rc = self.wait(stream.cuda_stream, self.word.data_ptr(), value, 0)  # 0: CU_STREAM_WAIT_VALUE_GEQ
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {rc}")

    def open(self, value: int) -> None:
        self.word[0] = value


def _ring(device: Any) -> Any:
    """The child's ring of hand-over slots, its fences never recorded (nothing copies the slots out here)."""
    import torch

    from loaders.fast.child import Ring

    ring = Ring(4)
    with torch.cuda.device(device):
        ring.fences = [torch.cuda.Event() for _ in range(ring.count)]
    return ring


def _process_loop(spec: tuple[Any, ...], ready: Any, stop: Any, go: Any, said: Any) -> None:
    """The second process, at each `go`: one batch's graphs replayed (mode "replay", captured in this process's
    context first; "apart:MS": two one-element kernels launched MS ms before the replay, as a capture's start
    launches two, its host time before the graph: the graph's work in two arrivals, not one; "gated:MS": the same
    behind a `StreamGate` opened once the replay is queued), or the loader's next
    batch made ("make": its reads, assembly and tail captured anew and launched, as the feeder's child makes a
    batch, without the hand-over; "ring:MS": the same, then MS ms later copied into the child's ring of hand-over
    slots from the default stream, as its main thread does at the parent's credit; "make-uncaptured": the same
    without the ring, the tail's kernels launched one by one). Said
    at the end: the batches it made or replayed, and the GPU memory segments its allocator asked the driver for
    and gave back meanwhile."""
    import time

    import torch

    from loaders import tunables

    cache, pipeline, batch, device, batches, mode = spec
    torch.cuda.set_device(device)
    kept, loader = captured_batches(cache, pipeline, batch, device, batches)
    tunables.TAIL_GRAPHS = mode != "make-uncaptured"
    stream = torch.cuda.Stream(device=device)
    flags = torch.zeros(1, device=device)
    gap = float(mode.split(":")[1]) / 1e3 if mode.startswith(("apart", "gated", "ring")) else 0.0
    gate = StreamGate() if mode.startswith("gated") else None
    ring = _ring(device) if mode.startswith("ring") else None
    it: Any = iter(())
    stats = torch.cuda.memory_stats(device)
    before = (stats.get("segment.all.allocated", 0), stats.get("segment.all.freed", 0))
    ready.set()
    k = 0
    while not stop.is_set():
        if go.wait(0.1):
            go.clear()
            if mode == "replay":
                kept[k % len(kept)].replay(stream)
            elif mode.startswith(("apart", "gated")):  # two one-element kernels `gap` ms before the replay
                if gate is not None:  # held back on the stream until the replay is queued too
                    gate.hold(stream, k + 1)
                with torch.cuda.stream(stream):
                    flags.fill_(k)
                    flags.add_(1)
                time.sleep(gap)
                kept[k % len(kept)].replay(stream)
                if gate is not None:
                    gate.open(k + 1)
            else:
                with torch.cuda.stream(stream):
                    made = next(it, None)
                    if made is None:
                        it = iter(loader)
                        made = next(it)
                if ring is not None:  # handed over MS ms later, on the default stream, as the child's main thread
                    done = torch.cuda.Event()
                    done.record(stream)
                    time.sleep(gap)
                    torch.cuda.current_stream(device).wait_event(done)
                    at, _ = ring.pack(made, lambda *_: None)
                    ring.free.sent(at)
                    ring.free.new_epoch()  # nothing takes the slots here: each is free again at once
                    torch.cuda.current_stream(device).synchronize()
            k += 1
            stream.synchronize()
    stats = torch.cuda.memory_stats(device)
    said.put((k, stats.get("segment.all.allocated", 0) - before[0], stats.get("segment.all.freed", 0) - before[1]))
    loader.close()


def beside_tail_here(tail: Any, kept: list[Captured], step: Callable[[], Any], sync: Callable[[], None], n: int,
                     device: str) -> float:  # fmt: skip
    """ms a step with the tail run again in this process at each step's start: on a thread of its own and a side
    stream, on a held input batch in turn, the step waiting for it (its host time in this interpreter, its kernels
    in this context, as a tail run beside the training in its own process would be)."""
    import threading

    import torch

    from workflows.bench.interference import timed_steps

    side = torch.cuda.Stream(device=device)
    go, done, stop, turn, failed, pending = threading.Event(), threading.Event(), [False], [0], [], [False]

    def loop() -> None:
        torch.cuda.set_device(device)
        while True:
            go.wait()
            go.clear()
            if stop[0]:
                return
            try:
                with torch.cuda.stream(side):
                    batch, groups = kept[turn[0] % len(kept)].given
                    tail.run(batch, groups)
            except BaseException as e:  # said once the row ends
                failed.append(e)
            turn[0] += 1
            done.set()

    def start() -> None:
        done.clear()
        pending[0] = True
        go.set()

    def waited() -> None:
        if pending[0]:
            done.wait()
            pending[0] = False
        sync()
        side.synchronize()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        timed_steps(step, waited, max(4, n // 4), start)  # warm: its first batches capture
        ms = timed_steps(step, waited, n, start)
    finally:
        stop[0] = True
        go.set()
        thread.join(60)
    if failed:
        raise RuntimeError(f"the tail run here failed: {failed[0]!r}") from failed[0]
    return ms


def beside_second_process(spec: tuple[Any, ...], step: Callable[[], Any], sync: Callable[[], None],
                          n: int) -> tuple[float, str]:  # fmt: skip
    """(ms a step beside the second process in `spec`'s mode, what the process said of its run)."""
    import multiprocessing as mp
    import queue

    from workflows.bench.interference import timed_steps

    ctx = mp.get_context("spawn")
    ready, stop, go, said = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_process_loop, args=(spec, ready, stop, go, said), daemon=True)
    proc.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the second process did not capture its tail")
        ms = timed_steps(step, sync, n, go.set)
        stop.set()
        try:
            k, allocated, freed = said.get(timeout=60)
            note = f"{k} batches; GPU memory segments allocated {allocated}, freed {freed}"
        except queue.Empty:
            note = "the process said nothing"
        return ms, note
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


_ROWS = {"replay": "tail graphs, 2nd process", "make": "batches made, 2nd process",
         "make-uncaptured": "made, uncaptured, 2nd"}  # fmt: skip


def _label(mode: str) -> str:
    if mode.startswith("ring"):
        return f"made, ring {mode.split(':')[1]} ms on, 2nd"
    return _ROWS.get(mode, f"graphs {mode} ms, 2nd")


def main(argv: list[str] | None = None) -> int:
    from workflows.bench.interference import timed_steps
    from workflows.bench.profile_train import _options
    from workflows.bench.train import DEFAULTS
    from workflows.bench.train_loop import build_data, make_step, on_device

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seg-elastic", choices=sorted(DEFAULTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", type=int, default=12, help="batches captured (replayed in turn)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--work", type=Path, default=Path("bench_out/work"))
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--crop", type=int, default=None)
    parser.add_argument("--no-process", action="store_true", help="leave out the second process's rows")
    parser.add_argument(
        "--here", action="store_true", help="rows with the tail run again on a thread of this process at each step"
    )
    parser.add_argument("--modes", default="replay,make,make-uncaptured",
                        help="rows: replay, apart:MS, gated:MS, make, ring:MS, make-uncaptured")  # fmt: skip
    a = parser.parse_args(argv)
    if not a.device.startswith("cuda"):
        print("tail_bound: CUDA graphs need a GPU; pass --device cuda:N on a GPU box")
        return 2
    import torch

    from loaders import tunables

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    kept, loader = captured_batches(cache, pipeline, opts.batch, a.device, a.batches)
    if not kept:
        print(f"tail_bound: {a.workload}'s tail captured no graph (nothing batched on the GPU)")
        return 1
    b = kept[0].held[-1]
    # the step's own copy: a replay writes where the graphs' outputs were
    image, label = on_device(b["image"], a.device).clone(), on_device(b["label"], a.device).clone()
    train = make_step(opts, a.device)
    sync: Callable[[], Any] = torch.cuda.current_stream(a.device).synchronize
    side = torch.cuda.Stream(device=a.device)
    turn = [0]

    def beside_tail() -> None:
        kept[turn[0] % len(kept)].replay(side)
        turn[0] += 1

    def alone_graphs() -> None:
        beside_tail()
        side.synchronize()

    def step() -> None:
        train(image, label)

    def full_sync() -> None:
        sync()
        side.synchronize()

    timed_steps(step, full_sync, max(4, a.steps // 4), beside_tail)  # warm
    graphs_a_batch = sum(len(k.graphs) for k in kept) / len(kept)
    print(f"{a.workload}: the training step on one resident batch beside its tail's own GPU work, {a.steps} steps a "
          f"row, {a.device}; {len(kept)} batches captured, {graphs_a_batch:.1f} graphs a batch")  # fmt: skip
    print(f"{'beside it':<28} {'ms a step':>10} {'x alone':>8} {'bound':>6}  note", flush=True)
    alone = timed_steps(step, sync, a.steps)

    def row(name: str, ms: float, note: str = "") -> None:  # printed as measured: a run cut short keeps its rows
        print(f"{name:<28} {ms:>10.2f} {ms / alone:>8.2f} {alone / ms:>6.2f}  {note}".rstrip(), flush=True)

    row("alone, first", alone)
    row("tail graphs, this process", timed_steps(step, full_sync, a.steps, beside_tail))
    if a.here:  # the tail's Python on a thread of this process: replayed from its plans, captured anew, one by one
        from loaders.tail.plans import planned_names
        from loaders.tail.replay import ReplayedTail

        tail = loader.assembly.tail
        if ReplayedTail(tail.transforms).covers(kept[0].given[0]):
            tunables.TAIL_REPLAY = True
            row("tail replayed here", beside_tail_here(tail, kept, step, sync, a.steps, a.device))
            tunables.TAIL_REPLAY = False
        else:
            unplanned = sorted({type(t).__name__ for t in tail.transforms} - set(planned_names()))
            print(f"(not replayed: no plan for this batch; transforms with none at all: {', '.join(unplanned)})")
        row("tail made here, captured", beside_tail_here(tail, kept, step, sync, a.steps, a.device))
        tunables.TAIL_GRAPHS = False
        row("tail made here, one by one", beside_tail_here(tail, kept, step, sync, a.steps, a.device))
        tunables.TAIL_GRAPHS = True
    spec = (cache, pipeline, opts.batch, a.device, a.batches)
    for mode in [] if a.no_process else a.modes.split(","):
        row(_label(mode), *beside_second_process((*spec, mode), step, sync, a.steps))
    row("alone, last", timed_steps(step, sync, a.steps))
    print(f"a batch's graphs alone, synced: {timed_steps(alone_graphs, full_sync, a.steps):.2f} ms")
    loader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
