"""The training benchmark's rows (`workflows/bench/train.py`): each way of feeding the same training loop.

The compute ceiling (one batch resident); MONAI's datasets under their loaders (PersistentDataset,
CacheDataset on the GPU, GDSDataset, SmartCacheDataset); blockprep's drop-in and its fast path
(`PreparedLoader`); and the transport references: what `DataLoader(W)` costs with no read (ready-made items,
the tail after the crop per item, `PersistentDataset`'s own outputs).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from workflows.bench.core import Unavailable
from workflows.bench.report import PERSISTENT as MONAI_PERSISTENT
from workflows.bench.train_loop import TrainOptions, TrainRow, time_loop, transform_of
from workflows.bench.workloads import WORKLOADS

KEYS = ("image", "label")
CEILING = "compute only (one batch resident, no transforms)"
PERSISTENT = f"{MONAI_PERSISTENT} + DataLoader"


def _loader_epochs(loader: Any, stop: Callable[[], None] | None = None) -> Callable[[int], Iterable[Any]]:
    def epochs(epoch: int) -> Iterable[Any]:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        return loader

    return epochs


def _chosen(loader: Any) -> Callable[[], bool]:
    """Asked at each epoch's start: whether `feeder="auto"` has chosen and its choice is warm. Where the batches
    came back to this process, the first epoch after is its warm-up (its own tail thread and draws starting, as
    every row's first epoch is) and is not timed either; so is the first epoch of a child the trial started in
    another's place (its device tier filled again, as the first child's was before the verdict)."""
    since_back = [0]
    last_pid: list[int | None] = [loader.feeder_pid]

    def chosen() -> bool:
        last, pid = last_pid[0], loader.feeder_pid
        last_pid[0] = pid
        if loader.feeder_verdict is None:
            return pid is None  # no feeder at all: nothing to choose
        if pid is not None:  # kept by the child, or another started in its place: ready before timing it
            loader.wait_feeder()
            return pid == last
        since_back[0] += 1
        return since_back[0] > 1

    return chosen


def ceiling(opts: TrainOptions, steps: int, device: str | None = None, ddp: bool = False,
            name: str = CEILING) -> TrainRow:  # fmt: skip
    """One batch resident on the device (`device`, else the options'), no transforms: the most the model can
    do (`ddp`: the DDP model of this rank, under torchrun)."""
    import torch

    shapes = WORKLOADS[opts.workload].ceiling(opts)
    if not shapes:
        raise Unavailable(f"{opts.workload} trains no model: no compute ceiling")
    g = torch.Generator().manual_seed(opts.seed)
    batch = {key: _made(shape, kind, g).to(device or opts.device) for key, (shape, kind) in shapes.items()}
    return time_loop(name, "ceiling", lambda e: (batch for _ in range(steps)), opts, device, ddp=ddp)


def _made(shape: tuple[int, ...], kind: str, g: Any) -> Any:
    """A random tensor of `shape` for a ceiling: class numbers, a binary label or float voxels."""
    import torch

    if kind == "class":
        return torch.randint(0, 6, shape, generator=g)
    value = torch.rand(shape, generator=g)
    return (value > 0.5).float() if kind == "binary" else value


class ReadyItems:
    """A map-style dataset of `n` ready-made items (key -> per-item shape and kind): the most any Dataset can give
    a training loop through `DataLoader(W)` (no read, no transform; each item fresh memory, as a transform's
    output is), so the rows under that DataLoader are held against what its own transport allows."""

    def __init__(self, n: int, shapes: dict[str, tuple[tuple[int, ...], str]], seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.templates = {key: _made(shape, kind, g) for key, (shape, kind) in shapes.items()}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {key: t.clone() for key, t in self.templates.items()}


class TailItems(ReadyItems):
    """ReadyItems, each run through the workload's tail after its crop, per item (MONAI's own transforms): what a
    Dataset that reads nothing still costs in `DataLoader(W)`'s workers when the user's tail runs per item there."""

    def __init__(self, n: int, shapes: dict[str, tuple[tuple[int, ...], str]], seed: int, tail: Any) -> None:
        super().__init__(n, shapes, seed)
        self.tail = tail

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.tail(super().__getitem__(index)))


def _fresh(value: Any) -> Any:
    """A transform's output made again: every tensor a copy (MetaTensors keep their meta), containers rebuilt."""
    import torch

    from loaders.cache.nesting import map_leaves

    return map_leaves(value, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


class PeerItems:
    """`PersistentDataset`'s own outputs for the first items (types, meta, `num_samples` lists), each handed
    out as a fresh copy: what any Dataset that returns what `PersistentDataset` returns costs `DataLoader(W)`
    to carry (collation of MetaTensors and their meta, the hand-over), with no read and no transform."""

    def __init__(self, n: int, made: list[Any]) -> None:
        self.n, self.made = n, made

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return _fresh(self.made[index % len(self.made)])


def transport_peer(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> TrainRow:
    """`DataLoader(W)` over `PeerItems` (the `transport-peer` row), into the same training loop."""
    if WORKLOADS[opts.workload].thread_loader:
        raise Unavailable(f"{opts.workload}: its peers run no DataLoader workers (no transport to measure)")
    ds = _persistent_dataset(datalist, pipeline, opts, work)
    made = [ds[i] for i in range(min(len(ds), 8))]
    loader = _dataloader(PeerItems(len(ds), made), opts, opts.workers)
    name = f"DataLoader({opts.workers}) alone: PersistentDataset's own outputs, made ahead, copied per item"
    return time_loop(name, "reference", _loader_epochs(loader), opts)


class CropItems(PeerItems):
    """MONAI's own crops of `PersistentDataset`'s cached head outputs (MetaTensors, their meta and applied
    operations), made once; each item a fresh copy run through the tail after the crop: what the tail costs
    per item on what a drop-in hands it, with no read and no crop draw."""

    def __init__(self, n: int, made: list[Any], tail: Any) -> None:
        super().__init__(n, made)
        self.tail = tail

    def __getitem__(self, index: int) -> Any:
        return self.tail(super().__getitem__(index))


def transport_tail_meta(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> TrainRow:
    """`DataLoader(W)` over `CropItems` (the `transport-tail-meta` row), into the same training loop."""
    from loaders.cache.chain import split
    from loaders.fast.folds import is_fold_crop

    _, tail = split(transform_of(pipeline, opts.seed))
    if WORKLOADS[opts.workload].thread_loader or not tail or not is_fold_crop(tail[0]):
        raise Unavailable(f"{opts.workload}: no crop first in its tail, or no DataLoader workers (see transport-peer)")
    ds = _persistent_dataset(datalist, pipeline, opts, work)
    made = [tail[0](_fresh(ds._cachecheck(ds.data[i]))) for i in range(min(len(ds), 8))]
    loader = _dataloader(CropItems(len(ds), made, _after_crop(pipeline, opts)), opts, opts.workers)
    name = f"DataLoader({opts.workers}) + the tail after the crop per item: MONAI's own crops (MetaTensors), made ahead"
    return time_loop(name, "reference", _loader_epochs(loader), opts)


def transport(opts: TrainOptions, pipeline: Path | None = None) -> TrainRow:
    """`DataLoader(W)` (the peers' settings) over `ReadyItems` of the batch's shapes, into the same training loop;
    with `pipeline`, each item runs through the tail after the crop (`TailItems`: the `transport-tail` row)."""
    work = WORKLOADS[opts.workload]
    shapes = work.ceiling(opts)
    if not shapes or work.thread_loader:
        raise Unavailable(f"{opts.workload}: its peers run no DataLoader workers (no transport to measure)")
    rows = next(iter(shapes.values()))[0][0]  # rows of a batch: batch x samples
    n, per_item = opts.count // opts.batch * rows, {k: (s[1:], kind) for k, (s, kind) in shapes.items()}
    if pipeline is None:
        items = ReadyItems(n, per_item, opts.seed)
        name = f"DataLoader({opts.workers}) alone: ready-made items of the batch's shapes, no read, no transform"
    else:
        items = TailItems(n, per_item, opts.seed, _after_crop(pipeline, opts))
        name = f"DataLoader({opts.workers}) + the tail after the crop per item: ready-made crops, no read"
    loader = _dataloader(items, opts, opts.workers, batch=rows)
    return time_loop(name, "reference", _loader_epochs(loader), opts)


def _after_crop(pipeline: Path, opts: TrainOptions) -> Any:
    """The workload's tail after its first (crop) transform, as one Compose with the chain's options."""
    from monai.transforms import Compose

    from loaders.cache.chain import split
    from loaders.fast.folds import is_fold_crop

    full = transform_of(pipeline, opts.seed)
    _, tail = split(full)
    rest = tail[1:] if tail and is_fold_crop(tail[0]) else tail
    return Compose(rest, map_items=full.map_items, unpack_items=full.unpack_items)


def _datalist(datalist: Path) -> list[dict[str, Any]]:
    from workflows.bench.peers import datalist_items

    return datalist_items(datalist)


def _dataloader(dataset: Any, opts: TrainOptions, workers: int, threads: bool = False, batch: int = 0) -> Any:
    import torch
    from monai.data import DataLoader, ThreadDataLoader

    g = torch.Generator().manual_seed(opts.seed)
    if WORKLOADS[opts.workload].thread_loader:  # as the seed runs it: ThreadDataLoader, batch 1, no workers
        return ThreadDataLoader(dataset, batch_size=opts.batch, shuffle=True, generator=g)
    if threads:
        return ThreadDataLoader(dataset, batch_size=opts.batch, shuffle=True, drop_last=True, generator=g,
                                num_workers=workers, use_thread_workers=workers > 0)  # fmt: skip
    return DataLoader(dataset, batch_size=batch or opts.batch, shuffle=True, drop_last=True, generator=g,
                      num_workers=workers, pin_memory=opts.gpu, persistent_workers=workers > 0)  # fmt: skip


def persistent(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> TrainRow:
    """MONAI PersistentDataset (.pt files) + DataLoader(W workers), tail on CPU."""
    ds = _persistent_dataset(datalist, pipeline, opts, work)
    return time_loop(persistent_name(opts), "peer", _loader_epochs(_dataloader(ds, opts, opts.workers)), opts)


def _persistent_dataset(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> Any:
    """The workload's MONAI PersistentDataset, its .pt files kept under `work` between rows and runs."""
    from monai.data import PersistentDataset

    where = persistent_dir(opts, work)
    return PersistentDataset(_datalist(datalist), transform_of(pipeline, opts.seed), cache_dir=where)


def persistent_dir(opts: TrainOptions, work: Path) -> Path:
    """Where the workload's PersistentDataset keeps its .pt files (shared by every size of the workload)."""
    return work / ("persistent" if opts.workload == "spheres" else f"persistent_{opts.workload}")


def persistent_name(opts: TrainOptions) -> str:
    """The reference peer's row name: PersistentDataset under the workload's DataLoader."""
    if WORKLOADS[opts.workload].thread_loader:
        return f"{MONAI_PERSISTENT} + ThreadDataLoader(batch {opts.batch})"
    return f"{PERSISTENT}({opts.workers})"


def data_name(opts: TrainOptions) -> str:
    """The data column of a workload's rows (ratios are taken within it)."""
    return "train" if opts.workload == "spheres" else opts.workload


def cache_gpu(datalist: Path, pipeline: Path, opts: TrainOptions, budget: int, nbytes: int) -> TrainRow:
    """MONAI's fast-training recipe: CacheDataset resident on the GPU + GPU tail + ThreadDataLoader."""
    import torch
    from monai.data import CacheDataset
    from monai.transforms import Compose, EnsureTyped

    from loaders.cache import chain

    _require_gpu(opts, "the GPU-resident CacheDataset recipe")
    if nbytes > budget:
        raise Unavailable(f"the dataset ({nbytes / 2**30:.1f} GiB) exceeds --gpu-budget ({budget / 2**30:.1f} GiB)")
    head, tail = chain.split(transform_of(pipeline, opts.seed))
    keys = ["image"] if opts.workload == "mednist" else list(KEYS)
    to_gpu = EnsureTyped(keys=keys, device=torch.device(opts.device), track_meta=False)
    transform = Compose([*head, to_gpu, *tail])
    transform.set_random_state(seed=opts.seed)
    ds = CacheDataset(_datalist(datalist), transform, cache_rate=1.0, num_workers=opts.workers, progress=False)
    name = "monai CacheDataset on GPU + GPU tail + ThreadDataLoader"
    return time_loop(name, "peer", _loader_epochs(_dataloader(ds, opts, 0, threads=True)), opts)


def gds(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> TrainRow:
    """MONAI GDSDataset (kvikio into GPU memory, tail on the GPU) + ThreadDataLoader."""
    _require_gpu(opts, "monai GDSDataset")
    try:
        import torch
        from monai.data import GDSDataset

        index = torch.device(opts.device).index or 0
        ds = GDSDataset(_datalist(datalist), transform_of(pipeline, opts.seed), cache_dir=work / "gds", device=index)
        for _ in range(2):  # the first pass writes its cache, the second reads it back (what epochs do)
            for i in range(len(ds)):
                ds[i]
    except Exception as exc:  # noqa: BLE001  (cupy/kvikio missing or unusable: one line, the run goes on)
        raise Unavailable(f"monai GDSDataset cannot run here: {str(exc).splitlines()[0][:160]}") from exc
    loader = _dataloader(ds, opts, 0, threads=True)
    return time_loop("monai GDSDataset + ThreadDataLoader", "peer", _loader_epochs(loader), opts)


def smart_cache(datalist: Path, pipeline: Path, opts: TrainOptions) -> TrainRow:
    """MONAI SmartCacheDataset (half the items in RAM, 20% replaced per epoch) + ThreadDataLoader, tail on CPU."""
    from monai.data import SmartCacheDataset

    data = _datalist(datalist)
    ds = SmartCacheDataset(data, transform_of(pipeline, opts.seed), replace_rate=0.2, cache_num=max(opts.batch,
                           len(data) // 2), num_init_workers=opts.workers, num_replace_workers=opts.workers,
                           progress=False)  # fmt: skip
    loader = _dataloader(ds, opts, 0, threads=True)

    def epochs(epoch: int) -> Iterator[Any]:
        if epoch == 0:
            ds.start()
        yield from loader
        ds.update_cache()

    try:
        return time_loop("monai SmartCacheDataset + ThreadDataLoader", "peer", epochs, opts)
    finally:
        ds.shutdown()


def drop_in(datalist: Path, pipeline: Path, cache: Path, opts: TrainOptions, threads: bool) -> TrainRow:
    """blockprep PreparedPersistentDataset (the one-line drop-in) under DataLoader or ThreadDataLoader."""
    from loaders import PreparedPersistentDataset

    ds = PreparedPersistentDataset(_datalist(datalist), transform_of(pipeline, opts.seed), cache)
    loader = _dataloader(ds, opts, opts.workers, threads=threads)
    kind = f"ThreadDataLoader({opts.workers} threads)" if threads else f"DataLoader({opts.workers})"
    if WORKLOADS[opts.workload].thread_loader:
        if threads:
            raise Unavailable(f"{opts.workload} runs its loaders as the seed does (ThreadDataLoader, batch 1): one row")
        kind = f"ThreadDataLoader(batch {opts.batch})"
    return time_loop(f"blockprep PreparedPersistentDataset + {kind}", "ours", _loader_epochs(loader), opts)


def fast_path(
    pipeline: Path, cache: Path, opts: TrainOptions, budget: int | str, label: str, **options: Any
) -> TrainRow:
    """blockprep PreparedLoader: crop folded into the read, batched tail on the device, overlap, GPU tier."""
    serving = options.pop("serving", False)  # a long run's steady state: the feeder's start (seconds) waited out
    settled = options.pop("settled", False)  # ... or trained untimed until feeder="auto" has chosen (trial.py)
    bricks = options.pop("bricks", False)  # the cache's bricks written first (untimed), removed after the row
    graphs = options.pop("tail_graphs", None)  # "fast-settled@tail_graphs=False": the tail's kernels one by one
    pack = options.pop("pack_ahead", None)  # "fast-settled@pack_ahead=False": the child hands over at the credit
    ahead = options.pop("capture_ahead", None)  # "fast-settled@capture_ahead=False": each capture opened where it is
    replay = options.pop("tail_replay", None)  # "fast-auto@feeder=False;tail_replay=True": planned tails replayed
    patterns = options.pop("tail_patterns", None)  # "...;tail_replay=True;tail_patterns=6": on the fired rows
    host = options.pop("host_feed", None)  # "...@host_feed=True": a child on the CPU; ='auto': one tried
    draws = options.pop("device_draws", None)  # "...@host_feed=True;device_draws=False": offsets drawn on the host
    margin = options.pop("host_take_margin", None)  # "...@host_feed=True;host_take_margin=3": the take's margin, ms
    augment = options.pop("augment", True)  # "fast-settled@augment=False": the chain without its augmentations
    with _tunable("TAIL_GRAPHS", graphs), _tunable("PACK_AHEAD", pack), _tunable("CAPTURE_AHEAD", ahead), \
            _tunable("TAIL_REPLAY", replay), _tunable("TAIL_PATTERNS", patterns), \
            _tunable("HOST_FEED", host), _tunable("DEVICE_DRAWS", draws), \
            _tunable("HOST_TAKE_MARGIN", margin):  # fmt: skip
        return _fast_row(pipeline, cache, opts, budget, label, serving, settled, bricks, options, augment)


def unaugmented(transform: Any) -> Any:
    """`transform` (a MONAI Compose) without the random transforms after its crop: the same reads, crops and
    hand-over, the deterministic ones after the crop kept (a squeeze the model needs), the augmentations gone.
    Against the defaults, what the augmentations cost the step."""
    from loaders.fast.folds import is_fold_crop

    ts = list(transform.transforms)
    crops = [i for i, t in enumerate(ts) if is_fold_crop(t)]
    if not crops:
        raise Unavailable("augment=False: the chain has no crop the loader folds, so no augmentations after it")
    kept = ts[: crops[-1] + 1] + [t for t in ts[crops[-1] + 1 :] if not hasattr(t, "set_random_state")]
    transform.transforms = tuple(kept)
    return transform


@contextlib.contextmanager
def _tunable(name: str, on: bool | int | str | None) -> Iterator[None]:
    """`loaders.tunables.<name>` (TAIL_GRAPHS, PACK_AHEAD, CAPTURE_AHEAD, TAIL_REPLAY, HOST_FEED, DEVICE_DRAWS: on
    or off, HOST_FEED also "auto"; TAIL_PATTERNS: a count; HOST_TAKE_MARGIN: milliseconds or "auto") and its
    environment variable BLOCKPREP_<name> (which the feeder's process reads) set for one row, then put back; None
    leaves them."""
    from loaders import tunables

    if on is None:
        yield
        return
    var = f"BLOCKPREP_{name}"
    before, env = getattr(tunables, name), os.environ.get(var)
    count = not isinstance(on, (bool, str))
    value = (float(on) if name == "HOST_TAKE_MARGIN" else int(on)) if count else on
    setattr(tunables, name, value)
    os.environ[var] = str(value) if count else on if isinstance(on, str) else "1" if on else "0"
    try:
        yield
    finally:
        setattr(tunables, name, before)
        if env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = env


def _fast_row(
    pipeline: Path, cache: Path, opts: TrainOptions, budget: int | str, label: str, serving: bool, settled: bool,
    bricks: bool, options: dict[str, Any], augment: bool = True,
) -> TrainRow:  # fmt: skip
    from loaders.fast.loader import PreparedLoader
    from prep.bricks import build_bricks, drop_bricks

    drop_bricks(cache)
    made = time.perf_counter()
    if bricks:
        build_bricks(cache)
        label = f"{label} in {time.perf_counter() - made:.1f} s"
    setup_s = time.perf_counter() - made
    transform = transform_of(pipeline, opts.seed)
    loader = PreparedLoader(cache, transform if augment else unaugmented(transform), opts.batch, device=opts.device,
                            gpu_budget=budget, seed=opts.seed, **options)  # fmt: skip
    loader.set_random_state(opts.seed)
    if serving:
        loader.wait_feeder()
    chosen = _chosen(loader) if settled else None
    try:
        row = time_loop(f"blockprep PreparedLoader, {label}", "ours", _loader_epochs(loader), opts, settled=chosen)
        row.setup_s = setup_s
        row.extra["GPU tier GB"] = loader.tier_bytes / 1e9
        if loader.feeder_verdict is not None:
            row.note = f"{row.note}; {loader.feeder_verdict}".lstrip("; ")
        if loader.feeder_pid is not None:  # the batches' own process: its CPU over the row (warm epoch included)
            row.extra["feeder CPU s"] = _cpu_seconds(loader.feeder_pid)
            row.extra["feeder"] = loader.feeder_kind
    finally:
        loader.close()
        drop_bricks(cache)
    return row


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc; 0.0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _require_gpu(opts: TrainOptions, what: str) -> None:
    from loaders.deps import cuda_available

    if not opts.gpu or not cuda_available():
        raise Unavailable(f"{what} needs a CUDA GPU (this run is on {opts.device})")


def gpu_budget(opts: TrainOptions) -> int:
    """--gpu-budget in bytes; default: the device's free memory less 8 GiB for the model (0 on CPU)."""
    from loaders.fast.loader import parse_bytes

    if opts.gpu_budget is not None:
        return parse_bytes(opts.gpu_budget)
    if not opts.gpu:
        return 1 << 62
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(opts.device))
    return max(0, free - (8 << 30))
