"""The training benchmark's loop, shared by its rows (`workflows/bench/train.py`) and its DDP row
(`workflows/bench/train_ddp.py`): options, the data made for a workload, the training step, the timed loop
and its row."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loaders.cache.writing import atomic_write_bytes
from workflows.bench.core import Result, Unavailable
from workflows.bench.workloads import WORKLOADS, model_and_loss

if TYPE_CHECKING:
    from workflows.bench.train_cold import ColdEpochs

__all__ = ["TrainOptions", "TrainRow", "as_result", "build_data", "make_step", "pipeline_source", "time_loop",
           "transform_of"]  # fmt: skip


@dataclass
class TrainOptions:
    """What one training benchmark run uses."""

    size: int = 160
    crop: int = 96
    batch: int = 4
    epochs: int = 4
    workers: int = 8
    device: str = "cuda:0"
    count: int = 48
    gpu_budget: str | None = None  # caps GPU-resident peers; None: the device's free memory
    channels: tuple[int, ...] = (16, 32, 64, 128)
    out: Path = Path("bench_out")
    seed: int = 0
    rows: tuple[str, ...] = ()  # only these rows (names as in ROWS); empty: all
    workload: str = "spheres"  # a name of workflows.bench.workloads.WORKLOADS
    shape_range: float | None = None  # volumes' edges vary by +-this fraction; None: the workload's own
    spacing_range: tuple[float, float] | None = None  # voxel spacings in mm drawn from this range; None: own
    rounds: int = 1  # every row this many times, interleaved; a row is its median round
    min_seconds: float = 0.0  # epochs after `epochs` run until the timed steps add up to this many seconds
    cold_epochs: bool = False  # every epoch of a row (but the ceiling's) starts with the workload's files evicted
    cold: ColdEpochs | None = None  # what a cold epoch evicts and counts (set by `train.run` from `cold_epochs`)

    @property
    def gpu(self) -> bool:
        """True when training on a CUDA device."""
        return self.device.startswith("cuda")


@dataclass
class TrainRow:
    """One way of feeding the loop: what it measured."""

    name: str
    kind: str  # "ceiling", "peer", "ours"
    steps: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU (every thread; not worker processes) over the timed steps' spans
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    first_batch_at: float | None = None  # time.perf_counter() when the first batch reached the loop
    evicting_s: float = 0.0  # seconds the benchmark spent evicting (cold epochs) before the first batch: not the row's
    setup_s: float = 0.0  # seconds the benchmark spent writing what the row reads (its bricks) before it began
    spans: list[float] = field(default_factory=list)  # each timed step's seconds, its wait included
    epoch_waits: list[float] = field(default_factory=list)  # each timed epoch's wait for its first batch

    @property
    def steps_per_s(self) -> float:
        """Timed steps per second."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """Share of step time blocked on the next batch (0..1)."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0


def pipeline_source(crop: int) -> str:
    """PIPELINE.py text of the spheres workload with a `crop`^3 random crop."""
    return WORKLOADS["spheres"].pipeline(TrainOptions(crop=crop))


def build_data(opts: TrainOptions, work: Path) -> tuple[Path, Path, Path]:
    """(datalist, pipeline, cache): the workload's synthetic data and its prepared cache, reused when present."""
    from prep.cache import prepare_cache

    load = WORKLOADS[opts.workload]
    tag = "" if opts.workload == "spheres" else f"{opts.workload}_"
    vary = f"_r{opts.shape_range}_mm{opts.spacing_range}" if opts.shape_range or opts.spacing_range else ""
    root = work / f"train_{tag}{opts.count}x{opts.size}_crop{opts.crop}{vary}".replace(" ", "")
    root.mkdir(parents=True, exist_ok=True)
    pipeline = root / "pipeline.py"
    text = load.pipeline(opts)
    if not pipeline.is_file() or pipeline.read_text() != text:  # DDP ranks call this at once: never truncate
        atomic_write_bytes(pipeline, text.encode())  # a file another rank may be loading
    datalist = root / "nifti" / "dataset.json"
    if not datalist.is_file():
        load.data(opts, root / "nifti")
    cache = root / "cache"
    if not (cache / "manifest.json").is_file():
        prepare_cache(datalist, pipeline, cache, workers=max(1, min(opts.workers, os.cpu_count() or 1)))
    return datalist, pipeline, cache


def transform_of(pipeline: Path, seed: int) -> Any:
    """A fresh full transform from PIPELINE.py, its random tail seeded."""
    from prep.pipeline import load_pipeline

    transform = load_pipeline(pipeline).transform
    transform.set_random_state(seed=seed)
    return transform


def make_step(opts: TrainOptions, device: str, ddp: bool = False) -> Callable[[Any, Any], float]:
    """One training step (forward, the workload's loss, backward, Adam) of a fresh model; returns nothing to
    sync on. The loading-only workload (gds-seed) has no model: its step does nothing."""
    import torch

    torch.manual_seed(opts.seed)
    model, loss_fn = model_and_loss(WORKLOADS[opts.workload].model, opts)
    if model is None:
        return lambda image, label: 0.0
    model = model.to(device)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if opts.gpu else None)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    cuda = device.startswith("cuda")

    def step(image: Any, label: Any) -> float:
        optimiser.zero_grad(set_to_none=True)
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(image), label)
        loss.backward()
        optimiser.step()
        return 0.0

    return step


def on_device(x: Any, device: str) -> Any:
    """A batch entry (MetaTensor or tensor, a class label on the CPU) as a plain tensor on `device`."""
    x = x.as_tensor() if hasattr(x, "as_tensor") else x
    return x.to(device, non_blocking=True)


SETTLE_S = 300.0  # a row timed once its loader settled waits at most this long (then is timed as it is)


def time_loop(name: str, kind: str, epochs: Callable[[int], Iterable[Any]], opts: TrainOptions,
              device: str | None = None, ddp: bool = False, note: str = "",
              settled: Callable[[], bool] | None = None) -> TrainRow:  # fmt: skip
    """Train `opts.epochs` epochs over `epochs(e)`, and more until the timed steps add up to `opts.min_seconds`
    (a `spheres` epoch on a GPU takes hundredths of a second, too short a window to time: docs/benchmarks.md,
    Training); time every epoch after the first. `settled`: epochs before it says True (at an epoch's start,
    within SETTLE_S) are trained untimed too: a long run's steady state. With `opts.cold`, every epoch starts
    with the workload's files evicted, before the epoch is requested (a loader's workers read ahead once it
    is), and the row notes the bytes read per timed epoch."""
    import torch

    device = device or opts.device
    step = make_step(opts, device, ddp)
    # the training stream, as loss.item() syncs it; a loader's own stream (batches ahead) is not waited for
    sync = (lambda: torch.cuda.current_stream(device).synchronize()) if device.startswith("cuda") else (lambda: None)
    row = TrainRow(name, kind, note=note)
    reads = opts.cold.row() if opts.cold is not None and kind != "ceiling" else None  # the ceiling reads nothing
    epoch, untimed, t_start = 0, 1, time.perf_counter()
    while epoch < opts.epochs + untimed - 1 or (row.steps and row.seconds < opts.min_seconds):  # none: stop
        if epoch >= untimed and settled is not None and not settled() and time.perf_counter() - t_start < SETTLE_S:
            untimed += 1
        if reads is not None:
            t_evict = time.perf_counter()
            reads.begin()
            if row.first_batch_at is None:
                row.evicting_s += time.perf_counter() - t_evict
        source = epochs(epoch)
        expected = len(source) if hasattr(source, "__len__") else None  # type: ignore[arg-type]
        batches, seen = iter(source), 0
        while True:
            t0, cpu0 = time.perf_counter(), time.process_time()
            batch = next(batches, None)
            if batch is None:
                break
            if row.first_batch_at is None:
                row.first_batch_at = time.perf_counter()
            seen += 1
            image, label = on_device(batch["image"], device), on_device(batch["label"], device)
            sync()
            t1 = time.perf_counter()
            step(image, label)
            sync()
            if epoch >= untimed:  # CPU over the same spans as the time: a tiny run's epoch end is not a step
                row.steps += 1
                row.wait_seconds += t1 - t0
                row.spans.append(time.perf_counter() - t0)
                row.seconds += row.spans[-1]
                if seen == 1:
                    row.epoch_waits.append(t1 - t0)
                row.cpu_seconds += time.process_time() - cpu0
        if expected is not None and seen < expected:  # a loader thread died: its error was printed above
            raise Unavailable(f"{name}: the loader stopped after {seen} of {expected} batches in epoch {epoch + 1}")
        if reads is not None:
            reads.end(timed=epoch >= untimed)
        epoch += 1
    if row.steps == 0:
        raise Unavailable(f"{name}: no timed steps (need --epochs >= 2 and count >= batch)")
    row.extra.update(reads.fields(row.steps) if reads is not None else {})
    return row


def as_result(row: TrainRow, data: str = "train") -> Result:
    """A harness row: items = timed steps (items/s is steps/s); the wait share goes with it."""
    cpu = 100 * row.cpu_seconds / row.seconds if row.seconds > 0 else 0.0
    extra = {"waiting %": 100 * row.wait_share, "process CPU % of a core": round(cpu), **row.extra}
    if row.spans and row.kind != "ceiling":  # where the mean step is longer than the median: stalls, or epochs' starts
        extra["median step ms"] = round(1000 * statistics.median(row.spans), 1)
        extra["epoch's first batch waited ms"] = round(1000 * statistics.mean(row.epoch_waits), 1)
    return Result(row.name, data, row.steps, row.seconds, 0, row.kind, row.note, extra)
