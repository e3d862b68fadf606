"""The drop-in against what it replaces: PreparedPersistentDataset vs MONAI PersistentDataset, same data,
same pipeline, same loader, no training (only delivery of tail-transformed items is timed).

    python -m workflows.benchmark dropin --size 128 --crop 64 --count 32 --workers 8 --reps 3

Rows for DataLoader(W worker processes) and ThreadDataLoader(W threads), with track_meta False (both
classes' default) and True. Each row runs one untimed epoch (fills PersistentDataset's cache and the page
cache), then `reps` timed epochs; the row is the median epoch. `cpu ms/item` (in the note) counts this
process and its finished worker processes: on a shared machine it is steadier than wall time.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from workflows.bench import scenario
from workflows.bench.core import Options, Result, Rows
from workflows.bench.train_cold import ColdEpochs
from workflows.bench.train_loop import TrainOptions, build_data, transform_of


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _loader(dataset: Any, batch: int, workers: int, threads: bool) -> Any:
    from monai.data import DataLoader, ThreadDataLoader

    if threads:
        return ThreadDataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, use_thread_workers=True)
    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)


def _epoch(loader: Any) -> tuple[int, int, float, float]:
    """(items, bytes, seconds, cpu seconds) of one pass; worker processes are joined before the clock stops."""
    from workflows.bench.core import nbytes_of

    t0, c0 = time.perf_counter(), _cpu_s()
    items = nbytes = 0
    for batch in loader:
        items += len(batch["image"])
        nbytes += nbytes_of({k: batch[k] for k in ("image", "label")})
    del loader  # the iterator's workers exit with it: their CPU time is then counted
    return items, nbytes, time.perf_counter() - t0, _cpu_s() - c0


def _row(
    name: str, data: str, kind: str, make: Any, batch: int, workers: int, threads: bool, reps: int,
    cold: ColdEpochs | None = None,
) -> Result:  # fmt: skip
    dataset = make()
    _epoch(_loader(dataset, batch, workers, threads))  # untimed: fills caches (PersistentDataset's files)
    reads = cold.row() if cold is not None else None
    runs = []
    for _ in range(reps):
        if reads is not None:
            reads.begin()
        runs.append(_epoch(_loader(dataset, batch, workers, threads)))
        if reads is not None:
            reads.end(timed=True)
    items, nbytes, seconds, cpu = sorted(runs, key=lambda r: r[2])[len(runs) // 2]
    cpu_note = f"cpu {1e3 * statistics.median(r[3] / r[0] for r in runs):.1f} ms/item"
    if reads is None:
        return Result(name, data, items, seconds, nbytes, kind, f"warm; {cpu_note}")
    read = reads.nbytes[0] / reads.epochs  # the crops are what an epoch delivers (image and label, as cached)
    note = f"cold; read {read / 1e6:.1f} MB/epoch, {read / (sum(r[1] for r in runs) / len(runs)):.2f}x the crops"
    return Result(name, data, items, seconds, nbytes, kind, f"{note}; {cpu_note}")


def _cold(cache: Path, work: Path) -> tuple[str, ColdEpochs]:
    """--cold-epochs: the disk's read rate (a footer line) and what each timed epoch evicts first: the
    run's work folder (sources, prepared cache, the PersistentDataset folders its rows write) and the cache."""
    from loaders.cache.format import PreparedCache
    from workflows.bench.train_cold import disk_rate_line, read_counters

    rate = disk_rate_line(list(PreparedCache(cache).shards))
    folders = [work] if cache.resolve().is_relative_to(work.resolve()) else [work, cache]
    return rate, ColdEpochs.of(folders, read_counters(cache, os.getpid()), 0)


def _persistent_options(track: bool) -> dict[str, Any]:
    """track_meta (and weights_only) for MONAI's PersistentDataset where the installed MONAI has them: MONAI 1.4
    (HPC containers with torch 2.3) has neither and always gives the head's meta back."""
    import inspect

    from monai.data import PersistentDataset

    known = inspect.signature(PersistentDataset).parameters
    return {k: v for k, v in {"track_meta": track, "weights_only": not track}.items() if k in known}


@scenario("dropin", "PreparedPersistentDataset vs PersistentDataset under DataLoader workers and threads.")
def dropin(
    opts: Options,
    size: Annotated[int, typer.Option(help="volume edge in voxels")] = 128,
    crop: Annotated[int, typer.Option(help="random crop edge (RandSpatialCropd)")] = 64,
    count: Annotated[int, typer.Option(min=1, help="volumes in the dataset")] = 32,
    reps: Annotated[int, typer.Option(min=1, help="timed epochs per row (the median is reported)")] = 3,
    cold_epochs: Annotated[
        bool,
        typer.Option(
            help="each timed epoch starts with every file of the run evicted from the page cache; "
            "rows note bytes read per epoch against the crops' bytes, the disk's rate is measured"
        ),
    ] = False,
) -> Rows:
    """`python -m workflows.benchmark dropin` (global --batchsize, --workers: default 2)."""
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset
    from workflows.bench.peers import datalist_items
    from workflows.bench.report import PERSISTENT

    workers = opts.workers or 2
    topts = TrainOptions(size=size, crop=crop, batch=opts.batchsize, workers=workers, count=count, device="cpu")
    datalist, pipeline, cache = build_data(topts, opts.work)
    data = datalist_items(datalist)
    rows = Rows(title=f"{count} volumes of {size}^3, tail: {crop}^3 crop, flip, intensity (CPU)")
    cold = None
    if cold_epochs:
        rate, cold = _cold(Path(cache), Path(opts.work))
        rows.footer.append(rate)
    for threads in (False, True):
        loader = f"ThreadDataLoader({workers} threads)" if threads else f"DataLoader({workers} workers)"
        for track in (False, True):
            data_set = f"{loader}, track_meta={track}"
            peer = f"{PERSISTENT} + {data_set}"
            rows.peers[data_set] = peer
            pt = Path(opts.work) / f"dropin_pt_{size}_{count}_{int(track)}"

            def monai(track: bool = track, pt: Path = pt) -> Any:
                return PersistentDataset(data, transform_of(pipeline, 0), pt, **_persistent_options(track))

            def ours(track: bool = track) -> Any:
                return PreparedPersistentDataset(data, transform_of(pipeline, 0), cache, track_meta=track)

            name = f"blockprep PreparedPersistentDataset + {data_set}"
            for label, kind, make in ((peer, "peer", monai), (name, "ours", ours)):
                job = partial(_row, label, data_set, kind, make, opts.batchsize, workers, threads, reps, cold)
                rows.add(label, job)
    return rows
