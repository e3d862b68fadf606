"""Loader benchmark: PreparedDataset (each backend) against ceilings and MONAI peers, measured in one run.

    python -m workflows.bench_loaders --count 32 --size 128 --warm
    python -m workflows.bench_loaders --count 32 --size 128 --cold
    python -m workflows.bench_loaders --count 16 --size 256 --warm --device cuda:0

It writes `--count` synthetic volumes (float32 image + uint8 label, `--size`^3) as a prepared cache under
`--work` (kept for the next run), and the same tensors as MONAI `PersistentDataset` .pt files. Rows:
ceilings (warm: `np.fromfile` of the same bytes; cold: the same bytes read with O_DIRECT, many requests in
flight), PreparedDataset per item and through the prefetching batch reader for every CPU backend, MONAI
PersistentDataset, and the region read (a `--patch`^3 region of a `--region-size`^3 volume against the
whole volume). `--device cuda:N` adds the GPU rows: the GPU ceiling (each shard file read whole by kvikio
into GPU memory, many threads, every read in flight), PreparedDataset batches into GPU memory per way
(auto, kvikio buffered and O_DIRECT, direct/posix staged through pinned memory), PersistentDataset +
`.cuda()` and MONAI GDSDataset; GPU rows also show their ratio to the host ceiling of the run (cold: the
O_DIRECT many-in-flight read). Each row prints volumes/s, GB/s and its ratios to the ceiling and to
PersistentDataset measured in the same run. Cold runs evict the page cache before
each timed pass (posix_fadvise DONTNEED, plus drop_caches as root).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loaders.backends import backend_names, get_backend
from loaders.errors import PrepError
from loaders.format import (
    SHARD_DIR,
    PreparedCache,
    ShardWriter,
    TensorEntry,
    make_rows,
    read_manifest,
    write_index,
    write_manifest,
    write_meta,
)
from workflows.bench.core import evict

HOST_BACKENDS = ("posix", "direct")
# (backend, row label, backend options) of the GPU rows; "auto" is what PreparedDataset(device=...) uses.
GPU_WAYS: list[tuple[str, str, dict[str, Any]]] = [
    ("auto", "auto", {}),
    ("kvikio", "kvikio only", {"direct_io": False, "stage_cold": False}),
    ("kvikio", "kvikio only, O_DIRECT", {"direct_io": True, "stage_cold": False}),
    ("direct", "direct, pinned", {}),
    ("posix", "posix, pinned", {}),
]


class Unavailable(Exception):  # noqa: N818  (a row that cannot run here: printed with its reason)
    """This row cannot run on this machine; the message says why."""


@dataclass
class Row:
    """One measured way of loading."""

    name: str
    group: str  # "volumes" or "region": ratios compare within a group
    items: int
    seconds: float
    nbytes: int
    kind: str  # "ceiling", "ours", "peer"

    @property
    def per_s(self) -> float:
        """Items per second."""
        return self.items / self.seconds if self.seconds > 0 else float("inf")

    @property
    def gb_s(self) -> float:
        """GB (1e9 bytes) per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# --- data ---
def make_cache(root: Path, count: int, shape: tuple[int, ...], seed: int = 0) -> PreparedCache:
    """A prepared cache of `count` synthetic volumes (image float32, label uint8), streamed to one shard."""
    spec = {"count": count, "shape": list(shape), "seed": seed}
    try:
        if read_manifest(root).get("bench") == spec:
            return PreparedCache(root)  # same data as last run: reuse
    except PrepError:
        pass
    (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    shard = f"{SHARD_DIR}/bench.bin"
    rng = np.random.default_rng(seed)
    rows, metas = [], []
    with ShardWriter(root / shard) as writer:
        for i in range(count):
            image = rng.random((1, *shape), dtype=np.float32)
            label = (image > 0.7).astype(np.uint8)
            arrays: tuple[np.ndarray, np.ndarray] = (image, label)
            for k, array in enumerate(arrays):
                offset, nbytes, xxh3 = writer.write(array)
                rows.append({"item": i, "key": k, "shard": 0, "offset": offset, "nbytes": nbytes,
                             "dtype": array.dtype.name, "shape": array.shape, "xxh3": xxh3})  # fmt: skip
            meta = {"affine": np.eye(4), "filename_or_obj": f"synthetic{i}.nii.gz"}
            metas.append({"source": {"item": i}, "meta": {"image": meta, "label": meta}})
    write_index(root, make_rows(rows))
    write_meta(root, metas)
    write_manifest(root, {"keys": ["image", "label"], "shards": [shard], "n_items": count, "bench": spec})
    return PreparedCache(root)


class _FromCache:
    """Deterministic 'transform' for the PersistentDataset peer: the same tensors, as MetaTensors."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, entry: dict[str, Any]) -> dict[str, Any]:
        from loaders.dataset import PreparedDataset

        return dict(PreparedDataset(self.root, backend="posix")[int(entry["item"])])


def _persistent(cache: PreparedCache, work: Path) -> Any:
    from monai.data import PersistentDataset
    from monai.transforms import Compose

    data = [{"item": i} for i in range(len(cache))]
    ds = PersistentDataset(data, Compose([_FromCache(cache.root)]), cache_dir=work / "pt")
    for i in range(len(ds)):  # writes the .pt files (untimed)
        ds[i]
    return ds


# --- timing ---
def _timed(
    name: str, group: str, kind: str, items: int, nbytes: int, run: Callable[[], Any], files: Iterable[str], cold: bool
) -> Row:
    files = list(files)
    # Warm-up pass under the timed pass's conditions (cold: evicted first, as paths that stage only cold
    # reads allocate their buffers there): one-time costs (pinned/device allocations, threads) are not timed.
    if cold:
        evict(files)
    run()
    if cold:
        evict(files)
    start = time.perf_counter()
    run()
    return Row(name, group, items, time.perf_counter() - start, nbytes, kind)


def _entries(cache: PreparedCache) -> list[TensorEntry]:
    return list(cache.iter_entries())


def fromfile_ceiling(entries: Sequence[TensorEntry]) -> None:
    """Every tensor's bytes with one np.fromfile each (the warm ceiling)."""
    for e in entries:
        np.fromfile(e.shard, np.uint8, count=e.nbytes, offset=e.offset)


def direct_ceiling(entries: Sequence[TensorEntry], threads: int = 16) -> Callable[[], None]:
    """Every tensor's bytes with O_DIRECT, all requests in flight at once (the cold ceiling)."""
    from loaders.backends import ReadRequest
    from loaders.backends.base import aligned_empty

    backend = get_backend("direct", threads=threads)
    requests = [ReadRequest(e.shard, e.offset, e.nbytes) for e in entries]
    buffers = [aligned_empty(e.nbytes) for e in entries]
    for b in buffers:
        b.fill(0)  # fault the pages in now: the ceiling times reads, not first-touch page faults
    return lambda: backend.read_into(requests, buffers)


def _items_of(
    ds: Any, to: Callable[[Any], Any] | None = None, sync: Callable[[], None] | None = None
) -> Callable[[], None]:
    def run() -> None:
        for i in range(len(ds)):
            item = ds[i]
            if to is not None:
                to(item)
        if sync is not None:
            sync()

    return run


def _batches_of(ds: Any, batch: int, sync: Callable[[], None] | None = None) -> Callable[[], None]:
    def run() -> None:
        for _ in ds.iter_batches(batch, prefetch=2):
            pass
        if sync is not None:
            sync()

    return run


# --- rows ---
def volume_rows(cache: PreparedCache, args: argparse.Namespace) -> list[Row | str]:
    """Ceiling, PreparedDataset per backend (items, batches), PersistentDataset: one list of rows/reasons."""
    from loaders.dataset import PreparedDataset

    entries = _entries(cache)
    shards = sorted({e.shard for e in entries})
    n, nbytes, cold = len(cache), sum(e.nbytes for e in entries), args.cold
    out: list[Row | str] = []

    def add(name: str, kind: str, make: Callable[[], Callable[[], Any]], files: Sequence[str] = shards) -> None:
        try:
            out.append(_timed(name, "volumes", kind, n, nbytes, make(), files, cold))
        except (Unavailable, PrepError, ImportError) as exc:
            out.append(f"{name}: not run ({exc})")

    if cold:
        add("ceiling O_DIRECT many-in-flight", "ceiling", lambda: direct_ceiling(entries, args.threads))
    else:
        add("ceiling np.fromfile", "ceiling", lambda: lambda: fromfile_ceiling(entries))
    for name in [b for b in backend_names() if b in HOST_BACKENDS and not args.gpu_only]:

        def items(b: str = name) -> Callable[[], None]:
            return _items_of(PreparedDataset(cache.root, backend=b))

        def batches(b: str = name) -> Callable[[], None]:
            return _batches_of(PreparedDataset(cache.root, backend=b), args.batch)

        add(f"PreparedDataset[{name}] items", "ours", items)
        add(f"PreparedDataset[{name}] batches", "ours", batches)
    persistent: list[Any] = []

    def peer() -> Callable[[], None]:
        persistent.append(_persistent(cache, args.work))
        return _items_of(persistent[0])

    add("MONAI PersistentDataset", "peer", peer, shards if not cold else _pt_files(args.work))
    if args.device.startswith("cuda"):
        out += gpu_rows(cache, args, persistent[0] if persistent else None)
    return out


def _pt_files(work: Path) -> list[str]:
    return sorted(str(p) for p in (work / "pt").glob("*.pt"))


def gpu_rows(cache: PreparedCache, args: argparse.Namespace, persistent: Any) -> list[Row | str]:
    """GPU rows (need a CUDA GPU): kvikio ceiling, PreparedDataset kvikio / pinned, peers + .cuda()."""
    from loaders._deps import cuda_available

    if not cuda_available():
        return ["GPU rows: not run (torch sees no CUDA/ROCm device here)"]
    import torch

    from loaders.dataset import PreparedDataset

    device = args.device
    entries = _entries(cache)
    shards = sorted({e.shard for e in entries})
    n, nbytes = len(cache), sum(e.nbytes for e in entries)
    sync = lambda: torch.cuda.synchronize(torch.device(device))  # noqa: E731
    out: list[Row | str] = []

    def add(name: str, kind: str, make: Callable[[], Callable[[], Any]], files: Sequence[str] = shards) -> None:
        try:
            out.append(_timed(name, "gpu", kind, n, nbytes, make(), files, args.cold))
        except (Unavailable, PrepError, ImportError, RuntimeError) as exc:
            out.append(f"{name}: not run ({str(exc).splitlines()[0]})")

    add("ceiling kvikio bulk", "ceiling", lambda: kvikio_ceiling(shards, device, args.threads))
    for backend, label, options in GPU_WAYS:

        def make(b: str = backend, o: dict[str, Any] = options) -> Callable[[], None]:
            ds = PreparedDataset(cache.root, backend=b, device=device, backend_options=o)
            return _batches_of(ds, args.batch, sync)

        add(f"PreparedDataset[{label}] cuda batches", "ours", make)
    _kvikio_direct_io_off()  # the O_DIRECT row set it process-wide; GDSDataset below reads through kvikio
    if args.gpu_items:

        def items() -> Callable[[], None]:
            return _items_of(PreparedDataset(cache.root, backend="auto", device=device), sync=sync)

        add("PreparedDataset[auto] cuda items", "ours", items)
    if persistent is not None:
        to_gpu = lambda item: [v.to(device) for v in item.values()]  # noqa: E731
        add(
            "MONAI PersistentDataset + .cuda()",
            "peer",
            lambda: _items_of(persistent, to_gpu, sync),
            _pt_files(args.work),
        )
    add("MONAI GDSDataset", "peer", lambda: _gds(cache, args, sync))
    return out


def _kvikio_direct_io_off() -> None:
    try:
        import kvikio.defaults

        kvikio.defaults.set("auto_direct_io_read", False)
    except (ImportError, KeyError, ValueError, RuntimeError, TypeError):
        pass  # no kvikio, or a version without the setting: nothing was changed


def kvikio_ceiling(shards: Sequence[str], device: str, threads: int = 16) -> Callable[[], None]:
    """Every shard file read whole by kvikio into one GPU buffer each, `threads` kvikio threads, 16 MiB
    tasks, every read in flight before the first wait: the bulk many-threaded kvikio read (GPU ceiling)."""
    from loaders._deps import require
    from loaders.backends.kvikio import _configure

    kvikio, cupy = require("kvikio", "the GPU ceiling"), require("cupy", "the GPU ceiling")
    task = 16 << 20
    _configure(kvikio, threads, task, None, direct_io=None)
    sizes = {s: Path(s).stat().st_size for s in shards}
    with cupy.cuda.Device(int(device.partition(":")[2] or 0)):
        buffers = {s: cupy.empty(max(n, 1), dtype=cupy.uint8) for s, n in sizes.items()}

    def run() -> None:
        handles = {s: kvikio.CuFile(s, "r") for s in shards}
        try:
            futures = [handles[s].pread(buffers[s], sizes[s], 0, task) for s in shards]
            got = [f.get() for f in futures]
            cupy.cuda.runtime.deviceSynchronize()
        finally:
            for h in handles.values():
                h.close()
        if got != [sizes[s] for s in shards]:
            raise Unavailable(f"kvikio read {sum(got)} of {sum(sizes.values())} bytes")

    return run


def _gds(cache: PreparedCache, args: argparse.Namespace, sync: Callable[[], None]) -> Callable[[], None]:
    from monai.data import GDSDataset
    from monai.transforms import Compose

    data = [{"item": i} for i in range(len(cache))]
    device = int(args.device.partition(":")[2] or 0)
    ds = GDSDataset(data, Compose([_FromCache(cache.root)]), cache_dir=args.work / "gds", device=device)
    for i in range(len(ds)):  # writes its cache (untimed)
        ds[i]
    return _items_of(ds, sync=sync)


def region_rows(root: Path, args: argparse.Namespace) -> list[Row | str]:
    """A --patch^3 region of a --region-size^3 volume (random places) against the whole volume; cold runs
    evict before every read, so neither side profits from the one before."""
    import loaders.region
    from loaders.dataset import PreparedDataset

    if args.region_request_us is not None or args.region_gbps is not None:  # the cold cost model, as measured
        base = loaders.region.COLD_COST
        loaders.region.COLD_COST = loaders.region.CostModel(
            base.request_s if args.region_request_us is None else args.region_request_us * 1e-6,
            base.bandwidth_bps if args.region_gbps is None else args.region_gbps * 1e9,
        )
    if args.region_inflight is not None:
        loaders.region.COLD_INFLIGHT = args.region_inflight
    cache = make_cache(root, 1, (args.region_size,) * 3, seed=1)
    shard = [str(cache.shards[0])]
    backend = args.region_backend or ("direct" if args.cold else "posix")
    ds = PreparedDataset(root, keys=["image"], backend=backend, meta=False)
    rng = np.random.default_rng(0)
    starts = [[int(rng.integers(0, args.region_size - args.patch + 1)) for _ in range(3)] for _ in range(args.reps)]
    patch = (1, args.patch, args.patch, args.patch)

    def timed(read: Callable[[list[int]], Any]) -> float:
        for s in starts[:2]:  # warm-up: builds the backend and buffers (and fills the page cache when warm)
            read(s)
        total = 0.0
        for s in starts:
            if args.cold:
                evict(shard)
            t0 = time.perf_counter()
            read(s)
            total += time.perf_counter() - t0
        return total

    full, part = cache.entries(0)[0].nbytes, args.patch**3 * 4
    whole = timed(lambda s: ds[0])
    region = timed(lambda s: ds.read_region(0, "image", (0, *s), patch))
    return [
        Row(f"whole volume {args.region_size}^3 [{backend}]", "region", args.reps, whole, full * args.reps, "peer"),
        Row(f"region {args.patch}^3 of it [{backend}]", "region", args.reps, region, part * args.reps, "ours"),
    ]


# --- report ---
def table(rows: Sequence[Row | str]) -> str:
    """The printed table: rate, GB/s and ratios to the ceiling and the peer of the same group."""
    done = [r for r in rows if isinstance(r, Row)]
    gpu = any(r.group == "gpu" for r in done)
    lines = [f"{'way':48} {'vol/s':>9} {'GB/s':>7} {'x ceiling':>9} {'x peer':>7}" + (" x cpu-ceil" if gpu else "")]
    host = next((c for c in done if c.group == "volumes" and c.kind == "ceiling"), None)
    for r in rows:
        if isinstance(r, str):
            lines.append(f"  {r}")
            continue
        ceiling = next((c for c in done if c.group == r.group and c.kind == "ceiling"), None)
        peer = next((p for p in done if p.group == r.group and p.kind == "peer"), None)
        vs_c = f"{r.per_s / ceiling.per_s:9.2f}" if ceiling and r is not ceiling else f"{'':9}"
        vs_p = f"{r.per_s / peer.per_s:7.2f}" if peer and r is not peer else f"{'':7}"
        # GPU rows also against the host ceiling of the same run (cold: O_DIRECT, the cold target)
        vs_h = f" {r.per_s / host.per_s:10.2f}" if r.group == "gpu" and host else ""
        lines.append(f"{r.name:48} {r.per_s:9.1f} {r.gb_s:7.2f} {vs_c} {vs_p}{vs_h}")
    if gpu and host:
        lines.append(f"(x cpu-ceil: GPU rows against '{host.name}' of this run)")
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m workflows.bench_loaders", description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=32, help="volumes in the synthetic cache")
    p.add_argument("--size", type=int, default=128, help="edge of each volume (size^3 voxels)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--warm", dest="cold", action="store_false", help="page cache warm (default)")
    mode.add_argument("--cold", dest="cold", action="store_true", help="evict the page cache before each pass")
    p.set_defaults(cold=False)
    p.add_argument("--batch", type=int, default=4, help="batch size of the prefetching batch reader")
    p.add_argument("--threads", type=int, default=16, help="requests in flight for the O_DIRECT ceiling")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (adds the GPU rows)")
    p.add_argument("--region-size", type=int, default=256, help="edge of the volume for the region read")
    p.add_argument("--patch", type=int, default=96, help="edge of the region read from it")
    p.add_argument("--reps", type=int, default=8, help="region reads (and whole-volume reads) timed")
    p.add_argument("--region-backend", default=None, help="backend for the region reads (posix warm, direct cold)")
    p.add_argument("--region-request-us", type=float, default=None, help="cold cost model: us per request")
    p.add_argument("--region-gbps", type=float, default=None, help="cold cost model: device GB/s")
    p.add_argument("--region-inflight", type=int, default=None, help="cold region requests in flight (cap)")
    p.add_argument("--no-region", dest="region", action="store_false", help="skip the region comparison")
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU PreparedDataset rows (ceiling, peer kept)")
    p.add_argument("--gpu-items", action="store_true", help="also time GPU item-by-item reads (auto backend)")
    p.add_argument("--work", type=Path, default=Path("bench_out/loaders"), help="scratch (caches are kept)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    args = parse(argv)
    if args.patch > args.region_size:
        print("error: --patch must not exceed --region-size", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    cache = make_cache(args.work / f"cache-{args.count}x{args.size}", args.count, (args.size,) * 3)
    rows = volume_rows(cache, args)
    if args.region:
        rows += region_rows(args.work / f"region-{args.region_size}", args)
    mode = "cold" if args.cold else "warm"
    print(f"# {args.count} volumes of {args.size}^3 (float32 image + uint8 label), {mode}, device {args.device}")
    print(table(rows))
    if args.json:
        doc = [asdict(r) | {"per_s": r.per_s, "gb_s": r.gb_s} if isinstance(r, Row) else {"skipped": r} for r in rows]
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
