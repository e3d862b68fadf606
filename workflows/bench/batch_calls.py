"""What making one batch asks of the GPU, as the feeder's child makes it: the CUDA runtime calls a batch and the GPU
work a batch, by name; then what reaches the GPU as one arrival each, by op.

    python -m workflows.bench.batch_calls --workload seg-aug --device cuda:0 --warm 14

The workload's loader makes its batches in this process as the child does (`tail_bound.feeder_like`: the tail's
batched transforms captured as CUDA graphs), `--warm` batches first (past the first epoch, so that the device tier
is full and no item is admitted). Then `--batches` under `torch.profiler`: the runtime calls and the GPU's kernels,
copies and fills by name. The tail captures nothing while a profiler runs (`loaders.tail.graphs`), so these are
the batch's work uncaptured. Then `--batches` more, as the child makes them, under a dispatch mode that counts each
op on a CUDA tensor by whether a graph was being captured when it ran, and the graphs launched: the arrivals a batch
are the graphs launched and the ops run outside a capture, one each (an op may launch more than one kernel). Last,
the arrivals in time: the graph launches and the ops that launch work (not views), those less than half a
millisecond apart on the host's clock counted as one. A second CUDA context takes turns with the training's on the
GPU, and each arrival of its work apart from the others costs the training a turn (docs/benchmarks.md: about
1.1-1.5 ms a step on `seg-aug`), so the arrivals in time are what making a batch costs the training beyond its GPU
time.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def batches_of(loader: Any) -> Any:
    """A function that makes the loader's next batch, an epoch's end starting the next."""
    it: Any = iter(())

    def take() -> Any:
        nonlocal it
        got = next(it, None)
        if got is None:
            it = iter(loader)
            got = next(it)
        return got

    return take


def profiled(take: Any, device: str, warm: int, batches: int) -> dict[str, Any]:
    """The chrome trace of `batches` batches made by `take` on a side stream, after `warm` batches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workflows.bench.timeline import chrome_trace

    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):  # the legacy default stream cannot capture
        for _ in range(warm):
            take()
        side.synchronize()
        with warnings.catch_warnings():  # torch 2.11 warns that a profile keeps one cycle's events: one is all
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(batches):
                    take()
                side.synchronize()
    return chrome_trace(prof)


def made(take: Any, device: str, batches: int) -> Arrivals:
    """`batches` batches made by `take` on a side stream, their ops counted."""
    import torch

    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side), counting("cuda") as out:
        for _ in range(batches):
            take()
        side.synchronize()
    return out


_CALLS = ("cuda_runtime", "cuda_driver")
_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Tally:
    """A trace's CUDA calls by name and its GPU work by name."""

    calls: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)


def tally(trace: dict[str, Any]) -> Tally:
    """The trace's CUDA runtime and driver calls, and its kernels, copies and fills."""
    out = Tally()
    for e in trace.get("traceEvents", []):
        if e.get("cat") in _CALLS:
            out.calls[e["name"]] += 1
        elif e.get("cat") in _WORK:
            out.work[e["name"][:60]] += 1
    return out


@dataclass
class Arrivals:
    """Ops on `kind` tensors by name, split by whether a CUDA graph was being captured when they ran, and the
    graphs launched."""

    loose: Counter[str] = field(default_factory=Counter)
    captured: Counter[str] = field(default_factory=Counter)
    graphs: int = 0
    times: list[float] = field(default_factory=list)  # when work reached the stream outside a capture (host clock)


GAP_S = 0.5e-3  # launches closer than this reach the GPU as one arrival (a capture's host time is milliseconds)


def bursts(times: list[float], gap: float = GAP_S) -> int:
    """How many groups `times` make, a group ending where the next time is more than `gap` later."""
    ordered = sorted(times)
    return sum(1 for i, t in enumerate(ordered) if i == 0 or t - ordered[i - 1] > gap)


@contextlib.contextmanager
def counting(kind: str = "cuda") -> Iterator[Arrivals]:
    """Within it, every op with a `kind` tensor among its inputs or outputs counted (`Arrivals`), and every graph
    segment the tail launches (`loaders.tail.graphs.Segments`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from loaders.tail import graphs

    out = Arrivals()

    class Count(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            got = func(*args, **(kwargs or {}))
            flat = tree_flatten((args, kwargs, got))[0]
            if any(isinstance(t, torch.Tensor) and t.device.type == kind for t in flat):
                capturing = kind == "cuda" and torch.cuda.is_current_stream_capturing()
                (out.captured if capturing else out.loose)[func.overloadpacket.__name__] += 1
                if not capturing and not _is_view(func):  # a view launches nothing
                    out.times.append(time.perf_counter())
            return got

    launch = graphs.Segments._launch

    def counted(self: Any) -> None:
        launch(self)
        out.graphs += 1
        out.times.append(time.perf_counter())

    graphs.Segments._launch = counted  # type: ignore[method-assign]
    try:
        with Count():
            yield out
    finally:
        graphs.Segments._launch = launch  # type: ignore[method-assign]


def _is_view(func: Any) -> bool:
    """Whether an op returns a view of an input (its schema says so), launching no work."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _print(got: Tally, arrivals: Arrivals, n: int, top: int) -> None:
    print(f"runtime calls a batch, uncaptured: {sum(got.calls.values()) / n:.1f}")
    for name, k in got.calls.most_common():
        print(f"  {k / n:8.1f}  {name}")
    print(f"GPU work a batch, uncaptured: {sum(got.work.values()) / n:.1f}")
    for name, k in got.work.most_common(top):
        print(f"  {k / n:8.1f}  {name}")
    loose = sum(arrivals.loose.values())
    print(f"arrivals a batch, as the child makes it: {(arrivals.graphs + loose) / n:.1f} (graphs "
          f"{arrivals.graphs / n:.1f}, holding {sum(arrivals.captured.values()) / n:.1f} ops; ops on their own "
          f"{loose / n:.1f}, by op)")  # fmt: skip
    for name, k in arrivals.loose.most_common(top):
        print(f"  {k / n:8.1f}  {name}")
    print(
        f"arrivals in time a batch: {bursts(arrivals.times) / n:.1f} (graph launches and ops that launch work, "
        f"those less than {GAP_S * 1e3:g} ms apart counted as one; each a turn of a second context on the GPU)"
    )


def main(argv: list[str] | None = None) -> int:
    from workflows.bench.profile_train import _options
    from workflows.bench.tail_bound import feeder_like
    from workflows.bench.train import DEFAULTS
    from workflows.bench.train_loop import build_data

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seg-aug", choices=sorted(DEFAULTS))
    parser.add_argument("--warm", type=int, default=14, help="batches made before the profiled ones")
    parser.add_argument("--batches", type=int, default=8, help="batches profiled")
    parser.add_argument("--top", type=int, default=30, help="names listed per table")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--work", type=Path, default=Path("bench_out/work"))
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--crop", type=int, default=None)
    a = parser.parse_args(argv)
    if not a.device.startswith("cuda"):
        print("batch_calls: it counts CUDA calls; pass --device cuda:N on a GPU box")
        return 2
    import torch

    torch.cuda.set_device(a.device)
    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    loader = feeder_like(cache, pipeline, opts.batch, a.device)
    try:
        take = batches_of(loader)
        got = tally(profiled(take, a.device, a.warm, a.batches))
        arrivals = made(take, a.device, a.batches)
    finally:
        loader.close()
    n = a.batches
    print(f"{a.workload}: one batch made as the feeder's child makes it, {n} batches after {a.warm}, {a.device}")
    _print(got, arrivals, a.batches, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
