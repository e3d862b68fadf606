"""What making one batch asks of the GPU, as the feeder's child makes it: the CUDA runtime calls a batch and the GPU
work a batch, by name.

    python -m workflows.bench.batch_calls --workload seg-aug --device cuda:0 --warm 14

The workload's loader makes its batches in this process as the child does (`tail_bound.feeder_like`: the tail's
batched transforms captured as CUDA graphs), `--warm` batches first (past the first epoch, so that the device tier
is full and no item is admitted), then `--batches` under `torch.profiler`. Printed per batch: the runtime calls by
name (those made while a graph is captured included: a kernel launched then is recorded into the graph, not run),
then the GPU's kernels, copies and fills by name (a graph's kernels included), then the first calls in the order they
came. A second CUDA context takes turns with the training's on the GPU, so what arrives from the child one by one,
outside a graph, is what its making costs the training beyond the GPU time itself (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from pathlib import Path
from typing import Any


def profiled(loader: Any, device: str, warm: int, batches: int) -> Any:
    """The profiler's events of `batches` batches made on a side stream, after `warm` batches (epochs restarted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

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
    return prof.events()


def tally(events: Any) -> tuple[Counter[str], Counter[str], list[str]]:
    """(runtime calls by name, GPU work by name, the calls' names in the order they came)."""
    from torch.autograd import DeviceType

    calls: Counter[str] = Counter()
    work: Counter[str] = Counter()
    order = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.device_type == DeviceType.CUDA:
            work[e.name[:72]] += 1
        elif e.name.startswith("cuda") or e.name.startswith("cu"):
            calls[e.name] += 1
            order.append(e.name)
    return calls, work, order


def main(argv: list[str] | None = None) -> int:
    from workflows.bench.profile_train import _options
    from workflows.bench.tail_bound import feeder_like
    from workflows.bench.train import DEFAULTS
    from workflows.bench.train_loop import build_data

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seg-aug", choices=sorted(DEFAULTS))
    parser.add_argument("--warm", type=int, default=14, help="batches made before the profiled ones")
    parser.add_argument("--batches", type=int, default=8, help="batches profiled")
    parser.add_argument("--first", type=int, default=40, help="calls listed in the order they came")
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
        calls, work, order = tally(profiled(loader, a.device, a.warm, a.batches))
    finally:
        loader.close()
    n = a.batches
    print(f"{a.workload}: one batch made as the feeder's child makes it, {n} batches after {a.warm}, {a.device}")
    print(f"runtime calls a batch: {sum(calls.values()) / n:.1f}")
    for name, k in calls.most_common():
        print(f"  {k / n:8.1f}  {name}")
    print(f"GPU work a batch: {sum(work.values()) / n:.1f}")
    for name, k in work.most_common(30):
        print(f"  {k / n:8.1f}  {name}")
    print(f"the first {min(a.first, len(order))} calls in order: {', '.join(order[: a.first])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
