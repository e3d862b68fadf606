"""What one thread beside a training loop costs its steps, by what the thread does.

    python -m workflows.bench.interference --workload seg-aug --device cuda:0

The workload's training step on one resident batch (the compute-only ceiling), timed as the training benchmark
times it (synced before and after), with a second thread doing one thing in a loop, as a loader's tail thread
does it in pieces: nothing; pure Python (holding the interpreter lock between forced switches); numpy work (the
lock released); small kernels on a side stream, the host never waiting for them, or waiting for the stream after
each, or reading each back (a `float()` of a device scalar, as MONAI's transforms do several times a batch); a
small host tensor copied to the device from pageable memory (as `torch.tensor(..., device=...)` does). With
`--processes`, a second process on the same GPU instead (a CUDA context of its own, as the feeder's child): idle,
or every 25 ms 200 small kernels, one by one with host work between (or with the host waiting for them 17 times
in the 200, as a tail that reads values back; or launched back to back, no host work between), or the same as
one CUDA graph; or that graph replayed at each step's start, when the training process says so (as a feeder
would launch a batch's work when the training takes a batch, the training's GPU idle then); or a process that
touches no GPU and keeps one core busy with Python (`process-busy`, on the CPU too: what another busy core of the
box costs a step bound by one core, its clock or its caches, without any GPU work). `--handover-ms X`
adds X ms of host work at each step's start, every row alike (taking a batch from a feeder: 0.8 ms on an H200).
Printed: ms a step, x the step alone, and the thread's loops a second.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORK = ("none", "python", "numpy", "kernels", "kernels-stream-sync", "kernels-read-back", "pageable-copies")
# a second process on the same GPU (a CUDA context of its own, as the feeder's child): idle; every period its
# small kernels one by one with host work between (as a per-item tail launches them); the same kernels as one
# CUDA graph (back to back, no gaps); the gapped kernels with the host waiting for its stream WAITS times a period
# (as a tail that reads values back does: a `float()`, an `.item()`, a copy to numpy); the kernels launched one by
# one with no host work between (a burst of launches, no graph); the graph replayed at each step's start, when told
PROCESS_WORK = (
    "process-busy",
    "process-idle",
    "process-gapped",
    "process-waits",
    "process-burst",
    "process-graph",
    "process-graph-at-steps",
)
PERIOD_S, KERNELS, GAP_S = 0.025, 200, 0.00005  # a batch's tail every 25 ms: 200 kernels, 50 us of host between
WAITS = 17  # seg-aug's waits a batch (docs/benchmarks.md, Training: where the loader waits for the GPU)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _process_loop(kind: str, device: str, ready: Any, stop: Any, go: Any) -> None:
    """The second process: `kind`'s work once a period until `stop` (at each `go`, for process-graph-at-steps)."""
    if kind == "process-busy":  # no CUDA context: one core kept busy, nothing else
        ready.set()
        while not stop.is_set():
            sum(i * i for i in range(20_000))
        return
    import torch

    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device=device)
    x = torch.ones(96, 96, 96, device=device)
    y = torch.empty_like(x)

    every = KERNELS // WAITS if kind == "process-waits" else 0

    def kernels() -> None:
        for i in range(KERNELS):
            torch.mul(x, 1.0001, out=y)
            if kind in ("process-gapped", "process-waits"):
                _busy(GAP_S)
            if every and (i + 1) % every == 0:
                stream.synchronize()

    graph = None
    with torch.cuda.stream(stream):
        kernels()
        stream.synchronize()
        if kind.startswith("process-graph"):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                kernels()
    ready.set()
    while not stop.is_set():
        if kind == "process-graph-at-steps":
            if go.wait(0.1):
                go.clear()
                with torch.cuda.stream(stream):
                    graph.replay()  # type: ignore[union-attr]
                stream.synchronize()
            continue
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            if kind in ("process-gapped", "process-waits", "process-burst"):
                kernels()
            elif graph is not None:
                graph.replay()
        stream.synchronize()
        time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - t0)))


def beside_process(kind: str, step: Callable[[], Any], sync: Callable[[], None], n: int, device: str,
                   handover_s: float = 0.0) -> float:  # fmt: skip
    """ms a step with a second process doing `kind` on the same GPU (`handover_s` of host work at each step's
    start, after telling the process to go where it waits to be told)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, stop, go = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_process_loop, args=(kind, device, ready, stop, go), daemon=True)
    proc.start()
    told = go.set if kind == "process-graph-at-steps" else (lambda: None)
    try:
        if not ready.wait(120):
            raise RuntimeError(f"the {kind} process did not start")

        def started() -> None:
            told()
            _busy(handover_s)

        return timed_steps(step, sync, n, started)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _work(kind: str, device: str) -> Callable[[], None]:
    """One loop of the thread's work."""
    import numpy as np
    import torch

    if kind == "python":
        return lambda: None if sum(i * i for i in range(2000)) < 0 else None
    if kind == "numpy":
        a = np.random.default_rng(0).random(200_000)
        return lambda: None if float(np.sort(a)[0]) < -1 else None
    stream = torch.cuda.Stream(device=device)
    x = torch.ones(64, 64, device=device)

    def kernels(wait: str) -> None:
        with torch.cuda.stream(stream):
            y = (x * 2 + 1).sum()
            if wait == "read-back":
                float(y)  # a copy to pageable memory: the host waits for the stream
            elif wait == "stream-sync":
                stream.synchronize()
            else:
                time.sleep(0.0001)  # the queue bounded without the host waiting for the GPU

    if kind.startswith("kernels"):
        return lambda: kernels(kind.removeprefix("kernels").lstrip("-"))

    def pageable() -> None:
        with torch.cuda.stream(stream):
            torch.tensor([1.0, 2.0, 3.0], device=device)

    return pageable


def timed_steps(step: Callable[[], Any], sync: Callable[[], None], n: int,
                start: Callable[[], Any] | None = None) -> float:  # fmt: skip
    """ms a step over n steps, each synced before and after (`start`: timed too, at each step's start)."""
    total = 0.0
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        if start is not None:
            start()
        step()
        sync()
        total += time.perf_counter() - t0
    return 1e3 * total / n


def beside(kind: str, step: Callable[[], Any], sync: Callable[[], None], n: int, device: str,
           handover_s: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(ms a step, the thread's loops a second) with a thread doing `kind` beside the steps."""
    start = (lambda: _busy(handover_s)) if handover_s else None
    if kind == "none":
        return timed_steps(step, sync, n, start), 0.0
    work, stop, loops = _work(kind, device), threading.Event(), [0]

    def run() -> None:
        while not stop.is_set():
            work()
            loops[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        ms = timed_steps(step, sync, n, start)
    finally:
        stop.set()
        thread.join()
    return ms, loops[0] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from workflows.bench.profile_train import _options
    from workflows.bench.train import DEFAULTS
    from workflows.bench.train_loop import build_data, make_step, on_device, transform_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="seg-aug", choices=sorted(DEFAULTS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--work", type=Path, default=Path("bench_out/work"))
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--crop", type=int, default=None)
    parser.add_argument("--processes", action="store_true", help="also a second process on the GPU")
    parser.add_argument("--kinds", default="", help=f"comma-separated, of {', '.join(WORK + PROCESS_WORK)}")
    parser.add_argument("--handover-ms", type=float, default=0.0, help="host work at each step's start, every row")
    a = parser.parse_args(argv)
    import torch

    from loaders.fast.loader import PreparedLoader

    opts = _options(a)
    _, pipeline, cache = build_data(opts, a.work)
    loader = PreparedLoader(cache, transform_of(pipeline, 0), opts.batch, device=a.device, seed=0, feeder=False)
    b = next(iter(loader))
    image, label = on_device(b["image"], a.device), on_device(b["label"], a.device)
    loader.close()
    train = make_step(opts, a.device)
    cuda = a.device.startswith("cuda")
    sync: Callable[[], Any] = torch.cuda.current_stream(a.device).synchronize if cuda else (lambda: None)
    asked = a.kinds.split(",") if a.kinds else [*WORK, *(PROCESS_WORK if a.processes else ())]
    kinds = [k for k in asked if k in WORK and (cuda or k in ("none", "python", "numpy"))]
    handover = a.handover_ms / 1e3
    timed_steps(lambda: train(image, label), sync, max(4, a.steps // 4))  # warm
    alone = timed_steps(lambda: train(image, label), sync, a.steps, (lambda: _busy(handover)) if handover else None)
    more = f", {a.handover_ms} ms of host work at each step's start" if handover else ""
    print(f"{a.workload}: the training step on one resident batch{more}, {a.steps} steps a row, {a.device}")
    print(f"{'beside it':<22} {'ms a step':>10} {'x alone':>8} {'loops/s':>10}")
    for kind in kinds:
        ms, rate = beside(kind, lambda: train(image, label), sync, a.steps, a.device, handover)
        print(f"{kind:<22} {ms:>10.2f} {ms / alone:>8.2f} {rate:>10.0f}")
    for kind in [k for k in asked if k in PROCESS_WORK and (cuda or k == "process-busy")]:
        ms = beside_process(kind, lambda: train(image, label), sync, a.steps, a.device, handover)
        rate = (
            1e3 / ms
            if kind == "process-graph-at-steps"
            else 0.0
            if kind in ("process-busy", "process-idle")
            else 1 / PERIOD_S
        )
        print(f"{kind:<22} {ms:>10.2f} {ms / alone:>8.2f} {rate:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
