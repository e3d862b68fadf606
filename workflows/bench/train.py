"""Training benchmark: steps/s of a real MONAI 3D UNet loop, and how much of each step waits for data.

    python -m workflows.benchmark train --size 160 --crop 96 --batchsize 4 --count 48 --device cuda:0
    torchrun --standalone --nproc-per-node 2 -m workflows.benchmark train --ddp --device cuda  # 2 GPUs

The data is made here (`prep synth nifti` + `prep cache`) with the pipeline LoadImaged, EnsureChannelFirstd,
ScaleIntensityd | RandSpatialCropd(crop), RandFlipd, RandScaleIntensityd. Every row trains a fresh
UNet (channels 16-32-64-128, strides 2, DiceLoss, Adam, bf16 autocast on CUDA) for `epochs` epochs;
the first fills caches and is not timed. Data wait = time in `next(batch)` and the copy to the device,
with the training stream synchronised after every step (as `loss.item()` does) so compute is not counted
as waiting; work a loader queued on its own stream for later batches is not waited for. The rows (each way
of feeding the loop) are in `workflows/bench/train_rows.py`; this module picks and runs them.
"""

from __future__ import annotations

import ast
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from workflows.bench import scenario
from workflows.bench.core import Options, Rows
from workflows.bench.train_cold import ColdEpochs
from workflows.bench.train_loop import TrainOptions, TrainRow, as_result, build_data
from workflows.bench.train_rows import (
    CEILING,
    cache_gpu,
    ceiling,
    data_name,
    drop_in,
    fast_path,
    gds,
    gpu_budget,
    persistent,
    persistent_dir,
    persistent_name,
    smart_cache,
    transport,
    transport_peer,
    transport_tail_meta,
)
from workflows.bench.workloads import NAMES, WORKLOADS

_Job = tuple[str, Callable[[], TrainRow]]  # a row's key (as --rows names it) and what measures it


def run(opts: TrainOptions, work: Path) -> Rows:
    """Every row that applies here, in one run (the ceiling first; `opts.rows` picks the others)."""
    from loaders.fast.loader import dataset_bytes

    datalist, pipeline, cache = build_data(opts, work)
    nbytes = dataset_bytes(cache)
    rate = ""
    if opts.cold_epochs:
        rate, cold = _cold(opts, work, cache)
        opts = replace(opts, cold=cold)
    budget = gpu_budget(opts)
    what = WORKLOADS[opts.workload].describe(opts)
    timed = f"{opts.epochs - 1} timed epochs" + (f" or more ({opts.min_seconds:g} s)" if opts.min_seconds else "")
    rows = Rows(title=f"training {opts.workload}: {what}, batch {opts.batch}, {timed}, items/s = steps/s")
    rows.peers[data_name(opts)] = persistent_name(opts)
    jobs = _jobs(opts, work, datalist, pipeline, cache, budget, nbytes)
    jobs += _variants(opts, pipeline, cache, nbytes // 2)
    _run_rounds(rows, jobs, opts)
    if opts.cold is not None:
        rows.footer += [rate, f"cold epochs: each row's epochs (not the ceiling's) start after {opts.cold.evicted}"
                        f" of the workload's files; bytes read counted by {opts.cold.counters[0].how}"]  # fmt: skip
    return rows


def _cold(opts: TrainOptions, work: Path, cache: Path) -> tuple[str, ColdEpochs]:
    """For --cold-epochs: the disk's read rate (a footer line, or why not) and what every cold epoch
    evicts (the workload's data, prepared cache, PersistentDataset and GDSDataset caches) and counts."""
    from loaders.cache.format import PreparedCache
    from workflows.bench.train_cold import crop_bytes_per_step, disk_rate_line, read_counters

    prepared = PreparedCache(cache)
    rate = disk_rate_line(list(prepared.shards), opts.seed)
    dtypes = {e.key: e.dtype for e in prepared.entries(0)}
    crops = crop_bytes_per_step(WORKLOADS[opts.workload].ceiling(opts), dtypes)
    folders = [cache.parent, persistent_dir(opts, work), work / "gds"]
    return rate, ColdEpochs.of(folders, read_counters(cache, os.getpid()), crops)


def _jobs(
    opts: TrainOptions, work: Path, datalist: Path, pipeline: Path, cache: Path, budget: int, nbytes: int
) -> list[_Job]:
    """Every row of the scenario, by key: the ceiling, MONAI's peers, the drop-in, the transports, the fast path."""
    steps = opts.count // opts.batch
    half = nbytes // 2
    return [
        ("ceiling", lambda: ceiling(opts, steps)),
        ("persistent", lambda: persistent(datalist, pipeline, opts, work)),
        ("cache-gpu", lambda: cache_gpu(datalist, pipeline, opts, budget, nbytes)),
        ("gds", lambda: gds(datalist, pipeline, opts, work)),
        ("smart-cache", lambda: smart_cache(datalist, pipeline, opts)),
        ("drop-in", lambda: drop_in(datalist, pipeline, cache, opts, threads=False)),
        ("drop-in-threads", lambda: drop_in(datalist, pipeline, cache, opts, threads=True)),
        ("transport", lambda: transport(opts)),
        ("transport-tail", lambda: transport(opts, pipeline)),
        ("transport-peer", lambda: transport_peer(datalist, pipeline, opts, work)),
        ("transport-tail-meta", lambda: transport_tail_meta(datalist, pipeline, opts, work)),
        ("fast-auto", lambda: fast_path(pipeline, cache, opts, "auto", "defaults (gpu_budget=auto)")),
        ("fast", lambda: fast_path(pipeline, cache, opts, 0, "no GPU tier (page cache), crop read")),
        ("fast-whole", lambda: fast_path(pipeline, cache, opts, 0, "no GPU tier, whole reads", crop_read=False)),
        ("fast-bricks", lambda: fast_path(pipeline, cache, opts, 0, "no GPU tier, bricks written", bricks=True)),
        ("fast-half", lambda: fast_path(pipeline, cache, opts, half, "GPU tier = half the dataset")),
        ("fast-feeder", lambda: fast_path(pipeline, cache, opts, "auto", "defaults, feeder=True", feeder=True)),
        (
            "fast-serving",
            lambda: fast_path(pipeline, cache, opts, "auto", "defaults, timed once the feeder serves", serving=True),
        ),  # fmt: skip
        (
            "fast-settled",
            lambda: fast_path(pipeline, cache, opts, "auto", "defaults, timed once feeder=auto chose", settled=True),
        ),  # fmt: skip
        ("fast-budget", lambda: fast_path(pipeline, cache, opts, min(budget, nbytes), "GPU tier = --gpu-budget")),
    ]


def _variants(opts: TrainOptions, pipeline: Path, cache: Path, half: int) -> list[_Job]:
    """The fast path's variants --rows asks for, with PreparedLoader options: "fast@tail_thread=False;..."."""
    fast = {
        "fast": (0, "no GPU tier (page cache), crop read"),
        "fast-bricks": (0, "no GPU tier, bricks written"),
        "fast-half": (half, "GPU tier = half the dataset"),
        "fast-auto": ("auto", "defaults (gpu_budget=auto)"),
        "fast-serving": ("auto", "defaults, timed once the feeder serves"),
        "fast-settled": ("auto", "defaults, timed once feeder=auto chose"),
    }
    jobs: list[_Job] = []
    for spec in opts.rows:  # variants of the fast path: "fast@tail_thread=False;switch_interval=0.0005"
        base, _, options = spec.partition("@")
        if options and base in fast:
            budget_b, label = fast[base]
            kw = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in options.split(";"))}
            kw.update(
                {"serving": base == "fast-serving", "settled": base == "fast-settled", "bricks": base == "fast-bricks"}
            )
            jobs.append((spec, lambda b=budget_b, lb=f"{label}, {options}", kw=kw: fast_path(  # type: ignore[misc]
                pipeline, cache, opts, b, lb, **kw)))  # fmt: skip
    return jobs


def _run_rounds(rows: Rows, jobs: list[_Job], opts: TrainOptions) -> None:
    """Run the picked rows `opts.rounds` times with the ceiling again after each round, into `rows`; note
    how the ceiling was kept, and each of our rows against the best MONAI row."""
    picked = [(key, lambda job=job: _measured(job, opts))  # type: ignore[misc]
              for key, job in jobs if not opts.rows or key in opts.rows or key == "ceiling"]  # fmt: skip
    # the ceiling again after the rows of every round, the faster of its two runs kept: the first can find the
    # GPU's clocks still low (docs/benchmarks.md, Training)
    again = [("ceiling-again", dict(picked)["ceiling"])] if WORKLOADS[opts.workload].ceiling(opts) else []
    rows.add_rounds([*picked, *again], opts.rounds, peer=persistent_name(opts), ceiling=CEILING,
                    best_of={"ceiling-again": "ceiling"})  # fmt: skip
    for r in rows.results:
        if r.kind == "ceiling":
            r.note = "best of the first and the last row" + (" of each round" if opts.rounds > 1 else "")
    best = max((r.items_per_s for r in rows.results if r.kind == "peer"), default=0.0)
    for r in rows.results:
        if r.kind == "ours" and best > 0:
            r.extra["x best MONAI"] = r.items_per_s / best


def _measured(job: Callable[[], TrainRow], opts: TrainOptions) -> Any:
    """A row run and turned into a result, with the seconds from its start (building its dataset or loader)
    to its first batch, less the benchmark's own eviction before it (cold epochs) and its setup (bricks written)."""
    t0 = time.perf_counter()
    row = job()
    if row.first_batch_at is not None and row.kind != "ceiling":
        row.extra["first batch s"] = round(row.first_batch_at - t0 - row.evicting_s - row.setup_s, 3)
    return as_result(row, data_name(opts))


# Per workload: (size, crop, batch, count, workers) when the command line does not say (docs/benchmarks.md's GPU runs).
DEFAULTS: dict[str, tuple[int, int, int, int, int]] = {
    "spheres": (160, 96, 4, 48, 8),
    "seg-ct": (200, 96, 2, 24, 8),  # 160-240 voxels a side at 1.4-2.2 mm: 150-300 after the spleen Spacingd
    "seg-multiclass": (144, 112, 2, 16, 8),
    "brats": (144, 112, 2, 16, 8),
    "gds-seed": (250, 200, 1, 12, 0),
    "mednist": (64, 64, 512, 10240, 4),
    "slices": (200, 128, 8, 24, 8),
    "seg-aug": (200, 96, 2, 24, 8),
    "seg-elastic": (200, 96, 2, 24, 8),
}


MIN_SECONDS_GPU = 3.0  # a row's timed steps on a GPU add up to at least this (a spheres epoch: docs/benchmarks.md)


def _min_seconds(given: float | None, device: str) -> float:
    """--min-seconds as given, else MIN_SECONDS_GPU on a CUDA device and 0 on CPU (whose steps take seconds)."""
    if given is not None:
        return given
    return MIN_SECONDS_GPU if device.startswith("cuda") else 0.0


def _spacing(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"--spacing-range {text!r}: give LO,HI in mm, e.g. 1.0,2.0") from None
    if not 0 < lo <= hi:
        raise typer.BadParameter(f"--spacing-range {text!r}: need 0 < LO <= HI")
    return lo, hi


@scenario("train", "Training steps/s and data-wait share on the tutorial workloads, every loader against the ceiling.")
def train(
    opts: Options,
    workload: Annotated[
        str, typer.Option(metavar="NAME", help=f"{', '.join(NAMES)}, a comma-separated list, or all")
    ] = "spheres",
    size: Annotated[int | None, typer.Option(help="volume (image) edge in voxels; default per workload")] = None,
    crop: Annotated[int | None, typer.Option(help="crop edge of the tail's crop; default per workload")] = None,
    epochs: Annotated[int, typer.Option(min=2, help="epochs per row; the first fills caches, untimed")] = 4,
    count: Annotated[
        int | None, typer.Option(min=1, help="volumes (images) in the dataset; default per workload")
    ] = None,
    gpu_budget: Annotated[str | None, typer.Option(help="bytes GPU-resident rows may hold, e.g. 8GiB")] = None,
    channels: Annotated[str, typer.Option(help="UNet channels per level (spheres), comma-separated")] = "16,32,64,128",
    rows: Annotated[
        str,
        typer.Option(
            help="only these rows, comma-separated (the ceiling always runs): "
            "persistent,cache-gpu,gds,smart-cache,drop-in,drop-in-threads,transport,transport-tail,transport-peer,"
            "transport-tail-meta,"
            "fast-auto,fast,fast-whole,fast-bricks,"
            "fast-half,fast-budget,fast-feeder,fast-serving,fast-settled; fast, fast-bricks, fast-auto, fast-half, "
            "fast-serving or fast-settled "
            "with PreparedLoader options: fast@tail_thread=False;switch_interval=0.0005"
        ),
    ] = "",
    ddp: Annotated[bool, typer.Option(help="under torchrun: the fast path over every rank's GPU")] = False,
    rounds: Annotated[
        int, typer.Option(min=1, help="every row N times, interleaved; rows are medians, ratios per round")
    ] = 1,
    min_seconds: Annotated[
        float | None,
        typer.Option(min=0, help="more epochs until a row's timed steps add up to this; default 3 on a GPU, 0 on CPU"),
    ] = None,
    shape_range: Annotated[
        float | None, typer.Option(help="volumes' edges vary by +- this fraction (NIfTI workloads); default own")
    ] = None,
    spacing_range: Annotated[
        str | None, typer.Option(metavar="LO,HI", help="voxel spacings in mm drawn from LO-HI; default own")
    ] = None,
    cores: Annotated[
        int | None,
        typer.Option(min=1, help="pin the benchmark and its workers to N cores, as a SLURM job's --cpus-per-task"),
    ] = None,
    cold_epochs: Annotated[
        bool,
        typer.Option(
            help="every epoch of a row starts with the workload's files evicted from the page cache; rows "
            "note bytes read per epoch against the crops' bytes, the disk's rate is measured too"
        ),
    ] = False,
) -> Rows:
    """`python -m workflows.benchmark train --workload all --device cuda:0` (global --batchsize is the batch,
    --workers the DataLoader workers of the peers; left at 4 and 0 they are the workload's own)."""
    names = _workloads(workload)
    if cold_epochs and ddp:
        raise typer.BadParameter("--cold-epochs times one GPU's rows; it does not apply to --ddp")
    if cores is not None:
        pin_cores(cores)
    given = TrainOptions(epochs=epochs, device=opts.device, gpu_budget=gpu_budget,
                         channels=tuple(int(c) for c in channels.split(",")), out=opts.out or Path("bench_out"),
                         rows=tuple(r for r in rows.split(",") if r), shape_range=shape_range,
                         spacing_range=_spacing(spacing_range), rounds=rounds,
                         min_seconds=_min_seconds(min_seconds, opts.device), cold_epochs=cold_epochs)  # fmt: skip
    return _each_workload(names, given, opts, (size, crop, count), ddp)


def _each_workload(
    names: list[str], given: TrainOptions, opts: Options, sizes: tuple[int | None, ...], ddp: bool
) -> Rows:
    """The rows of every workload named, one table (the DDP row: the first workload's, under torchrun)."""
    out = Rows()
    for name in names:
        topts = _for_workload(given, name, opts, *sizes)
        if ddp:
            from workflows.bench.train_ddp import main_ddp

            return main_ddp(topts)
        print(f"workload {name}:", flush=True)
        got = run(topts, opts.work)
        out.extend(got)
        out.title = got.title if len(names) == 1 else f"training, workloads {', '.join(names)}"
    return out


def pin_cores(n: int) -> None:
    """This process (and what it starts after: DataLoader workers, a feeder's child) on the first `n` cores it
    may use, torch's threads to match: what a SLURM job with `--cpus-per-task=n` sees."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        raise typer.BadParameter(f"--cores {n}: this process may use {len(allowed)} cores")
    os.sched_setaffinity(0, allowed[:n])
    torch.set_num_threads(n)
    print(f"pinned to cores {allowed[:n]}", flush=True)


def _workloads(workload: str) -> list[str]:
    """The workloads --workload names (a comma-separated list, or all); BadParameter for an unknown one."""
    names = list(NAMES) if workload == "all" else [w for w in workload.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise typer.BadParameter(f"unknown workload {unknown or workload!r}; choose from {', '.join(NAMES)} or all")
    return names


def _for_workload(
    given: TrainOptions, name: str, opts: Options, size: int | None, crop: int | None, count: int | None
) -> TrainOptions:
    """The command line's options for workload `name`: size, crop, count, batch and workers the workload's own
    (DEFAULTS) where the command line leaves them; BadParameter for a crop larger than the volume."""
    d_size, d_crop, d_batch, d_count, d_workers = DEFAULTS[name]
    batch = opts.batchsize if opts.batchsize != Options().batchsize else d_batch  # 4, the global default
    topts = replace(given, size=size or d_size, crop=crop or d_crop, batch=batch, workers=opts.workers or d_workers,
                    count=count or d_count, workload=name)  # fmt: skip
    if name == "mednist":  # 2D classification: no crop
        topts.crop = topts.size
    if topts.crop > topts.size * 1.4 or topts.count < topts.batch:
        raise typer.BadParameter(f"{name}: need --crop <= --size and --count >= the batch size")
    return topts
