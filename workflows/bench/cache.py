"""`cache`: `prep cache` against MONAI filling the same cache with the same workers, on three workloads, for
1..W workers; `cache-scale`: opening a cache of many tiny items, the per-item overhead of `ds[i]`, the index's
memory.

    python -m workflows.benchmark cache --count 48 --size 96 --images 24000          # W 1,4,8,16 (<= cores)
    python -m workflows.benchmark cache-scale --items 100000

Workloads: `spheres` (`--count` pairs of `--size`^3 NIfTI volumes through `workflows/pipelines/spheres.py`,
the quick start's head: load, channel first, resample to 1 mm, intensity window), `seg-ct` (the training
benchmark's seg-ct: `--count` CT-like volumes ~`--size`^3 whose shapes and spacings differ, through MONAI's
spleen tutorial head: crop foreground, orientation, resample to 1.5x1.5x2 mm) and `mednist` (`--images`
64x64 JPEGs through seed 003's head), from `workflows.bench.workloads`. For each worker count W of
`--scaling` (above this machine's cores: capped), in the same run: MONAI `CacheDataset(num_workers=W)`
(fills its in-memory cache on W threads), `PersistentDataset` iterated once by a `DataLoader(num_workers=W)`
(W forked processes, each item pickled to disk), and `prep cache --workers W` (auto mode unless `--modes`
adds threads/processes; its time includes planning, timing the head on one item, starting its cluster,
the commit and the sampling sets of a label-driven crop). `x peer` compares with the faster MONAI way at
the same W; the curve after the table gives items/s per W and prep / best MONAI. Inputs are read once
beforehand (page cache warm for every contender), and one untimed `prep cache` of one item imports what
it needs and starts the forkserver that forks `prep cache`'s worker processes (prep.processes; a `prep
cache` command starts it once, while it plans), as the MONAI ways find MONAI imported. CPU ms/item counts
this process, its finished children and `prep cache`'s worker processes.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import scenario
from workflows.bench.core import Options, Result, Rows

PIPELINES = Path(__file__).parents[1] / "pipelines"
WORKLOADS = ("spheres", "seg-ct", "mednist")


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (DataLoader workers, `prep cache` worker
    processes): a measure of work that other load barely moves."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _first(batch: list[Any]) -> Any:
    """DataLoader collate that keeps the item as it is (collating is not part of preparing)."""
    return batch[0]


def _entries(datalist: Path) -> list[dict[str, Any]]:
    from prep.cache import load_datalist

    return [entry for _, entry in load_datalist(datalist)]


def persistent(data: str, datalist: Path, pipeline: Path, out: Path, workers: int) -> Result:
    """MONAI PersistentDataset's first pass (runs the head, pickles each item) through a DataLoader with
    `workers` worker processes."""
    from monai.data import DataLoader, PersistentDataset

    from prep.pipeline import load_pipeline

    entries = _entries(datalist)
    out = _fresh(out)
    t0, c0 = time.perf_counter(), cpu_seconds()
    dataset = PersistentDataset(data=entries, transform=load_pipeline(pipeline).head_compose(), cache_dir=out)
    for _ in DataLoader(dataset, batch_size=1, num_workers=workers, collate_fn=_first):
        pass
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    extra = {"CPU ms/item": cpu / len(entries) * 1e3, "disk MB": _tree_bytes(out) / 1e6}
    return Result(f"{data}: PersistentDataset + DataLoader({workers})", data, len(entries), seconds, 0, "peer", "",
                  extra)  # fmt: skip


def cache_dataset(data: str, datalist: Path, pipeline: Path, workers: int) -> Result:
    """MONAI CacheDataset filling its in-memory cache with `workers` threads (its constructor)."""
    from monai.data import CacheDataset

    from prep.pipeline import load_pipeline

    entries = _entries(datalist)
    head = load_pipeline(pipeline).head_compose()
    t0, c0 = time.perf_counter(), cpu_seconds()
    dataset = CacheDataset(data=entries, transform=head, num_workers=workers, progress=False)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    del dataset
    return Result(f"{data}: CacheDataset(num_workers={workers})", data, len(entries), seconds, 0, "peer",
                  "in memory", {"CPU ms/item": cpu / len(entries) * 1e3})  # fmt: skip


def prep(data: str, datalist: Path, pipeline: Path, out: Path, workers: int, processes: bool | None) -> Result:
    """`prep cache` on a local dask cluster (its start-up and the commit included in the time)."""
    from prep.cache import prepare_cache

    out = _fresh(out)
    t0, c0 = time.perf_counter(), cpu_seconds()
    summary = prepare_cache(datalist, pipeline, out, workers=workers, processes=processes)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0 + summary.worker_cpu_s
    extra = {"CPU ms/item": cpu / summary.n_items * 1e3,
             "items' own CPU ms/item": summary.item_cpu_s / summary.n_items * 1e3,
             "workers' start CPU ms/item": summary.worker_start_cpu_s / summary.n_items * 1e3,
             "disk/tensor bytes": summary.bytes_on_disk / max(1, summary.tensor_bytes)}  # fmt: skip
    return Result(f"{data}: prep cache, {summary.mode}", data, summary.n_items, seconds, summary.tensor_bytes,
                  "ours", "start-up and commit included", extra)  # fmt: skip


def _workload(work: Path, name: str, count: int, size: int, images: int) -> tuple[Path, Path, str]:
    """(datalist, pipeline, description) of a workload, made once per spec and kept."""
    from prep.synth import nifti_dataset
    from workflows.bench.train_loop import TrainOptions
    from workflows.bench.workloads import WORKLOADS

    if name == "spheres":
        folder = work / f"spheres-{count}x{size}"
        if not (folder / "dataset.json").is_file():
            nifti_dataset(folder, count=count, size=size, seed=0)
        return folder / "dataset.json", PIPELINES / "spheres.py", f"{count} pairs of {size}^3"
    load = WORKLOADS[name]
    o = TrainOptions(workload=name, count=images, size=64) if name == "mednist" else (
        TrainOptions(workload=name, count=count, size=size, crop=max(8, min(96, size // 2))))  # fmt: skip
    folder = work / f"{name}-{o.count}x{o.size}"
    folder.mkdir(parents=True, exist_ok=True)
    pipeline = folder / "pipeline.py"
    pipeline.write_text(load.pipeline(o))
    datalist = folder / "data" / "dataset.json"
    if not datalist.is_file():
        datalist = load.data(o, folder / "data")
    return datalist, pipeline, load.describe(o)


def _warm_up(datalist: Path, pipeline: Path, out: Path) -> None:
    """One untimed `prep cache` of one item, and the forkserver started (its imports done before any row)."""
    from prep.cache import prepare_cache
    from prep.cluster import ClusterStarter
    from prep.processes import start_forkserver

    doc = json.loads(datalist.read_text())
    one = datalist.with_name("warm-up.json")
    one.write_text(json.dumps({"training": doc["training"][:1]}))
    prepare_cache(one, pipeline, _fresh(out), workers=1, processes=False)
    start_forkserver()
    with ClusterStarter(1, None, processes=True) as starter:  # waits for the forkserver's imports
        starter.client()


def _warm_inputs(datalist: Path) -> None:
    from prep.quarantine import input_paths

    for entry in _entries(datalist):
        for path in input_paths(entry):
            Path(path).read_bytes()


def worker_counts(scaling: str, cores: int) -> list[int]:
    """The worker counts of `--scaling` (e.g. "1,4,8,16"), each capped at `cores`, without repeats."""
    try:
        asked = [int(w) for w in scaling.split(",") if w.strip()]
    except ValueError:
        asked = []
    if not asked or min(asked) < 1:
        raise typer.BadParameter(f"--scaling takes worker counts >= 1 such as 1,4,8,16 (got {scaling!r})")
    return sorted({min(w, cores) for w in asked})


@scenario("cache", "prep cache vs MONAI CacheDataset and PersistentDataset + DataLoader, same workers, 3 workloads.")
def cache_scenario(
    opts: Options,
    workloads: Annotated[str, typer.Option(help="comma-separated: spheres, seg-ct, mednist")] = ",".join(WORKLOADS),
    count: Annotated[int, typer.Option(min=1, help="3D workloads: image/label pairs")] = 64,
    size: Annotated[int, typer.Option(min=16, help="3D workloads: volume edge in voxels")] = 64,
    images: Annotated[int, typer.Option(min=1, help="mednist: 64x64 JPEGs")] = 2000,
    scaling: Annotated[str, typer.Option(help="worker counts, each capped at this machine's cores")] = "1,4,8,16",
    modes: Annotated[str, typer.Option(help="prep cache modes: auto, threads, processes (comma-separated)")] = "auto",
    rounds: Annotated[int, typer.Option(min=1, help="interleaved rounds of every way at each W; rows are medians")] = 1,
    limit: Annotated[bool, typer.Option(help="add the head alone on W warm processes (the limit)")] = True,
) -> Rows:
    from prep.cluster import local_cores

    names = [w for w in workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise typer.BadParameter(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    chosen = {"auto": None, "threads": False, "processes": True}
    picked = [m for m in modes.split(",") if m]
    if not picked or any(m not in chosen for m in picked):
        raise typer.BadParameter(f"--modes takes {', '.join(chosen)} (got {modes!r})")
    work = opts.work / "cache"
    work.mkdir(parents=True, exist_ok=True)
    counts = worker_counts(scaling, local_cores())
    rows = Rows(title=f"prepare a cache: {', '.join(names)} at {', '.join(map(str, counts))} workers")
    for n, name in enumerate(names):
        datalist, pipeline, what = _workload(work, name, count, size, images)
        _warm_inputs(datalist)
        if n == 0:  # imports (dask, blockprep) done before any timed row, as MONAI's are
            _warm_up(datalist, pipeline, work / "prep")
        print(f" {name}: {what}", flush=True)
        for w in counts:
            _race(rows, work, f"{name} W{w}", datalist, pipeline, w, [chosen[m] for m in picked], rounds, limit)
    rows.footer = curve(rows, names, counts)
    return rows


def _race(
    rows: Rows, work: Path, data: str, datalist: Path, pipeline: Path, w: int, modes: list[bool | None],
    rounds: int = 1, limit: bool = False,
) -> None:  # fmt: skip
    """The MONAI ways, `prep cache` and (`limit`) the head alone at `w` workers, `rounds` times interleaved;
    the faster MONAI way (median rows) is the data set's peer."""
    from prep.cluster import torch_threads_for
    from workflows.bench.cache_limit import head_alone

    jobs = [(f"{data} CacheDataset", partial(cache_dataset, data, datalist, pipeline, w)),
            (f"{data} DataLoader", partial(persistent, data, datalist, pipeline, work / "pt", w))]  # fmt: skip
    jobs += [(f"{data} prep cache {mode}", partial(prep, data, datalist, pipeline, work / "prep", w, mode))
             for mode in modes]  # fmt: skip
    if limit:
        threads = torch_threads_for(w, None, True)
        jobs.append((f"{data} limit", partial(head_alone, data, _entries(datalist), pipeline, w, threads)))
    if rounds == 1:
        for label, job in jobs:
            rows.add(label, job)
    else:
        rows.add_rounds(jobs, rounds)
    monai = [r for r in rows.results if r.data == data and r.kind == "peer"]
    if monai:
        rows.peers[data] = max(monai, key=lambda r: r.items_per_s).name


def per_round_ratio(ours: Result, monai: list[Result]) -> str:
    """Median over rounds of `ours` / the faster MONAI way of the same round ("" with one round)."""
    mine = ours.extra.get("per round") or []
    theirs = [r.extra.get("per round") or [] for r in monai]
    if len(mine) < 2 or any(len(t) != len(mine) for t in theirs) or not theirs:
        return ""
    return f"{float(np.median([m / max(t[i] for t in theirs) for i, m in enumerate(mine)])):.2f}"


def curve(rows: Rows, names: list[str], counts: list[int]) -> list[str]:
    """items/s per workload and worker count, one column per way; prep cache / the head alone (the limit), and
    / the faster MONAI way (per round: the median of the rounds' ratios, each against that round's faster)."""
    head = ["workload", "W", "CacheDataset", "DataLoader", "limit", "prep cache", "x limit", "per round",
            "x best MONAI"]  # fmt: skip
    cells = []
    for name in names:
        for w in counts:
            data = f"{name} W{w}"
            mine = [r for r in rows.results if r.data == data]
            monai = [next((r for r in mine if way in r.name), None) for way in ("CacheDataset(", "+ Data")]
            best = max((r.items_per_s for r in monai if r), default=None)
            limit = next((r.items_per_s for r in mine if r.kind == "ceiling"), None)
            ours: list[Result | None] = [r for r in mine if r.kind == "ours"]
            for r in ours or [None]:
                ratio = f"{r.items_per_s / best:.2f}" if r and best else "-"
                way = r.name.split("prep cache, ")[-1] if r else "-"
                of_limit = f"{r.items_per_s / limit:.2f}" if r and limit else "-"
                rounds = (per_round_ratio(r, [m for m in monai if m]) if r else "") or "-"
                cells.append([name, str(w), *(f"{m.items_per_s:.1f}" if m else "-" for m in monai),
                              f"{limit:.1f}" if limit else "-", f"{r.items_per_s:.1f} ({way})" if r else "-",
                              of_limit, rounds, ratio])  # fmt: skip
    widths = [max(len(c) for c in col) for col in zip(head, *cells)]
    line = "  ".join(f"{{:<{n}}}" for n in widths)
    return ["curve: items/s at each worker count; x limit = prep cache / the head alone on W warm processes; "
            "x best MONAI = prep cache / the faster MONAI way (per round: median of each round's ratio)",
            line.format(*head), *(line.format(*c).rstrip() for c in cells)]  # fmt: skip


def _fresh(path: Path) -> Path:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return path


def tiny_cache(root: Path, n_items: int) -> Any:
    """A committed cache of `n_items` tiny items (16 bytes each, two keys) written with loaders.cache.format."""
    from loaders.cache.format import PreparedCache, read_manifest
    from loaders.cache.writing import write_items
    from loaders.errors import PrepError

    try:
        if read_manifest(root).get("bench_items") == n_items:
            return PreparedCache(root)
    except PrepError:
        pass
    items: list[Mapping[str, Any]] = [
        {"image": np.full(4, i, np.float32), "label": np.full(1, i % 7, np.uint8)} for i in range(n_items)
    ]
    return write_items(root, items, [{"source": {"image": f"case_{i:07d}.nii.gz"}} for i in range(n_items)],
                       {"bench_items": n_items})  # fmt: skip


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@scenario("cache-scale", "A cache of many tiny items: open time, ds[i] overhead per item, index memory.")
def cache_scale(
    opts: Options,
    items: Annotated[int, typer.Option(min=10, help="tiny items in the cache")] = 100_000,
    sample: Annotated[int, typer.Option(min=1, help="items read per timed pass")] = 10_000,
) -> Rows:
    from loaders import PreparedDataset
    from loaders.cache.format import PreparedCache

    root = opts.work / f"cache-scale-{items}"
    index_bytes = sum(p.stat().st_size for p in tiny_cache(root, items).root.iterdir() if p.is_file())
    rows = Rows(title=f"a cache of {items} tiny items ({index_bytes / 1e6:.1f} MB of index, meta and manifest)")
    rss0, t0, c0 = _rss_bytes(), time.perf_counter(), time.process_time()
    cache = PreparedCache(root)
    opened, cpu, grown = time.perf_counter() - t0, time.process_time() - c0, _rss_bytes() - rss0
    rows.results.append(Result("open PreparedCache", "open", 1, opened, 0, "ours", "",
                               {"ms": opened * 1e3, "CPU ms": cpu * 1e3, "RSS growth MB": grown / 1e6}))  # fmt: skip
    picks = [int(i) for i in np.random.default_rng(0).integers(0, len(cache), min(sample, len(cache)))]

    def per_item(name: str, read: Any, note: str) -> Result:
        """Wall and CPU time per item (CPU time: what other load on a shared machine barely moves)."""
        t, c = time.perf_counter(), time.process_time()
        for i in picks:
            read(i)
        s, cpu = time.perf_counter() - t, time.process_time() - c
        us = {"us/item": s / len(picks) * 1e6, "CPU us/item": cpu / len(picks) * 1e6}
        return Result(name, "per item", len(picks), s, 0, "ours", note, us)

    def getitem() -> Result:
        ds = PreparedDataset(root, backend="posix", meta=False)
        for i in picks[:100]:  # page cache warm: the reads are memory copies of 17 bytes
            ds[i]
        return per_item("PreparedDataset[i], warm", ds.__getitem__, "16+1 bytes per item")

    rows.add("lookup", lambda: per_item("index lookup (entries)", cache.entries, "no I/O"))
    rows.add("getitem", getitem)
    if grown > index_bytes:
        rows.skip("index memory", f"opening grew RSS by {grown / 1e6:.1f} MB, more than the index files")
    return rows
