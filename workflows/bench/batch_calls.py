"""What making one batch asks of the GPU, as the feeder's child makes it: the CUDA runtime calls a batch and the GPU
work a batch, by name.

    python -m workflows.bench.batch_calls --workload seg-aug --device cuda:0 --warm 14

The workload's loader makes its batches in this process as the child does (`tail_bound.feeder_like`: the tail's
batched transforms captured as CUDA graphs), `--warm` batches first (past the first epoch, so that the device tier
is full and no item is admitted), then `--batches` under `torch.profiler`. Printed per batch: the runtime calls by
name (those made while a graph is captured included: a kernel launched then is recorded into the graph, not run),
then the GPU's kernels, copies and fills by name (a graph's kernels included), then the arrivals: each graph launched,
and each kernel, copy or fill launched on its own ("loose", named by the op that launched it; a GPU event is tied to
its launch by the trace's correlation id). A second CUDA context takes turns with the training's on the GPU, so what
arrives from the child one by one is what its making costs the training beyond the GPU time itself
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def profiled(loader: Any, device: str, warm: int, batches: int) -> dict[str, Any]:
    """The chrome trace of `batches` batches made on a side stream, after `warm` batches (epochs restarted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workflows.bench.timeline import chrome_trace

    it: Any = iter(())

    def take() -> Any:
        nonlocal it
        got = next(it, None)
        if got is None:
            it = iter(loader)
            got = next(it)
        return got

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


_CALLS = ("cuda_runtime", "cuda_driver")
_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Tally:
    """A trace's CUDA calls by name, its GPU work by name, and that work split by how it came: launched by a graph
    (one arrival a graph) or on its own ("loose": one arrival each), the loose by the op that launched it."""

    calls: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)
    graphs: int = 0  # graph launches
    in_graphs: int = 0  # kernels, copies and fills they ran
    loose: Counter[str] = field(default_factory=Counter)  # "op: what ran" -> count
    unattributed: int = 0  # work whose launching call the trace does not hold


def tally(trace: dict[str, Any]) -> Tally:
    """The trace's calls and GPU work; a GPU event is tied to the call that launched it by its correlation id (a
    graph's also carry their node's id), and a call to the op around it by its external id."""
    events = trace.get("traceEvents", [])
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}  # fmt: skip
    by_correlation: dict[Any, dict[str, Any]] = {}
    out = Tally()
    for e in events:
        if e.get("cat") in _CALLS:
            out.calls[e["name"]] += 1
            by_correlation[e.get("args", {}).get("correlation")] = e
    out.graphs = sum(k for name, k in out.calls.items() if name.startswith(("cudaGraphLaunch", "cuGraphLaunch")))
    for e in events:
        if e.get("cat") not in _WORK:
            continue
        name = e["name"][:60]
        out.work[name] += 1
        args = e.get("args", {})
        call = by_correlation.get(args.get("correlation"), {})
        if str(call.get("name", "")).startswith(("cudaGraphLaunch", "cuGraphLaunch")) or args.get("graph node id"):
            out.in_graphs += 1
        elif not call:
            out.unattributed += 1
        else:
            op = ops.get(call.get("args", {}).get("External id"), "no op")
            out.loose[f"{op}: {name}"] += 1
    return out


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
        got = tally(profiled(loader, a.device, a.warm, a.batches))
    finally:
        loader.close()
    n = a.batches
    print(f"{a.workload}: one batch made as the feeder's child makes it, {n} batches after {a.warm}, {a.device}")
    print(f"runtime calls a batch: {sum(got.calls.values()) / n:.1f}")
    for name, k in got.calls.most_common():
        print(f"  {k / n:8.1f}  {name}")
    print(f"GPU work a batch: {sum(got.work.values()) / n:.1f}")
    for name, k in got.work.most_common(a.top):
        print(f"  {k / n:8.1f}  {name}")
    loose = sum(got.loose.values())
    print(f"arrivals a batch: {(got.graphs + loose) / n:.1f} (graphs {got.graphs / n:.1f}, running "
          f"{got.in_graphs / n:.1f}; loose {loose / n:.1f}, by the op that launched them; not tied to a call "
          f"{got.unattributed / n:.1f})")  # fmt: skip
    for name, k in got.loose.most_common(a.top):
        print(f"  {k / n:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
