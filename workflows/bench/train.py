"""Training benchmark: steps/s of a real MONAI 3D UNet loop, and how much of each step waits for data.

    python -m workflows.benchmark train --size 160 --crop 96 --batch 4 --count 48 --device cuda:0
    torchrun --nproc-per-node 2 -m workflows.benchmark train --ddp --device cuda    # one row over 2 GPUs

The data is made here (`prep synth nifti` + `prep cache`) with the pipeline LoadImaged, EnsureChannelFirstd,
ScaleIntensityd | RandSpatialCropd(crop), RandFlipd, RandScaleIntensityd. Every row trains a fresh
UNet (channels 16-32-64-128, strides 2, DiceLoss, Adam, bf16 autocast on CUDA) for `epochs` epochs;
the first fills caches and is not timed. Data wait = time in `next(batch)` and the copy to the device,
with the device synchronised after every step so compute is not counted as waiting.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workflows.bench.core import Unavailable

KEYS = ("image", "label")
CEILING = "compute only (one batch resident, no transforms)"
PERSISTENT = "monai PersistentDataset + DataLoader"


@dataclass
class TrainOptions:
    """What one training benchmark run uses."""

    size: int = 160
    crop: int = 96
    batch: int = 4
    epochs: int = 4
    workers: int = 8
    device: str = "cuda:0"
    count: int = 48
    gpu_budget: str | None = None  # caps GPU-resident peers; None: the device's free memory
    channels: tuple[int, ...] = (16, 32, 64, 128)
    out: Path = Path("bench_out/train")
    seed: int = 0
    rows: tuple[str, ...] = ()  # only these rows (names as in ROWS); empty: all

    @property
    def gpu(self) -> bool:
        """True when training on a CUDA device."""
        return self.device.startswith("cuda")


@dataclass
class TrainRow:
    """One way of feeding the loop: what it measured."""

    name: str
    kind: str  # "ceiling", "peer", "ours"
    steps: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        """Timed steps per second."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """Share of step time blocked on the next batch (0..1)."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0


def pipeline_source(crop: int) -> str:
    """PIPELINE.py text of the benchmark's pipeline with a `crop`^3 random crop."""
    return f'''"""Training benchmark pipeline: deterministic head | random tail ({crop}^3 crop, flip, intensity)."""
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, RandFlipd, RandScaleIntensityd,
                              RandSpatialCropd, ScaleIntensityd)

KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    ScaleIntensityd(keys="image"),
    RandSpatialCropd(keys=KEYS, roi_size=({crop}, {crop}, {crop}), random_size=False),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
    RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
])
'''


def build_data(opts: TrainOptions, work: Path) -> tuple[Path, Path, Path]:
    """(datalist, pipeline, cache): synthetic volumes and their prepared cache, reused when present."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = work / f"train_{opts.count}x{opts.size}_crop{opts.crop}"
    root.mkdir(parents=True, exist_ok=True)
    pipeline = root / "pipeline.py"
    pipeline.write_text(pipeline_source(opts.crop))
    datalist = root / "nifti" / "dataset.json"
    if not datalist.is_file():
        nifti_dataset(root / "nifti", count=opts.count, size=opts.size, seed=opts.seed)
    cache = root / "cache"
    if not (cache / "manifest.json").is_file():
        prepare_cache(datalist, pipeline, cache, workers=max(1, min(opts.workers, os.cpu_count() or 1)))
    return datalist, pipeline, cache


def transform_of(pipeline: Path, seed: int) -> Any:
    """A fresh full transform from PIPELINE.py, its random tail seeded."""
    from prep.pipeline import load_pipeline

    transform = load_pipeline(pipeline).transform
    transform.set_random_state(seed=seed)
    return transform


def make_step(opts: TrainOptions, device: str, ddp: bool = False) -> Callable[[Any, Any], float]:
    """One training step (forward, DiceLoss, backward, Adam) of a fresh UNet; returns nothing to sync on."""
    import torch
    from monai.losses import DiceLoss
    from monai.networks.nets import UNet

    torch.manual_seed(opts.seed)
    model: Any = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=opts.channels,
                      strides=(2,) * (len(opts.channels) - 1), num_res_units=2).to(device)  # fmt: skip
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if opts.gpu else None)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = DiceLoss(to_onehot_y=True, softmax=True)
    cuda = device.startswith("cuda")

    def step(image: Any, label: Any) -> float:
        optimiser.zero_grad(set_to_none=True)
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(image), label)
        loss.backward()
        optimiser.step()
        return 0.0

    return step


def _tensor(x: Any, device: str) -> Any:
    x = x.as_tensor() if hasattr(x, "as_tensor") else x
    return x.to(device, non_blocking=True)


def time_loop(name: str, kind: str, epochs: Callable[[int], Iterable[Any]], opts: TrainOptions,
              device: str | None = None, ddp: bool = False, note: str = "") -> TrainRow:  # fmt: skip
    """Train `opts.epochs` epochs over `epochs(e)`; time every epoch after the first."""
    import torch

    device = device or opts.device
    step = make_step(opts, device, ddp)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    row = TrainRow(name, kind, note=note)
    for epoch in range(opts.epochs):
        batches = iter(epochs(epoch))
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            image, label = _tensor(batch["image"], device), _tensor(batch["label"], device)
            sync()
            t1 = time.perf_counter()
            step(image, label)
            sync()
            if epoch > 0:
                row.steps += 1
                row.wait_seconds += t1 - t0
                row.seconds += time.perf_counter() - t0
    if row.steps == 0:
        raise Unavailable(f"{name}: no timed steps (need --epochs >= 2 and count >= batch)")
    return row


def _loader_epochs(loader: Any, stop: Callable[[], None] | None = None) -> Callable[[int], Iterable[Any]]:
    def epochs(epoch: int) -> Iterable[Any]:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        return loader

    return epochs


def ceiling(opts: TrainOptions, steps: int) -> TrainRow:
    """One batch resident on the device, no transforms: the most the model can do."""
    import torch

    g = torch.Generator().manual_seed(opts.seed)
    shape = (opts.batch, 1, opts.crop, opts.crop, opts.crop)
    batch = {"image": torch.rand(shape, generator=g).to(opts.device),
             "label": (torch.rand(shape, generator=g) > 0.5).float().to(opts.device)}  # fmt: skip
    return time_loop(CEILING, "ceiling", lambda e: (batch for _ in range(steps)), opts)


def _datalist(datalist: Path) -> list[dict[str, Any]]:
    from workflows.bench.peers import datalist_items

    return datalist_items(datalist)


def _dataloader(dataset: Any, opts: TrainOptions, workers: int, threads: bool = False) -> Any:
    import torch
    from monai.data import DataLoader, ThreadDataLoader

    g = torch.Generator().manual_seed(opts.seed)
    if threads:
        return ThreadDataLoader(dataset, batch_size=opts.batch, shuffle=True, drop_last=True, generator=g,
                                num_workers=workers, use_thread_workers=workers > 0)  # fmt: skip
    return DataLoader(dataset, batch_size=opts.batch, shuffle=True, drop_last=True, generator=g, num_workers=workers,
                      pin_memory=opts.gpu, persistent_workers=workers > 0)  # fmt: skip


def persistent(datalist: Path, pipeline: Path, opts: TrainOptions, work: Path) -> TrainRow:
    """MONAI PersistentDataset (.pt files) + DataLoader(W workers), tail on CPU."""
    from monai.data import PersistentDataset

    ds = PersistentDataset(_datalist(datalist), transform_of(pipeline, opts.seed), cache_dir=work / "persistent")
    return time_loop(f"{PERSISTENT}({opts.workers})", "peer", _loader_epochs(_dataloader(ds, opts, opts.workers)), opts)


def cache_gpu(datalist: Path, pipeline: Path, opts: TrainOptions, budget: int, nbytes: int) -> TrainRow:
    """MONAI's fast-training recipe: CacheDataset resident on the GPU + GPU tail + ThreadDataLoader."""
    import torch
    from monai.data import CacheDataset
    from monai.transforms import Compose, EnsureTyped

    from loaders import chain

    _require_gpu(opts, "the GPU-resident CacheDataset recipe")
    if nbytes > budget:
        raise Unavailable(f"the dataset ({nbytes / 2**30:.1f} GiB) exceeds --gpu-budget ({budget / 2**30:.1f} GiB)")
    head, tail = chain.split(transform_of(pipeline, opts.seed))
    to_gpu = EnsureTyped(keys=list(KEYS), device=torch.device(opts.device), track_meta=False)
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
        ds[0]
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
    from loaders.monai import PreparedPersistentDataset

    ds = PreparedPersistentDataset(_datalist(datalist), transform_of(pipeline, opts.seed), cache)
    loader = _dataloader(ds, opts, opts.workers, threads=threads)
    kind = f"ThreadDataLoader({opts.workers} threads)" if threads else f"DataLoader({opts.workers})"
    return time_loop(f"blockprep PreparedPersistentDataset + {kind}", "ours", _loader_epochs(loader), opts)


def fast_path(pipeline: Path, cache: Path, opts: TrainOptions, budget: int, label: str, **options: Any) -> TrainRow:
    """blockprep PreparedLoader: crop folded into the read, batched tail on the device, overlap, GPU tier."""
    from loaders.feed import PreparedLoader

    loader = PreparedLoader(cache, transform_of(pipeline, opts.seed), opts.batch, device=opts.device,
                            gpu_budget=budget, seed=opts.seed, **options)  # fmt: skip
    loader.set_random_state(opts.seed)
    try:
        row = time_loop(f"blockprep PreparedLoader, {label}", "ours", _loader_epochs(loader), opts)
    finally:
        loader.close()
    row.extra["tier_bytes"] = loader.tier_bytes
    return row


def _require_gpu(opts: TrainOptions, what: str) -> None:
    from loaders._deps import cuda_available

    if not opts.gpu or not cuda_available():
        raise Unavailable(f"{what} needs a CUDA GPU (this run is on {opts.device})")


def gpu_budget(opts: TrainOptions) -> int:
    """--gpu-budget in bytes; default: the device's free memory less 8 GiB for the model (0 on CPU)."""
    from loaders.feed import parse_bytes

    if opts.gpu_budget is not None:
        return parse_bytes(opts.gpu_budget)
    if not opts.gpu:
        return 1 << 62
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(opts.device))
    return max(0, free - (8 << 30))


def run(opts: TrainOptions, work: Path) -> tuple[list[TrainRow], list[tuple[str, str]]]:
    """Every row that applies here, in one run; returns (rows, [(row, why it could not run)])."""
    from loaders.feed import dataset_bytes

    datalist, pipeline, cache = build_data(opts, work)
    nbytes = dataset_bytes(cache)
    budget = gpu_budget(opts)
    steps = opts.count // opts.batch
    half = nbytes // 2
    jobs: list[tuple[str, Callable[[], TrainRow]]] = [
        ("ceiling", lambda: ceiling(opts, steps)),
        ("persistent", lambda: persistent(datalist, pipeline, opts, work)),
        ("cache-gpu", lambda: cache_gpu(datalist, pipeline, opts, budget, nbytes)),
        ("gds", lambda: gds(datalist, pipeline, opts, work)),
        ("smart-cache", lambda: smart_cache(datalist, pipeline, opts)),
        ("drop-in", lambda: drop_in(datalist, pipeline, cache, opts, threads=False)),
        ("drop-in-threads", lambda: drop_in(datalist, pipeline, cache, opts, threads=True)),
        ("fast", lambda: fast_path(pipeline, cache, opts, 0, "no GPU tier (page cache), crop read")),
        ("fast-whole", lambda: fast_path(pipeline, cache, opts, 0, "no GPU tier, whole reads", crop_read=False)),
        ("fast-half", lambda: fast_path(pipeline, cache, opts, half, "GPU tier = half the dataset")),
        ("fast-budget", lambda: fast_path(pipeline, cache, opts, min(budget, nbytes), "GPU tier = --gpu-budget")),
    ]
    rows: list[TrainRow] = []
    skipped: list[tuple[str, str]] = []
    for key, job in jobs:
        if opts.rows and key not in opts.rows and key != "ceiling":
            continue
        try:
            row = job()
        except Unavailable as exc:
            skipped.append((key, str(exc).splitlines()[0]))
            print(f"  unavailable: {key}: {skipped[-1][1]}", flush=True)
            continue
        row.extra["key"] = key
        rows.append(row)
        print(f"  {row.name}: {row.steps_per_s:.1f} steps/s, waiting {100 * row.wait_share:.0f}%", flush=True)
    return rows, skipped


def ratios(rows: list[TrainRow]) -> list[dict[str, Any]]:
    """Rows as dicts with steps/s, wait share, x ceiling and x PersistentDataset."""
    top = next((r for r in rows if r.kind == "ceiling"), None)
    base = next((r for r in rows if r.name.startswith(PERSISTENT)), None)
    out = []
    for r in rows:
        d = asdict(r)
        d.update(steps_per_s=r.steps_per_s, wait_share=r.wait_share, data="train", items_per_s=r.steps_per_s,
                 x_ceiling=r.steps_per_s / top.steps_per_s if top and top.steps_per_s else None,
                 x_persistent=r.steps_per_s / base.steps_per_s if base and base.steps_per_s else None)  # fmt: skip
        out.append(d)
    return out


def table(rows: list[dict[str, Any]], skipped: list[tuple[str, str]]) -> str:
    """Fixed-width text table; rows that could not run are named under it."""
    cols = ("way", "steps/s", "waiting", "x ceiling", "x PersistentDataset")

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    cells = [[r["name"], f"{r['steps_per_s']:.1f}", f"{100 * r['wait_share']:.0f}%", f(r["x_ceiling"]),
              f(r["x_persistent"])] for r in rows]  # fmt: skip
    widths = [max(len(c) for c in col) for col in zip(cols, *cells)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*cols), line.format(*("-" * w for w in widths)), *(line.format(*c) for c in cells)]
    out += [f"unavailable: {k}: {why}" for k, why in skipped]
    return "\n".join(s.rstrip() for s in out)


def write(out: Path, rows: list[dict[str, Any]], skipped: list[tuple[str, str]], opts: TrainOptions) -> list[Path]:
    """train.csv, train.json and train.png under `out`."""
    import platform

    out.mkdir(parents=True, exist_ok=True)
    fields = ["name", "kind", "steps", "seconds", "wait_seconds", "steps_per_s", "wait_share", "x_ceiling",
              "x_persistent", "note"]  # fmt: skip
    with open(out / "train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    env = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
           "cpus": os.cpu_count(), "options": {k: str(v) for k, v in asdict(opts).items()}}  # fmt: skip
    if opts.gpu:
        import torch

        env["gpu"] = torch.cuda.get_device_name(torch.device(opts.device))
    doc = {"environment": env, "results": rows, "unavailable": dict(skipped)}
    (out / "train.json").write_text(json.dumps(doc, indent=1, default=str))
    paths = [out / "train.csv", out / "train.json"]
    if rows:
        from workflows.bench.report import plot

        plot(rows, out / "train.png", title=f"training steps/s, {opts.device}, batch {opts.batch}, {opts.crop}^3")
        paths.append(out / "train.png")
    return paths


def parse(argv: list[str] | None = None) -> tuple[TrainOptions, bool]:
    """Command-line options of `python -m workflows.benchmark train`; (options, ddp)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m workflows.benchmark train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    d = TrainOptions()
    p.add_argument("--size", type=int, default=d.size, help="volume edge in voxels (default 160)")
    p.add_argument("--crop", type=int, default=d.crop, help="random crop edge (default 96)")
    p.add_argument("--batch", type=int, default=d.batch, help="items per step (default 4)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs per row; the first is not timed (default 4)")
    p.add_argument("--workers", type=int, default=d.workers, help="DataLoader workers of the peers (default 8)")
    p.add_argument("--device", default=d.device, help="cuda:N or cpu (default cuda:0)")
    p.add_argument("--count", type=int, default=d.count, help="volumes in the dataset (default 48)")
    p.add_argument("--gpu-budget", default=None, help="bytes GPU-resident peers may hold, e.g. 8GiB")
    p.add_argument("--channels", type=int, nargs="+", default=list(d.channels), help="UNet channels per level")
    p.add_argument("--rows", nargs="*", default=[], help="only these rows (ceiling always): persistent cache-gpu "
                   "gds smart-cache drop-in drop-in-threads fast fast-whole fast-half fast-budget")  # fmt: skip
    p.add_argument("--out", type=Path, default=d.out, help="folder for train.csv/json/png (default bench_out/train)")
    p.add_argument("--ddp", action="store_true", help="run under torchrun: the fast path over every rank's GPU")
    a = p.parse_args(argv)
    if a.epochs < 2 or a.batch < 1 or a.count < a.batch or a.crop > a.size:
        p.error("need --epochs >= 2, --count >= --batch >= 1 and --crop <= --size")
    opts = TrainOptions(a.size, a.crop, a.batch, a.epochs, a.workers, a.device, a.count, a.gpu_budget,
                        tuple(a.channels), a.out, rows=tuple(a.rows))  # fmt: skip
    return opts, a.ddp


def main(argv: list[str] | None = None) -> int:
    """Entry of `python -m workflows.benchmark train`; returns the exit status."""
    opts, ddp = parse(argv)
    if ddp:
        from workflows.bench.train_ddp import main_ddp

        return main_ddp(opts)
    print(f"train benchmark: {opts.count} x {opts.size}^3, crop {opts.crop}^3, batch {opts.batch}, "
          f"{opts.epochs} epochs (first untimed), device {opts.device}", flush=True)  # fmt: skip
    rows, skipped = run(opts, opts.out / "work")
    table_rows = ratios(rows)
    print()
    print(table(table_rows, skipped))
    print("\nwrote " + ", ".join(str(p) for p in write(opts.out, table_rows, skipped, opts)))
    return 0 if any(r.kind != "ceiling" for r in rows) else 1
