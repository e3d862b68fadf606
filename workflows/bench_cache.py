"""Benchmark `prep cache` against MONAI PersistentDataset's first pass, and opening a 1M-item cache.

Both preparations run the same deterministic head (the pipeline's transforms before its first random one)
over the same synthetic datalist, inputs already in the page cache, outputs on the same filesystem, in the
same run; only ratios between them are meaningful. The peer is PersistentDataset iterated in one process
with torch's default threads; also shown: the peer at 1 torch thread and through a DataLoader with
--workers worker processes. prep cache's time includes starting its cluster and committing the cache.

python -m workflows.bench_cache --count 128 --size 96 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PIPELINE = Path(__file__).parent / "pipelines" / "spheres.py"


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def cpu_seconds() -> float:
    """CPU time of this process and its finished children: a measure of work that other load barely moves."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def warm_inputs(datalist: Path) -> None:
    """Read every input file once, so neither contender pays for a cold page cache the other does not."""
    from prep.cache import load_datalist
    from prep.quarantine import input_paths

    for _, entry in load_datalist(datalist):
        for path in input_paths(entry):
            Path(path).read_bytes()


def bench_persistent(
    datalist: Path, pipeline: Path, cache_dir: Path, threads: int = 0, loader_workers: int = 0
) -> dict[str, Any]:
    """MONAI PersistentDataset, first pass: runs the head and pickles each item to cache_dir.

    loader_workers=0: plain iteration in this process (what `DataLoader(num_workers=0)` does, without the
    collation) with `threads` torch intra-op threads (0: torch's default). loader_workers=N: a MONAI
    DataLoader with N worker processes (one torch thread each, as torch sets them), the way the first
    training epoch fills the cache when the user asks for loader workers.
    """
    import torch
    from monai.data import DataLoader, PersistentDataset

    from prep.cache import load_datalist
    from prep.pipeline import load_pipeline

    pipe = load_pipeline(pipeline)
    entries = [entry for _, entry in load_datalist(datalist)]
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        t0, c0 = time.perf_counter(), cpu_seconds()
        dataset = PersistentDataset(data=entries, transform=pipe.head_compose(), cache_dir=cache_dir)
        if loader_workers:
            for _ in DataLoader(dataset, batch_size=1, num_workers=loader_workers, collate_fn=_first):
                pass
        else:
            for i in range(len(dataset)):
                dataset[i]
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        torch.set_num_threads(default_threads)
    return {
        "seconds": seconds,
        "items_per_s": len(entries) / seconds,
        "items": len(entries),
        "cpu_ms_per_item": cpu / len(entries) * 1e3,
        "disk_bytes": _tree_bytes(cache_dir),
        "torch_threads": 1 if loader_workers else threads or default_threads,
        "loader_workers": loader_workers,
    }


def _first(batch: list[Any]) -> Any:
    """DataLoader collate that keeps the item as it is (collating is not part of preparing)."""
    return batch[0]


def bench_prep(datalist: Path, pipeline: Path, out: Path, workers: int, processes: bool) -> dict[str, Any]:
    """`prep cache` on a local dask cluster (its start-up and the commit included in the time)."""
    from prep.cache import prepare_cache
    from prep.cluster import torch_threads_for

    t0, c0 = time.perf_counter(), cpu_seconds()
    summary = prepare_cache(datalist, pipeline, out, workers=workers, processes=processes)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return {
        "seconds": seconds,
        "items": summary.n_items,
        "workers": workers,
        "cpu_ms_per_item": cpu / summary.n_items * 1e3,
        "items_per_s": summary.n_items / seconds,
        "items_per_s_per_worker": summary.n_items / seconds / workers,
        "disk_bytes": summary.bytes_on_disk,
        "tensor_bytes": summary.tensor_bytes,
        "mode": "processes" if processes else "threads",
        "torch_threads_per_worker": torch_threads_for(workers, None),
    }


def synthetic_index(root: Path, n_items: int, keys: tuple[str, ...] = ("image", "label")) -> None:
    """Write a committed cache of n_items index rows (no shard bytes) through loaders.format."""
    from loaders.format import ALIGN, INDEX_DTYPE, make_rows, write_index, write_manifest, write_meta

    root.mkdir(parents=True, exist_ok=True)
    template = make_rows(
        [{"item": 0, "key": k, "shard": 0, "offset": 0, "nbytes": 4 * 96**3, "dtype": "float32",
          "shape": (1, 96, 96, 96), "xxh3": 0} for k in range(len(keys))]
    )  # fmt: skip
    rows = np.tile(template, n_items).astype(INDEX_DTYPE)
    rows["item"] = np.repeat(np.arange(n_items, dtype="<u4"), len(keys))
    rows["offset"] = np.arange(len(rows), dtype="<u8") * ((4 * 96**3 + ALIGN - 1) // ALIGN * ALIGN)
    write_index(root, rows)
    write_meta(root, [{"source": {"image": f"imagesTr/case_{i:07d}.nii.gz"}} for i in range(n_items)])
    write_manifest(root, {"keys": list(keys), "shards": ["shards/shard-0.bin"], "n_items": n_items})


def bench_open(root: Path, repeats: int = 5) -> dict[str, float]:
    """Median seconds to open the cache with PreparedCache, and to fetch one item's entries and meta."""
    from loaders.format import PreparedCache

    opens, firsts = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache = PreparedCache(root)
        t1 = time.perf_counter()
        cache.entries(len(cache) // 2)
        cache.meta(len(cache) - 1)
        firsts.append(time.perf_counter() - t1)
        opens.append(t1 - t0)
    return {"open_s": float(np.median(opens)), "first_item_s": float(np.median(firsts)), "n_items": len(cache)}


def run(
    count: int, size: int, workers: int, index_items: int, pipeline: Path, out: Path, processes: bool = False,
    rounds: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Run every measurement under `out`; return the numbers and print a report.

    rounds > 1 splits the datalist into that many parts and runs every contender on each part in turn, in a
    rotating order, so load from elsewhere on a shared machine falls on all of them alike (prep cache then
    pays its cluster start once per part: a handicap, not a help).
    """
    from prep.cluster import local_cores
    from prep.synth import nifti_dataset

    load_before = os.getloadavg()
    datalist = nifti_dataset(out / "data", count=count, size=size, seed=0)
    warm_inputs(datalist)
    contenders: dict[str, Any] = {
        "persistent": lambda d, o: bench_persistent(d, pipeline, o),
        "persistent_1_thread": lambda d, o: bench_persistent(d, pipeline, o, threads=1),
        "persistent_dataloader": lambda d, o: bench_persistent(d, pipeline, o, loader_workers=workers),
        "prep": lambda d, o: bench_prep(d, pipeline, o, workers, processes),
    }
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for r, part in enumerate(_split_datalist(datalist, rounds)):
        names = list(contenders)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            parts[name].append(contenders[name](part, out / f"{name}-{r}"))
    totals = {name: _combine(runs) for name, runs in parts.items()}
    synthetic_index(out / "index", index_items)
    opened = bench_open(out / "index")
    prep = totals["prep"]
    result = {
        "count": count, "size": size, "workers": workers, "rounds": rounds, "cores": local_cores(),
        "load_before": load_before, "load_after": os.getloadavg(), **totals,
        "speedup_vs_persistent": prep["items_per_s"] / totals["persistent"]["items_per_s"],
        "speedup_vs_persistent_1_thread": prep["items_per_s"] / totals["persistent_1_thread"]["items_per_s"],
        "speedup_vs_persistent_dataloader": prep["items_per_s"] / totals["persistent_dataloader"]["items_per_s"],
        "disk_over_tensor_bytes": prep["disk_bytes"] / prep["tensor_bytes"],
        "persistent_disk_over_tensor_bytes": totals["persistent"]["disk_bytes"] / prep["tensor_bytes"],
        "open": opened,
    }  # fmt: skip
    _report(result)
    return result


def _split_datalist(datalist: Path, rounds: int) -> list[Path]:
    """The datalist as `rounds` datalists of consecutive entries, next to it (relative paths stay valid)."""
    if rounds <= 1:
        return [datalist]
    doc = json.loads(datalist.read_text())
    entries = doc["training"]
    size = -(-len(entries) // rounds)
    paths = []
    for r in range(0, len(entries), size):
        path = datalist.with_name(f"part-{r // size}.json")
        path.write_text(json.dumps({**doc, "training": entries[r : r + size]}))
        paths.append(path)
    return paths


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's runs over the parts as one: times, CPU and bytes added up, rates recomputed."""
    total = dict(runs[0])
    for key in ("seconds", "disk_bytes", "tensor_bytes", "items"):
        if key in total:
            total[key] = sum(run[key] for run in runs)
    total["cpu_ms_per_item"] = sum(run["cpu_ms_per_item"] * run["items"] for run in runs) / total["items"]
    total["items_per_s"] = total["items"] / total["seconds"]
    if "items_per_s_per_worker" in total:
        total["items_per_s_per_worker"] = total["items_per_s"] / total["workers"]
    return total


def _report(r: dict[str, Any]) -> None:
    p, p1, pdl, prep, opened = (
        r["persistent"],
        r["persistent_1_thread"],
        r["persistent_dataloader"],
        r["prep"],
        r["open"],
    )
    load = "/".join(f"{x:.2f}" for x in r["load_before"]) + " -> " + "/".join(f"{x:.2f}" for x in r["load_after"])
    print(
        f"prepare {r['count']} x {r['size']}^3 pairs on {r['cores']} cores, {r['rounds']} round(s) "
        f"(load average {load})\n"
        f"  peer: MONAI PersistentDataset first pass, plain iteration, {p['torch_threads']} torch threads (default): "
        f"{p['items_per_s']:.2f} items/s, {p['cpu_ms_per_item']:.0f} CPU ms/item\n"
        f"  PersistentDataset first pass, plain iteration, 1 torch thread: {p1['items_per_s']:.2f} items/s, "
        f"{p1['cpu_ms_per_item']:.0f} CPU ms/item\n"
        f"  PersistentDataset first pass, DataLoader with {pdl['loader_workers']} workers: "
        f"{pdl['items_per_s']:.2f} items/s, {pdl['cpu_ms_per_item']:.0f} CPU ms/item\n"
        f"  prep cache, {r['workers']} {prep['mode']} x {prep['torch_threads_per_worker']} torch thread(s) "
        f"(start-up and commit included): {prep['items_per_s']:.2f} items/s "
        f"({prep['items_per_s_per_worker']:.2f} per worker), {prep['cpu_ms_per_item']:.0f} CPU ms/item\n"
        f"  speed-up: {r['speedup_vs_persistent']:.2f}x the peer, {r['speedup_vs_persistent_1_thread']:.2f}x at 1 "
        f"thread, {r['speedup_vs_persistent_dataloader']:.2f}x the DataLoader\n"
        f"  size on disk / raw tensor bytes:  prep {r['disk_over_tensor_bytes']:.4f}, "
        f"PersistentDataset {r['persistent_disk_over_tensor_bytes']:.4f}\n"
        f"open a {opened['n_items']}-item cache: {opened['open_s'] * 1e3:.1f} ms "
        f"(+ {opened['first_item_s'] * 1e3:.2f} ms for one item's entries and meta)"
    )


def main() -> None:
    """Command-line entry."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=128, help="image/label pairs to prepare")
    parser.add_argument("--size", type=int, default=96, help="volume edge in voxels")
    parser.add_argument("--workers", type=int, default=2, help="dask workers for prep cache (and DataLoader workers)")
    parser.add_argument("--processes", action="store_true", help="prep cache workers as processes, not threads")
    parser.add_argument("--rounds", type=int, default=1, help="interleave the contenders over this many parts")
    parser.add_argument("--index-items", type=int, default=1_000_000, help="items in the synthetic index to open")
    parser.add_argument("--pipeline", type=Path, default=DEFAULT_PIPELINE, help="PIPELINE.py (its head is timed)")
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_cache_"))
    try:
        result = run(
            args.count, args.size, args.workers, args.index_items, args.pipeline, out, args.processes, args.rounds
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
