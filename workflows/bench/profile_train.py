"""Where a training step's GPU time goes with PreparedLoader's defaults: torch.profiler's top entries.

    python -m workflows.bench.profile_train --workload seg-ct --steps 12 --device cuda:0
    python -m workflows.bench.profile_train --workload slices --first-batch --device cuda:0
    python -m workflows.bench.profile_train --workload seg-aug --phases --steps 60 --device cuda:0

Builds (or reuses) the training benchmark's data and cache for the workload, runs one warm epoch, then profiles
`--steps` training steps and prints the table sorted by device time (CPU time on a CPU run).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from workflows.bench.train import DEFAULTS
from workflows.bench.train_loop import TrainOptions, build_data, make_step, on_device, transform_of


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seg-ct", choices=sorted(DEFAULTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--work", type=Path, default=Path("bench_out/work"))
    parser.add_argument("--rows", type=int, default=25, help="table rows")
    parser.add_argument("--count", type=int, default=None, help="items (default: the workload's)")
    parser.add_argument("--size", type=int, default=None, help="volume (image) edge (default: the workload's)")
    parser.add_argument("--crop", type=int, default=None, help="crop edge (default: the workload's)")
    parser.add_argument(
        "--loader-only", action="store_true", help="no model: cProfile the loader with its tail on this thread"
    )
    parser.add_argument(
        "--first-batch", action="store_true", help="no model: where building the loader and its first batch go"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="per step: both CUDA streams' kernels, with the loader and without"
    )
    parser.add_argument(
        "--syncs", action="store_true", help="--loader-only on CUDA: where the loader waits for the GPU, by call site"
    )
    parser.add_argument(
        "--ops", action="store_true", help="--loader-only: the tail's ops and device kernels a batch, by transform"
    )
    parser.add_argument("--phases", action="store_true", help="the host's phases of a step: fed, in process, resident")
    parser.add_argument(
        "--unaugmented", action="store_true", help="--phases: the chain without its random transforms after the crop"
    )
    parser.add_argument(
        "--feeder",
        choices=["auto", "True", "False"],
        action="append",
        help="--first-batch: this feeder setting (repeat for several, in one process); default auto and False. "
        "--phases: the rows' feeders (default True and False). "
        "--timeline: the loader's feeder (default False: one trace holds both streams; else the training "
        "process's kernels beside the feeder's process)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.loader_only:
        return _loader_only(a)
    if a.timeline:
        return _timeline(a)
    if a.phases:
        return _phases(a)
    if a.first_batch:
        return _first_batch(a)
    return _profiled(a)


def _feeder(text: str) -> bool | str:
    """A --feeder value as PreparedLoader takes it."""
    return {"True": True, "False": False}.get(text, text)


def _first_batch(a: argparse.Namespace) -> int:
    from workflows.bench.first_batch import first_batch

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    feeders = [_feeder(f) for f in a.feeder or ()]
    return first_batch(cache, lambda: transform_of(pipeline, 0), opts.batch, a.device, a.rows, feeders)


def _profiled(a: argparse.Namespace) -> int:
    """torch.profiler's top entries over `--steps` training steps with the defaults' batches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loaders.fast.loader import PreparedLoader

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    loader = PreparedLoader(cache, transform_of(pipeline, 0), opts.batch, device=a.device, seed=0)
    loader.set_random_state(0)
    step = make_step(opts, a.device)
    for b in loader:  # warm: the tier fills, kernels compile
        step(on_device(b["image"], a.device), on_device(b["label"], a.device))
    gpu = a.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    done = 0
    with profile(activities=activities) as prof:
        while done < a.steps:
            for b in loader:
                step(on_device(b["image"], a.device), on_device(b["label"], a.device))
                if gpu:
                    torch.cuda.synchronize()
                done += 1
                if done >= a.steps:
                    break
    key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    print(f"{a.workload}: {done} steps, PreparedLoader defaults, {a.device}")
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows))
    loader.close()
    return 0


def _timeline(a: argparse.Namespace) -> int:
    """`--steps` steps with the loader's batches (in this process, or with `--feeder` from the feeder's), then as
    many on one resident batch: where each step's time goes (`workflows.bench.timeline`)."""
    from loaders.fast.loader import PreparedLoader
    from workflows.bench.phases import endless
    from workflows.bench.timeline import print_rows, step_times, traced

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    feeder = _feeder((a.feeder or ["False"])[0])
    loader = PreparedLoader(cache, transform_of(pipeline, 0), opts.batch, device=a.device, seed=0, feeder=feeder)
    loader.wait_feeder()  # the feeder's batches, not this process's while it starts
    step = make_step(opts, a.device)

    feed = endless(loader, a.device)
    for _ in range(max(a.steps, len(loader))):  # warm: the tier fills, kernels compile
        step(*next(feed))
    resident = next(feed)

    def same() -> Any:
        while True:
            yield resident

    rows = {"with the loader": step_times(traced(feed, step, a.device, a.steps))}
    rows["compute only"] = step_times(traced(same(), step, a.device, a.steps))
    pid = loader.feeder_pid
    fed = f" (batches made by process {pid})" if pid else " (batches made in this process)"
    print(f"{a.workload}: {a.steps} training steps, {a.device}, feeder={feeder}{fed}")
    print_rows(rows)
    loader.close()
    return 0


def _phases(a: argparse.Namespace) -> int:
    """`workflows.bench.phases`: the feeder's batches, then this process's, each between resident batches."""
    from loaders.fast.loader import PreparedLoader
    from workflows.bench.phases import phases
    from workflows.bench.train_rows import unaugmented

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)

    def build(feeder: bool | str) -> Any:
        chain = transform_of(pipeline, 0)
        chain = unaugmented(chain) if a.unaugmented else chain
        return lambda: PreparedLoader(cache, chain, opts.batch, device=a.device, seed=0, feeder=feeder)

    print(f"{a.workload}{' unaugmented' if a.unaugmented else ''}: {a.steps} training steps a row, {a.device}")
    rows = {f"feeder={f}": build(_feeder(f)) for f in a.feeder or ("True", "False")}
    phases(rows, make_step(opts, a.device), a.device, a.steps)
    return 0


def _options(a: argparse.Namespace) -> TrainOptions:
    size, crop, batch, count, workers = DEFAULTS[a.workload]
    size, count = a.size or size, a.count or count
    crop = size if a.workload == "mednist" else min(a.crop or crop, size)
    return TrainOptions(size, crop, min(batch, count), 2, workers, a.device, count, workload=a.workload)


def _loader_only(a: argparse.Namespace) -> int:
    """Batches/s of the loader alone, and cProfile's top entries with the tail run by the calling thread
    (`tail_thread=False`): where the loader's own CPU time goes, transform by transform."""
    import contextlib
    import cProfile
    import pstats
    import time

    import torch

    from loaders.fast.loader import PreparedLoader

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    gpu = a.device.startswith("cuda")
    for tail_thread in (True, False):
        loader = PreparedLoader(
            cache, transform_of(pipeline, 0), opts.batch, device=a.device, seed=0, tail_thread=tail_thread, feeder=False
        )
        loader.set_random_state(0)
        for _ in loader:  # warm: the tier fills
            pass
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        with prof if not tail_thread else contextlib.nullcontext():
            n = _take(loader, a.steps, (lambda b: b["image"].sum().item()) if gpu else None)
        dt = time.perf_counter() - t0
        print(f"{a.workload}: loader alone, tail_thread={tail_thread}: {n / dt:.2f} batches/s")
        if not tail_thread and gpu and a.syncs:
            _print_syncs(loader, a.steps, a.rows)
        if not tail_thread and a.ops:
            _print_ops(loader, a.steps)
        if not tail_thread:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(a.rows)
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.rows)
        loader.close()
        torch.cuda.synchronize() if gpu else None
    return 0


def _take(loader: Any, steps: int, each: Any = None) -> int:
    """`steps` batches of the loader, over as many epochs as that takes (`each` called on every batch)."""
    n = 0
    while n < steps:
        for batch in loader:
            each(batch) if each is not None else None
            n += 1
            if n >= steps:
                break
    return n


def _print_syncs(loader: Any, steps: int, rows: int) -> None:
    """Each call that makes the host wait for the GPU while the loader makes `steps` batches (torch's sync
    debug mode: a `.item()`, a `float()` of a device tensor, a copy from pageable memory), by its three innermost
    frames outside torch, with counts. A loader running ahead of training stalls at each one until the steps
    queued before it are done."""
    import collections
    import traceback
    import warnings

    import torch

    seen: collections.Counter[str] = collections.Counter()

    def note(message: Any, *_: Any, **__: Any) -> None:
        if "synchroniz" not in str(message):
            return
        outside = ("site-packages/torch/", "/warnings")
        frames = [f for f in traceback.extract_stack()[:-1] if not any(w in f.filename for w in outside)]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            n = _take(loader, steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"waits for the GPU in {n} batches: {sum(seen.values())}")
    for where, count in seen.most_common(rows):
        print(f"{count:6d}  {where}")
    _print_device_time(loader, steps, rows)


def _print_ops(loader: Any, steps: int) -> None:
    """The tail's work a batch by transform, under torch's profiler: the aten ops each transform runs (views and
    the ops inside other ops too) and the kernels they launch on the device. A second CUDA context (the feeder's
    child) costs the training step by the kernel: each one is a turn on the GPU (docs/benchmarks.md, Training:
    what a second context costs)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available() and str(loader.device).startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    with profile(activities=activities) as prof:
        n = _take(loader, steps)
        torch.cuda.synchronize() if gpu else None
    ops: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.name.startswith("tail:"):
            inside = list(_descendants(event))
            ops[event.name[5:]] += sum(1 for e in inside if e.name.startswith("aten::"))
            kernels[event.name[5:]] += sum(len(e.kernels) for e in [event, *inside])
    print(f"the tail a batch, by transform ({n} batches; kernels: launched on the device)")
    print(f"{'transform':<28} {'ops':>8} {'kernels':>8}")
    for name, count in ops.most_common():
        print(f"{name:<28} {count / max(1, n):>8.1f} {kernels[name] / max(1, n):>8.1f}")
    print(f"{'all':<28} {sum(ops.values()) / max(1, n):>8.1f} {sum(kernels.values()) / max(1, n):>8.1f}")
    if gpu:  # the kernels the loader launches outside its tail too (the reads' and the batch's assembly)
        launched = [k for e in prof.events() for k in e.kernels]
        took = sum(k.duration for k in launched) / 1e3
        print(f"the loader's kernels a batch, all: {len(launched) / max(1, n):.1f} ({took / max(1, n):.2f} ms)")


def _descendants(event: Any) -> Any:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def _print_device_time(loader: Any, steps: int, rows: int) -> None:
    """The GPU time the loader's own kernels take a batch (time the training's kernels cannot have)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = _take(loader, steps)
        torch.cuda.synchronize()
    table = prof.key_averages()
    total = sum(e.self_device_time_total for e in table) / 1e3
    print(f"the loader's GPU time: {total / max(1, n):.2f} ms a batch ({n} batches)")
    print(table.table(sort_by="self_cuda_time_total", row_limit=rows))


if __name__ == "__main__":
    raise SystemExit(main())
