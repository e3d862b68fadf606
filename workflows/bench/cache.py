"""`cache`: `prep cache` against MONAI PersistentDataset's first pass over the same head, for 1..W workers;
`cache-scale`: opening a cache of many tiny items, the per-item overhead of `ds[i]`, the index's memory.

    python -m workflows.benchmark cache --count 128 --size 96 --scaling 1,2,4,8,16
    python -m workflows.benchmark cache-scale --items 100000

Both preparations run the deterministic head over the same synthetic datalist, inputs already in the page
cache, outputs on the same filesystem, in the same run. Peers: PersistentDataset iterated in this process
(torch's default threads), and through a MONAI DataLoader with W worker processes. `prep cache`'s time
includes starting its cluster and committing the cache. CPU ms/item counts this process and its children.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import scenario
from workflows.bench.core import Options, Result, Rows

DEFAULT_PIPELINE = Path(__file__).parents[1] / "pipelines" / "spheres.py"
PEER = "PersistentDataset first pass"


def cpu_seconds() -> float:
    """CPU time of this process and its finished children: a measure of work that other load barely moves.
    `prep cache --processes` workers are children of a forkserver, counted through it."""
    from prep.cluster import forkserver_cpu_seconds

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime + forkserver_cpu_seconds()


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _first(batch: list[Any]) -> Any:
    """DataLoader collate that keeps the item as it is (collating is not part of preparing)."""
    return batch[0]


def persistent(datalist: Path, pipeline: Path, out: Path, loader_workers: int = 0) -> Result:
    """MONAI PersistentDataset's first pass (runs the head, pickles each item): plain iteration in this
    process, or a MONAI DataLoader with `loader_workers` worker processes."""
    from monai.data import DataLoader, PersistentDataset

    from prep.cache import load_datalist
    from prep.pipeline import load_pipeline

    entries = [entry for _, entry in load_datalist(datalist)]
    t0, c0 = time.perf_counter(), cpu_seconds()
    dataset = PersistentDataset(data=entries, transform=load_pipeline(pipeline).head_compose(), cache_dir=out)
    if loader_workers:
        for _ in DataLoader(dataset, batch_size=1, num_workers=loader_workers, collate_fn=_first):
            pass
    else:
        for i in range(len(dataset)):
            dataset[i]
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    name = f"{PEER}, DataLoader {loader_workers} workers" if loader_workers else PEER
    extra = {"CPU ms/item": cpu / len(entries) * 1e3, "disk MB": _tree_bytes(out) / 1e6}
    return Result(name, "prepare", len(entries), seconds, 0, "peer", "", extra)


def prep(datalist: Path, pipeline: Path, out: Path, workers: int, processes: bool) -> Result:
    """`prep cache` on a local dask cluster (its start-up and the commit included in the time)."""
    from prep.cache import prepare_cache

    t0, c0 = time.perf_counter(), cpu_seconds()
    summary = prepare_cache(datalist, pipeline, out, workers=workers, processes=processes)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    mode = "processes" if processes else "threads"
    extra = {
        "CPU ms/item": cpu / summary.n_items * 1e3,
        "disk/tensor bytes": summary.bytes_on_disk / summary.tensor_bytes,
    }
    return Result(f"prep cache, {workers} {mode}", "prepare", summary.n_items, seconds, summary.tensor_bytes, "ours",
                  "start-up and commit included", extra)  # fmt: skip


@scenario("cache", "prep cache vs MONAI PersistentDataset's first pass (plain and DataLoader), 1..W workers.")
def cache_scenario(
    opts: Options,
    count: Annotated[int, typer.Option(min=1, help="image/label pairs to prepare")] = 128,
    size: Annotated[int, typer.Option(min=8, help="volume edge in voxels")] = 96,
    scaling: Annotated[str, typer.Option(help="worker counts, e.g. 1,2,4,8,16 (default: --workers or 2)")] = "",
    processes: Annotated[bool, typer.Option(help="prep cache workers as processes, not threads")] = False,
    pipeline: Annotated[Path, typer.Option(help="PIPELINE.py (its head is timed)")] = DEFAULT_PIPELINE,
) -> Rows:
    from prep.cache import load_datalist
    from prep.quarantine import input_paths
    from prep.synth import nifti_dataset

    work = opts.work / "cache"
    work.mkdir(parents=True, exist_ok=True)
    datalist = work / f"data-{count}x{size}" / "dataset.json"
    if not datalist.is_file():  # same spec as an earlier run: the same data, kept
        datalist = nifti_dataset(datalist.parent, count=count, size=size, seed=0)
    for _, entry in load_datalist(datalist):  # inputs warm for every contender
        for path in input_paths(entry):
            Path(path).read_bytes()
    counts = [int(w) for w in scaling.split(",") if w] or [opts.workers or 2]
    rows = Rows(peers={"prepare": PEER}, title=f"prepare {count} x {size}^3 pairs")
    rows.add(PEER, lambda: persistent(datalist, pipeline, _fresh(work / "pt")))
    for w in counts:
        rows.add(f"DataLoader {w}", lambda: persistent(datalist, pipeline, _fresh(work / f"pt-{w}"), w))  # noqa: B023
        rows.add(f"prep cache {w}", lambda: prep(datalist, pipeline, _fresh(work / f"prep-{w}"), w, processes))  # noqa: B023
    return rows


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
