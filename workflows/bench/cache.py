"""`cache`: `prep cache` against MONAI filling the same cache with the same workers, on three workloads, for
1..W workers; `cache-scale`: opening a cache of many tiny items, the per-item overhead of `ds[i]`, the index's
memory.

    python -m workflows.benchmark cache --workloads spheres,seg-ct,mednist --scaling 1,4,8,16
    python -m workflows.benchmark cache-scale --items 100000

Workloads: `spheres` (`--count` pairs of `--size`^3 NIfTI volumes, spacings 0.8-1.5 mm), `seg-ct` (volumes
of different shapes, edges 0.6-1.4 x `--size`, and spacings), `mednist` (`--images` 64x64 grayscale JPEGs
with a class label, the MedNIST tutorial's head). For each worker count W, in the same run: MONAI
`CacheDataset(num_workers=W)` (fills its in-memory cache on W threads), `PersistentDataset` iterated once by
a `DataLoader(num_workers=W)` (W forked processes, each item pickled to disk), and `prep cache --workers W`
(auto mode unless `--modes` adds threads/processes; its time includes starting its cluster and committing
the cache). `x peer` compares with the faster MONAI way at the same W. Inputs are read once beforehand (page
cache warm for every contender), and one untimed `prep cache` of one item imports what it needs, as the
MONAI ways find MONAI imported. CPU ms/item counts this process and its finished children.
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
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    extra = {"CPU ms/item": cpu / summary.n_items * 1e3,
             "disk/tensor bytes": summary.bytes_on_disk / max(1, summary.tensor_bytes)}  # fmt: skip
    return Result(f"{data}: prep cache, {summary.mode}", data, summary.n_items, seconds, summary.tensor_bytes,
                  "ours", "start-up and commit included", extra)  # fmt: skip


def mixed_volumes(out: Path, count: int, size: int) -> Path:
    """A seg-ct-like datalist: `count` image/label pairs whose edges (0.6-1.4 x `size`) and spacings differ."""
    from prep.synth import nifti_dataset

    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    training = []
    for i in range(count):
        edge = int(size * rng.uniform(0.6, 1.4))
        nifti_dataset(out / f"v{i:04d}", count=1, size=max(8, edge), seed=i)
        training += [{k: f"v{i:04d}/{v}" for k, v in e.items()}
                     for e in json.loads((out / f"v{i:04d}" / "dataset.json").read_text())["training"]]  # fmt: skip
    (out / "dataset.json").write_text(json.dumps({"training": training}, indent=1))
    return out / "dataset.json"


def _workload(work: Path, name: str, count: int, size: int, images: int) -> tuple[Path, Path, str]:
    """(datalist, pipeline, description) of a workload, made once per spec and kept."""
    from prep.synth import mednist_like, nifti_dataset

    if name == "spheres":
        folder, make = work / f"spheres-{count}x{size}", lambda d: nifti_dataset(d, count=count, size=size, seed=0)
        what = f"{count} pairs of {size}^3"
    elif name == "seg-ct":
        folder, make = work / f"segct-{count}x{size}", lambda d: mixed_volumes(d, count, size)
        what = f"{count} pairs of ~{size}^3, shapes and spacings differ"
    else:
        folder, make = work / f"mednist-{images}", lambda d: mednist_like(d, images)
        what = f"{images} 64x64 JPEGs"
    if not (folder / "dataset.json").is_file():
        make(folder)
    pipeline = PIPELINES / ("mednist.py" if name == "mednist" else "spheres.py")
    return folder / "dataset.json", pipeline, what


def _warm_up(datalist: Path, pipeline: Path, out: Path) -> None:
    """One untimed `prep cache` of one item."""
    from prep.cache import prepare_cache

    doc = json.loads(datalist.read_text())
    one = datalist.with_name("warm-up.json")
    one.write_text(json.dumps({"training": doc["training"][:1]}))
    prepare_cache(one, pipeline, _fresh(out), workers=1, processes=False)


def _warm_inputs(datalist: Path) -> None:
    from prep.quarantine import input_paths

    for entry in _entries(datalist):
        for path in input_paths(entry):
            Path(path).read_bytes()


@scenario("cache", "prep cache vs MONAI CacheDataset and PersistentDataset + DataLoader, same workers, 3 workloads.")
def cache_scenario(
    opts: Options,
    workloads: Annotated[str, typer.Option(help="comma-separated: spheres, seg-ct, mednist")] = "spheres,mednist",
    count: Annotated[int, typer.Option(min=1, help="3D workloads: image/label pairs")] = 64,
    size: Annotated[int, typer.Option(min=8, help="3D workloads: volume edge in voxels")] = 64,
    images: Annotated[int, typer.Option(min=1, help="mednist: 64x64 JPEGs")] = 2000,
    scaling: Annotated[str, typer.Option(help="worker counts, e.g. 1,4,8,16 (default: --workers or 2)")] = "",
    modes: Annotated[str, typer.Option(help="prep cache modes: auto, threads, processes (comma-separated)")] = "auto",
) -> Rows:
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
    counts = [int(w) for w in scaling.split(",") if w] or [opts.workers or 2]
    rows = Rows(title=f"prepare a cache: {', '.join(names)} at {', '.join(map(str, counts))} workers")
    for n, name in enumerate(names):
        datalist, pipeline, what = _workload(work, name, count, size, images)
        _warm_inputs(datalist)
        if n == 0:  # imports (dask, blockprep) done before any timed row, as MONAI's are
            _warm_up(datalist, pipeline, work / "prep")
        print(f" {name}: {what}", flush=True)
        for w in counts:
            _race(rows, work, f"{name} W{w}", datalist, pipeline, w, [chosen[m] for m in picked])
    return rows


def _race(rows: Rows, work: Path, data: str, datalist: Path, pipeline: Path, w: int, modes: list[bool | None]) -> None:
    """The MONAI ways and `prep cache` at `w` workers; the faster MONAI way is the data set's peer."""
    monai = rows.add(f"{data} CacheDataset", partial(cache_dataset, data, datalist, pipeline, w))
    monai += rows.add(f"{data} DataLoader", partial(persistent, data, datalist, pipeline, work / "pt", w))
    if monai:
        rows.peers[data] = max(monai, key=lambda r: r.items_per_s).name
    for mode in modes:
        rows.add(f"{data} prep cache", partial(prep, data, datalist, pipeline, work / "prep", w, mode))


def _fresh(path: Path) -> Path:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return path


def tiny_cache(root: Path, n_items: int) -> Any:
    """A committed cache of `n_items` tiny items (16 bytes each, two keys) written with loaders.format."""
    from loaders.errors import PrepError
    from loaders.format import PreparedCache, read_manifest, write_items

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
    from loaders.dataset import PreparedDataset
    from loaders.format import PreparedCache

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
