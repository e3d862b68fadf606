"""`cold-rate`: the loader's read rate over a cold epoch against the disk's, on a prepared cache larger than the
memory the loader may use.

    python -m workflows.benchmark cold-rate --count 50 --size 128 --limit-mib 384

One run measures the disk's O_DIRECT sequential rate over the cache's shards (1 MiB requests, as many in flight as
the loader's cold reads, evicted first: `train_cold.sequential_spans`, `ceilings.read_direct`), then one epoch of
`PreparedLoader(cache, transform, device="cpu")` with its defaults (no model: the loop only takes the batches) in a
child process inside a memory cgroup of `--limit-mib` (as root; `workflows.bench.memcg`; 0: no cgroup). The child
evicts the cache's files after building the loader and counts the bytes the epoch read from the block device (or its
/proc io: `train_cold.read_counters`) over the wall time of the next epoch (after one batch, untimed, so that the
tail's first calls and the threads' start count in no read rate). The footer says `loader cold read / disk = x.xx`,
the disk's cost model the loader measured, and the epoch's bytes against its crops'. `--bricks` writes the cache's
bricks first (`prep bricks`), `--no-bricks` (the default) removes them: run both to see what they do on a disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from workflows.bench import scenario
from workflows.bench.core import Options, Result, Rows, Unavailable, evict, files_under

__all__ = ["cold_rate_scenario", "loader_epoch"]


def loader_epoch(cache: Path, pipeline: Path, batch_size: int, crop_read: bool) -> dict[str, Any]:
    """One epoch of a PreparedLoader (CPU, defaults but `crop_read`) from cold, after one warm-up batch: items,
    seconds, bytes read and what counted them, the tier's bytes, the backend."""
    from loaders.fast.loader import PreparedLoader
    from workflows.bench.train_cold import read_counters
    from workflows.bench.train_loop import transform_of

    loader = PreparedLoader(cache, transform_of(pipeline, 0), batch_size, device="cpu",
                            crop_read="auto" if crop_read else False)  # fmt: skip
    for _ in loader:  # one batch first, untimed: the tail's first calls and the threads' start are not reading
        break
    evict(files_under(cache), drop_caches=False)  # fadvise: drop_caches would empty the whole machine's
    counter = read_counters(cache, os.getpid())[0]
    at, start, items = counter.read(), time.perf_counter(), 0
    for batch in loader:
        items += len(batch["_items"])
    seconds = time.perf_counter() - start
    from loaders.reading import diskcost

    models = [m for (pid, _), m in diskcost._MEASURED.items() if pid == os.getpid()]
    out = {"items": items, "seconds": seconds, "read": counter.read() - at, "counted by": counter.how,
           "tier": loader.tier_bytes, "backend": loader.backend.name,
           "cost": [models[0].request_s, models[0].bandwidth_bps] if models else None}  # fmt: skip
    loader.close()
    return out


def _in_cgroup(limit: int, args: list[str]) -> tuple[dict[str, Any], str]:
    """`args` (a child printing a JSON line last) run inside a fresh memory cgroup of `limit` bytes (none for 0):
    its JSON, and where it ran."""
    from workflows.bench.memcg import MemoryCgroup, cgroup_reason

    if not limit:
        done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
        where, kills = "no memory cgroup", 0
    else:
        reason = cgroup_reason()
        if reason:
            raise Unavailable(f"--limit-mib: {reason} (pass --limit-mib 0 to run without one)")
        with MemoryCgroup(limit) as cgroup:
            done = cgroup.run(args, 3600)
            where, kills = f"a {limit >> 20} MiB memory cgroup (cgroup v{cgroup.version}, swap off)", cgroup.oom_kills()
    if done.returncode or kills:
        raise Unavailable(f"the loader's epoch failed in {where} (exit {done.returncode}, {kills} OOM kills): "
                          f"{done.stderr.strip().splitlines()[-1:]}")  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1]), where


@scenario("cold-rate", "A cold epoch's read rate against the disk's O_DIRECT rate, the cache larger than the cgroup.")
def cold_rate_scenario(
    opts: Options,
    count: Annotated[int, typer.Option(min=1, help="volumes in the dataset")] = 50,
    size: Annotated[int, typer.Option(min=16, help="volume edge in voxels (8 x size^3 B an item)")] = 128,
    crop: Annotated[int, typer.Option(min=1, help="crop edge of the tail's RandSpatialCropd")] = 32,
    limit_mib: Annotated[int, typer.Option(min=0, help="the child's cgroup limit (root); 0: none")] = 384,
    crop_read: Annotated[bool, typer.Option("--crop-read/--whole-read", help="crop or whole reads")] = True,
    bricks: Annotated[bool, typer.Option(help="write the cache's bricks first (`prep bricks`))")] = False,
) -> Rows:
    """Disk sequential O_DIRECT rate, then one cold loader epoch in a child inside the cgroup; footer: the ratio."""
    from loaders.cache.format import PreparedCache
    from loaders.tunables import COLD_INFLIGHT
    from workflows.bench.ceilings import read_direct
    from workflows.bench.train_cold import sequential_spans
    from workflows.bench.train_loop import TrainOptions, build_data

    train = TrainOptions(size=size, crop=crop, count=count, batch=opts.batchsize, device="cpu", workers=2)
    _, pipeline, cache = build_data(train, opts.work)
    nbytes = sum(os.path.getsize(p) for p in PreparedCache(cache).shards)
    rows = Rows(title=f"{count} x {size}^3 spheres, crops {crop}^3, {nbytes / 1e6:.0f} MB of shards")
    rows.footer.append(_bricks(cache, bricks))
    depth = min(COLD_INFLIGHT, 8 * len(os.sched_getaffinity(0)))
    disk = rows.add("disk", lambda: Result(f"disk O_DIRECT sequential 1 MiB, {depth} in flight", "volumes", count,
                                           *_timed(read_direct(sequential_spans(list(PreparedCache(cache).shards)),
                                                               depth)), kind="ceiling"))  # fmt: skip
    args = [sys.executable, "-m", "workflows.bench.cold_rate", str(cache), str(pipeline), str(opts.batchsize),
            str(int(crop_read))]  # fmt: skip
    got, where = _in_cgroup(limit_mib << 20, args)
    mode = "crop reads" if crop_read else "whole reads"
    loader = Result(f"PreparedLoader cold epoch (CPU defaults, {mode}), bytes read", "volumes", got["items"],
                    got["seconds"], got["read"], kind="ours",
                    note=f"{where}; backend {got['backend']}; tier {got['tier']} B")  # fmt: skip
    rows.results.append(loader)
    print(f"  {loader.name}: {loader.gb_per_s:.3f} GB/s", flush=True)
    if disk:
        rows.footer.append(f"loader cold read / disk = {loader.gb_per_s / disk[0].gb_per_s:.2f} ({loader.gb_per_s:.3f}"
                           f" / {disk[0].gb_per_s:.3f} GB/s; cache {nbytes / 1e6:.0f} MB, in {where}; the epoch read "
                           f"{got['read'] / 1e6:.0f} MB counted by {got['counted by']})")  # fmt: skip
    if got.get("cost"):
        request_s, bandwidth = got["cost"]
        rows.footer.append(
            f"the disk's cost model, measured by the loader: {request_s * 1e6:.0f} us a request, "
            f"{bandwidth / 1e9:.2f} GB/s; gaps up to {request_s * bandwidth / 1e3:.0f} KB read through"
        )
    per_item = sum(e.dtype.itemsize for e in PreparedCache(cache).entries(0)) * crop**3
    rows.footer.append(f"the epoch read {got['read'] / max(per_item * got['items'], 1):.2f}x its crops' bytes "
                       f"({got['items']} crops of {per_item / 1e6:.2f} MB)")  # fmt: skip
    return rows


def _bricks(cache: Path, wanted: bool) -> str:
    """The cache's bricks written (`--bricks`) or removed: a footer line saying which, and how long writing took."""
    from prep.bricks import build_bricks, drop_bricks

    if not wanted:
        drop_bricks(cache)
        return "crops read from the cache's C-order tensors (no bricks)"
    start = time.perf_counter()
    build_bricks(cache)
    return (
        f"bricks written (blocks of 4096 B, in {time.perf_counter() - start:.1f} s): a cold crop is read from them "
        "where the disk's cost model finds that cheaper"
    )


def _timed(measured: tuple[float, int, str]) -> tuple[float, int]:
    seconds, nbytes, _ = measured
    return seconds, nbytes


if __name__ == "__main__":  # the child: python -m workflows.bench.cold_rate CACHE PIPELINE BATCH CROP_READ
    cache_arg, pipeline_arg, batch_arg, crop_arg = sys.argv[1:5]
    print(json.dumps(loader_epoch(Path(cache_arg), Path(pipeline_arg), int(batch_arg), bool(int(crop_arg)))))
