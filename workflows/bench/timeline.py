"""Where a training step's time goes beside the loader: both CUDA streams' kernels from a torch.profiler trace.

    python -m workflows.bench.profile_train --workload seg-aug --timeline --steps 24 --device cuda:0

The steps run as the training benchmark runs them (the batch taken, the training stream synced, the step, synced
again), first with the loader's batches (in this process: `feeder=False`, so one trace holds both streams), then
on one batch kept on the device (the compute-only ceiling). Per step it prints the mean of: the step's window
(launch to sync), the training stream's kernel time within it, its span (first kernel's start to last kernel's
end), the time before its first kernel (launch latency), the other streams' kernel time (the loader's), the GPU
idle within the window, and the time between windows (taking the batch). A step longer beside the loader with the
same kernel time is the host (launches late); with more kernel time, the GPU shared.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP = "blockprep-train-step"
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class StepTimes:
    """Means per step, in ms."""

    steps: int
    window: float
    training_kernels: float
    training_span: float
    launch_gap: float
    other_kernels: float
    idle: float
    between: float


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_times(trace: dict[str, Any]) -> StepTimes | None:
    """The per-step means of a chrome trace whose steps are marked with STEP; None without steps or kernels.
    The training stream is the one with the most kernel time."""
    events = trace.get("traceEvents", [])
    windows = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == STEP and e.get("cat") == "user_annotation"
    )
    gpu = [(e["args"].get("stream"), e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _GPU]
    if not windows or not gpu:
        return None
    busy: dict[Any, float] = {}
    for s, a, b in gpu:
        busy[s] = busy.get(s, 0.0) + b - a
    training = max(busy, key=lambda s: busy[s])
    sums = [0.0] * 6
    for a, b in windows:
        inside = [(s, max(x, a), min(y, b)) for s, x, y in gpu if x < b and y > a]
        mine = [(x, y) for s, x, y in inside if s == training]
        sums[0] += b - a
        sums[1] += _union(mine)
        sums[2] += (max(y for _, y in mine) - min(x for x, _ in mine)) if mine else 0.0
        sums[3] += (min(x for x, _ in mine) - a) if mine else b - a
        sums[4] += _union([(x, y) for s, x, y in inside if s != training])
        sums[5] += (b - a) - _union([(x, y) for _, x, y in inside])
    between = sum(c - b for (_, b), (c, _) in zip(windows, windows[1:]))
    n = len(windows)
    w, k, span, gap, other, idle = (v / n / 1e3 for v in sums)
    return StepTimes(n, w, k, span, gap, other, idle, between / max(1, n - 1) / 1e3)


def traced(batches: Iterator[tuple[Any, Any]], step: Callable[[Any, Any], Any], device: str, n: int) -> dict[str, Any]:
    """n steps as the training benchmark runs them, under torch.profiler (CPU and CUDA); the chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    sync = torch.cuda.current_stream(device).synchronize if cuda else (lambda: None)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(n):
            image, label = next(batches)
            sync()
            with record_function(STEP):
                step(image, label)
                sync()
    return chrome_trace(prof)


def chrome_trace(prof: Any) -> dict[str, Any]:
    """A finished `torch.profiler.profile`'s chrome trace, as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return dict(json.loads(path.read_text()))


def print_rows(rows: dict[str, StepTimes | None]) -> None:
    print("per step, ms:  window  training kernels  training span  launch gap  loader kernels  GPU idle  between")
    for name, t in rows.items():
        if t is None:
            print(f"{name}: no CUDA kernels traced")
            continue
        print(
            f"{name} ({t.steps} steps): {t.window:.2f}  {t.training_kernels:.2f}  {t.training_span:.2f}  "
            f"{t.launch_gap:.2f}  {t.other_kernels:.2f}  {t.idle:.2f}  {t.between:.2f}"
        )
