"""`loaders`: PreparedDataset (each backend, items and prefetching batches) against ceilings and MONAI
PersistentDataset on `--count` synthetic volumes (float32 image + uint8 label, `--size`^3), written as a
prepared cache under `--work` (kept for the next run); `--device cuda:N` adds GPU rows (kvikio, pinned
staging, PersistentDataset + .cuda(), GDSDataset); and a `--patch`^3 region of a `--region-size`^3 volume
against reading the whole volume.

    python -m workflows.benchmark loaders --count 32 --size 128 --warm
    python -m workflows.benchmark loaders --count 16 --size 256 --cold --device cuda:0
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from loaders.cache.format import PreparedCache, read_manifest
from loaders.cache.writing import write_items
from loaders.deps import cuda_available
from loaders.errors import PrepError
from workflows.bench import ceilings, scenario
from workflows.bench.core import Options, Result, Rows, evict, start_pass

HOST_BACKENDS = ("posix", "direct")
PERSISTENT = "MONAI PersistentDataset"
# (backend, row label, backend options) of the GPU rows; "auto" is what PreparedDataset(device=...) uses.
GPU_WAYS: list[tuple[str, str, dict[str, Any]]] = [
    ("auto", "auto", {}),
    ("kvikio", "kvikio only", {"direct_io": False, "stage_cold": False}),
    ("kvikio", "kvikio only, O_DIRECT", {"direct_io": True, "stage_cold": False}),
    ("direct", "direct, pinned", {}),
    ("posix", "posix, pinned", {}),
]


def make_cache(root: Path, count: int, shape: tuple[int, ...], seed: int = 0) -> PreparedCache:
    """A prepared cache of `count` synthetic volumes (image float32, label uint8); reused when it matches."""
    spec = {"count": count, "shape": list(shape), "seed": seed}
    try:
        if read_manifest(root).get("bench") == spec:
            return PreparedCache(root)
    except PrepError:
        pass
    rng = np.random.default_rng(seed)
    images = [rng.random((1, *shape), dtype=np.float32) for _ in range(count)]
    items: list[Mapping[str, Any]] = [{"image": im, "label": (im > 0.7).astype(np.uint8)} for im in images]
    metas = [{"source": {"item": i}} for i in range(count)]
    return write_items(root, items, metas, {"bench": spec})


class _FromCache:
    """Deterministic 'transform' for the PersistentDataset peer: the same tensors, as MetaTensors."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, entry: dict[str, Any]) -> dict[str, Any]:
        from loaders import PreparedDataset

        return dict(PreparedDataset(self.root, backend="posix")[int(entry["item"])])


def _timed(name: str, group: str, kind: str, cache: PreparedCache, run: Callable[[], Any], files: list[str],
           cold: bool) -> Result:  # fmt: skip
    """A warm-up pass under the timed pass's conditions (cold: evicted first), then the timed pass."""
    for _ in range(2):
        how = start_pass(files, cold)
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    nbytes = sum(e.nbytes for e in cache.iter_entries())
    return Result(name, group, len(cache), seconds, nbytes, kind, how)


def _add(rows: Rows, name: str, group: str, kind: str, cache: PreparedCache, make: Callable[[], Any],
         files: list[str], cold: bool) -> None:  # fmt: skip
    """Build the reader (`make()` returns the pass to time) and time it as one row, or keep why it cannot run."""
    rows.add(name, lambda: _timed(name, group, kind, cache, make(), files, cold))


def _each_item(ds: Any, to: Callable[[Any], Any] | None = None, sync: Callable[[], None] | None = None) -> Any:
    def run() -> None:
        for i in range(len(ds)):
            item = ds[i]
            if to is not None:
                to(item)
        if sync is not None:
            sync()

    return run


def _batches(ds: Any, batch: int, sync: Callable[[], None] | None = None) -> Any:
    def run() -> None:
        for _ in ds.iter_batches(batch, prefetch=2):
            pass
        if sync is not None:
            sync()

    return run


def persistent_peer(cache: PreparedCache, work: Path) -> Any:
    """MONAI PersistentDataset over the same tensors (its .pt files written now, untimed)."""
    from monai.data import PersistentDataset
    from monai.transforms import Compose

    ds = PersistentDataset([{"item": i} for i in range(len(cache))], Compose([_FromCache(cache.root)]),
                           cache_dir=work / "pt")  # fmt: skip
    for i in range(len(ds)):
        ds[i]
    return ds


def volume_rows(rows: Rows, cache: PreparedCache, opts: Options, host: bool = True) -> Any:
    """Ceiling, PreparedDataset per host backend (items, batches), PersistentDataset; returns the peer."""
    from loaders import PreparedDataset

    shards = [str(s) for s in cache.shards]
    items = ceilings.cache_items(cache.root)
    whole = Options(1, len(cache), opts.cold)  # the ceilings read every item once, like the rows
    if opts.cold:
        rows.add("O_DIRECT reference", lambda: ceilings.direct(items, whole, "volumes"))
    else:
        rows.add("ceiling np.fromfile", lambda: ceilings.fromfile(items, whole, "volumes"))
    for b in HOST_BACKENDS if host else ():
        ds = PreparedDataset(cache.root, backend=b)
        _add(rows, f"PreparedDataset[{b}] items", "volumes", "ours", cache, partial(_each_item, ds), shards, opts.cold)
        _add(rows, f"PreparedDataset[{b}] batches", "volumes", "ours", cache, partial(_batches, ds, opts.batchsize),
             shards, opts.cold)  # fmt: skip
    peer: list[Any] = []

    def persistent() -> Result:
        peer.append(persistent_peer(cache, opts.work / "loaders"))
        pt = sorted(str(p) for p in (opts.work / "loaders" / "pt").glob("*.pt"))
        return _timed(PERSISTENT, "volumes", "peer", cache, _each_item(peer[0]), pt, opts.cold)

    rows.add(PERSISTENT, persistent)
    return peer[0] if peer else None


def gpu_rows(rows: Rows, cache: PreparedCache, opts: Options, persistent: Any, items: bool = False) -> None:
    """GPU rows (need a CUDA GPU): kvikio ceiling, PreparedDataset kvikio / pinned, peers + .cuda()."""
    if not cuda_available():
        return rows.skip("GPU rows", "torch sees no CUDA/ROCm device here")
    import torch

    from loaders import PreparedDataset

    shards = [str(s) for s in cache.shards]
    sync = lambda: torch.cuda.synchronize(torch.device(opts.device))  # noqa: E731
    whole = Options(1, len(cache), opts.cold, opts.device)
    rows.add("ceiling kvikio", lambda: ceilings.kvikio_bulk(ceilings.cache_items(cache.root), whole, "gpu"))
    for backend, label, options in GPU_WAYS:
        ds = PreparedDataset(cache.root, backend=backend, device=opts.device, backend_options=options)
        _add(rows, f"PreparedDataset[{label}] cuda batches", "gpu", "ours", cache,
             partial(_batches, ds, opts.batchsize, sync), shards, opts.cold)  # fmt: skip
    _kvikio_direct_io_off()  # the O_DIRECT row set it process-wide; GDSDataset below reads through kvikio
    if items:
        ds = PreparedDataset(cache.root, backend="auto", device=opts.device)
        _add(rows, "PreparedDataset[auto] cuda items", "gpu", "ours", cache, partial(_each_item, ds, sync=sync),
             shards, opts.cold)  # fmt: skip
    if persistent is not None:
        pt = sorted(str(p) for p in (opts.work / "loaders" / "pt").glob("*.pt"))
        to_gpu = lambda item: [v.to(opts.device) for v in item.values()]  # noqa: E731
        _add(rows, f"{PERSISTENT} + .cuda()", "gpu", "peer", cache, partial(_each_item, persistent, to_gpu, sync),
             pt, opts.cold)  # fmt: skip
    _add(rows, "MONAI GDSDataset", "gpu", "peer", cache, partial(_gds, cache, opts, sync), shards, opts.cold)


def _kvikio_direct_io_off() -> None:
    try:
        import kvikio.defaults

        kvikio.defaults.set("auto_direct_io_read", False)
    except (ImportError, KeyError, ValueError, RuntimeError, TypeError):
        pass  # no kvikio, or a version without the setting: nothing was changed


def _gds(cache: PreparedCache, opts: Options, sync: Callable[[], None]) -> Any:
    from monai.data import GDSDataset
    from monai.transforms import Compose

    device = int(opts.device.partition(":")[2] or 0)
    ds = GDSDataset([{"item": i} for i in range(len(cache))], Compose([_FromCache(cache.root)]),
                    cache_dir=opts.work / "loaders" / "gds", device=device)  # fmt: skip
    for i in range(len(ds)):  # writes its cache (untimed)
        ds[i]
    return _each_item(ds, sync=sync)


def region_rows(rows: Rows, root: Path, size: int, patch: int, reps: int, opts: Options, backend: str | None) -> None:
    """A patch^3 region of a size^3 volume (random places) against the whole volume; cold runs evict before
    every read, so neither side profits from the one before."""
    from loaders import PreparedDataset

    cache = make_cache(root, 1, (size,) * 3, seed=1)
    shard = [str(cache.shards[0])]
    backend = backend or ("direct" if opts.cold else "posix")
    ds = PreparedDataset(root, keys=["image"], backend=backend, meta=False)
    rng = np.random.default_rng(0)
    starts = [[int(rng.integers(0, size - patch + 1)) for _ in range(3)] for _ in range(reps)]

    def timed(read: Callable[[list[int]], Any]) -> float:
        for s in starts[:2]:  # warm-up: builds the backend and buffers (and fills the page cache when warm)
            read(s)
        total = 0.0
        for s in starts:
            if opts.cold:
                evict(shard)
            t0 = time.perf_counter()
            read(s)
            total += time.perf_counter() - t0
        return total

    whole, part = cache.entries(0)[0].nbytes, patch**3 * 4
    how = "evicted before each read" if opts.cold else "warm"
    rows.results.append(Result(f"whole volume {size}^3 [{backend}]", "region", reps, timed(lambda s: ds[0]),
                               whole * reps, "peer", how))  # fmt: skip
    region = timed(lambda s: ds.read_region(0, "image", (0, *s), (1, patch, patch, patch)))
    rows.results.append(Result(f"region {patch}^3 of it [{backend}]", "region", reps, region, part * reps, "ours", how))
    rows.peers["region"] = rows.results[-2].name


@scenario("loaders", "PreparedDataset per backend vs ceilings and MONAI on synthetic volumes; GPU rows; regions.")
def loaders_scenario(
    opts: Options,
    count: Annotated[int, typer.Option(min=1, help="volumes in the synthetic cache")] = 32,
    size: Annotated[int, typer.Option(min=2, help="edge of each volume (size^3 voxels)")] = 128,
    region: Annotated[bool, typer.Option(help="compare a region read with the whole volume")] = True,
    region_size: Annotated[int, typer.Option(help="edge of the volume for the region read")] = 256,
    patch: Annotated[int, typer.Option(help="edge of the region read from it")] = 96,
    reps: Annotated[int, typer.Option(min=1, help="region reads (and whole-volume reads) timed")] = 8,
    region_backend: Annotated[str | None, typer.Option(help="region backend (posix warm, direct cold)")] = None,
    gpu_only: Annotated[bool, typer.Option(help="skip the CPU PreparedDataset rows (ceiling, peer kept)")] = False,
    gpu_items: Annotated[bool, typer.Option(help="also time GPU item-by-item reads (auto backend)")] = False,
) -> Rows:  # fmt: skip
    if region and patch > region_size:
        raise typer.BadParameter("--patch must not exceed --region-size", param_hint="--patch")
    work = opts.work / "loaders"
    cache = make_cache(work / f"cache-{count}x{size}", count, (size,) * 3)
    rows = Rows(peers={"volumes": PERSISTENT, "gpu": f"{PERSISTENT} + .cuda()"},
                title=f"{count} volumes of {size}^3 (float32 image + uint8 label)")  # fmt: skip
    persistent = volume_rows(rows, cache, opts, host=not gpu_only)
    if opts.gpu:
        gpu_rows(rows, cache, opts, persistent, gpu_items)
    if region:
        region_rows(rows, work / f"region-{region_size}", region_size, patch, reps, opts, region_backend)
    return rows
