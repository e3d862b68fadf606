"""The peers users run today, on the same volumes: MONAI's datasets over the original NIfTI with the same
deterministic head, and DALI `fn.readers.numpy` over `.npy` exports of the prepared tensors.

Only loading is timed: the random tail is left out everywhere, so each way delivers the head's output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import ceilings, scenario
from workflows.bench.core import (
    Options,
    Result,
    Rows,
    Unavailable,
    cuda_sync,
    cycle,
    files_under,
    optional,
    require_gpu,
    start_pass,
    time_batches,
)
from workflows.bench.report import PERSISTENT

DEFAULT_PIPELINE = Path(__file__).parents[1] / "pipelines" / "spheres.py"


def datalist_items(datalist: str | os.PathLike[str], section: str = "training") -> list[dict[str, Any]]:
    """Entries of a decathlon-style datalist with paths made absolute (relative to the datalist's folder)."""
    path = Path(datalist)
    if not path.is_file():
        raise Unavailable(f"{path}: datalist not found (pass --datalist DATASET.json)")
    doc = json.loads(path.read_text())
    entries = doc[section] if isinstance(doc, dict) else doc
    base = path.parent
    return [
        {k: str(base / v) if isinstance(v, str) and not os.path.isabs(v) else v for k, v in e.items()} for e in entries
    ]


def head_transform(pipeline: str | os.PathLike[str]) -> Any:
    """The deterministic head of a PIPELINE.py or bundle config, as a MONAI Compose."""
    from prep.pipeline import load_pipeline

    return load_pipeline(Path(pipeline)).head_compose()


def _source_files(items: list[dict[str, Any]]) -> list[str]:
    return sorted({v for e in items for v in e.values() if isinstance(v, str) and os.path.isfile(v)})


def as_list(batch: list[Any]) -> list[Any]:
    """Collate to a plain list: head outputs differ in shape (resampling), and only loading is timed."""
    return batch


def _batches(dataset: Any, opts: Options) -> Iterator[Any]:
    from monai.data import DataLoader

    loader = DataLoader(dataset, batch_size=opts.batchsize, shuffle=False, num_workers=opts.workers, collate_fn=as_list)
    for batch in loader:
        if opts.gpu:
            batch = [{k: v.to(opts.device, non_blocking=True) if hasattr(v, "to") else v for k, v in item.items()}
                     for item in batch]  # fmt: skip
        yield batch


def _timed(dataset: Any, files: list[str], opts: Options, name: str, note: str = "") -> Result:
    how = start_pass(files, opts.cold)
    seconds, nbytes = time_batches(_batches(dataset, opts), opts.batches, cuda_sync(opts.device))
    return Result(name, "volumes", opts.items, seconds, nbytes, "peer", note or how)


def _warm(dataset: Any, unique: int, opts: Options) -> None:
    """Touch each distinct item once, untimed: fills on-disk caches and the page cache."""
    for i in range(min(unique, len(dataset))):
        dataset[i]


def monai_dataset(datalist: str | os.PathLike[str], pipeline: str | os.PathLike[str], opts: Options) -> Result:
    """MONAI `Dataset`: load and run the head on every access (what most training scripts do)."""
    from monai.data import Dataset

    items = datalist_items(datalist)
    data = [items[i] for i in cycle(len(items), opts.items)]
    dataset = Dataset(data, transform=head_transform(pipeline))
    _warm(dataset, len(items), opts)  # one-time costs stay out of the timing; cold runs evict after it
    return _timed(dataset, _source_files(items), opts, "monai Dataset (NIfTI + head)")


def persistent(
    datalist: str | os.PathLike[str], pipeline: str | os.PathLike[str], opts: Options, cache_dir: Path | None = None
) -> Result:
    """MONAI `PersistentDataset`: the head's output pickled to .pt files once, then read back per item."""
    from monai.data import PersistentDataset

    items = datalist_items(datalist)
    data = [items[i] for i in cycle(len(items), opts.items)]
    cache_dir = cache_dir or opts.work / "persistent"
    cache_dir.mkdir(parents=True, exist_ok=True)
    dataset = PersistentDataset(data, transform=head_transform(pipeline), cache_dir=cache_dir)
    _warm(dataset, len(items), opts)  # writes the .pt files (untimed: that is its preparation)
    return _timed(dataset, files_under(cache_dir, (".pt",)), opts, PERSISTENT)


def cache_dataset(datalist: str | os.PathLike[str], pipeline: str | os.PathLike[str], opts: Options) -> Result:
    """MONAI `CacheDataset`: the head's output held in RAM (fast, but the data set must fit in memory)."""
    from monai.data import CacheDataset

    items = datalist_items(datalist)
    data = [items[i] for i in cycle(len(items), opts.items)]
    dataset = CacheDataset(data, transform=head_transform(pipeline), cache_rate=1.0, num_workers=1, progress=False)
    return _timed(dataset, [], opts, "monai CacheDataset", note="in RAM (cold does not apply)")


def gds_dataset(datalist: str | os.PathLike[str], pipeline: str | os.PathLike[str], opts: Options) -> Result:
    """MONAI `GDSDataset` (GPU only): the head's output saved raw and read back with kvikio into GPU memory.

    Not run on CPU-only machines; the code path needs a CUDA GPU and kvikio/cupy.
    """
    require_gpu(opts, "monai GDSDataset")
    from monai.data import GDSDataset

    items = datalist_items(datalist)
    data = [items[i] for i in cycle(len(items), opts.items)]
    cache_dir = opts.work / "gds"
    cache_dir.mkdir(parents=True, exist_ok=True)
    device = int(opts.device.partition(":")[2] or 0)
    dataset = GDSDataset(data, transform=head_transform(pipeline), cache_dir=cache_dir, device=device)
    _warm(dataset, len(items), opts)
    return _timed(dataset, files_under(cache_dir), opts, "monai GDSDataset")


def export_npy(cache_dir: str | os.PathLike[str], out: Path) -> dict[str, list[str]]:
    """Write each tensor of a prepared cache as OUT/<manifest digest>/<key>/<item>.npy (kept for later runs
    of the same cache: a rebuilt cache gets a new folder); returns the files per key, in item order."""
    import hashlib

    from loaders.backends import ReadRequest, get_backend
    from loaders.cache.format import PreparedCache
    from loaders.cache.spec import MANIFEST

    cache = PreparedCache(cache_dir)
    out = out / hashlib.sha256((Path(cache_dir) / MANIFEST).read_bytes()).hexdigest()[:16]
    files: dict[str, list[str]] = {}
    with get_backend("posix") as backend:
        for item in range(len(cache)):
            for e in cache.entries(item):
                path = out / e.key.replace("/", "_") / f"{item:06d}.npy"
                files.setdefault(e.key, []).append(str(path))
                if path.exists():
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                (buf,) = backend.read([ReadRequest(e.shard, e.offset, e.nbytes)])
                np.save(path, np.frombuffer(buf, dtype=e.dtype).reshape(e.shape))
    return files


def dali_numpy(npy: dict[str, list[str]], opts: Options) -> Result:
    """DALI `fn.readers.numpy` (one reader per key, same file order) on `.npy` exports; GDS on a GPU."""
    from workflows.bench.research import _pipeline, run_pipeline

    fn = optional("nvidia.dali", "the DALI ways").fn
    if not npy:
        raise Unavailable("no .npy exports to read")

    def build() -> Any:
        pipe = _pipeline(opts)
        with pipe:
            outs = [
                fn.readers.numpy(files=paths, device="gpu" if opts.gpu else "cpu", random_shuffle=False, name=f"r{i}")
                for i, paths in enumerate(npy.values())
            ]
            pipe.set_outputs(*outs)
        pipe.build()
        return pipe

    all_files = [p for paths in npy.values() for p in paths]
    return run_pipeline(build, all_files, opts, "dali readers.numpy (.npy)", "volumes", "peer", outputs=len(npy))


def npy_files(cache: Path | None, npy: Path | None, opts: Options) -> dict[str, list[str]]:
    """The .npy files per key: a folder of <key>/*.npy exports, or exports of a prepared cache made now."""
    if npy is not None:
        return {p.name: sorted(str(f) for f in p.glob("*.npy")) for p in sorted(npy.iterdir()) if p.is_dir()}
    if cache is None:
        raise Unavailable("dali-numpy needs --cache (to export) or --npy (exports)")
    if not (cache / "manifest.json").is_file():
        raise Unavailable(f"{cache}: no committed prepared cache to export")
    return export_npy(cache, opts.work / "npy")


def volume_peers(datalist: Path, pipeline: Path, cache: Path | None, opts: Options) -> Rows:
    """Every MONAI peer over the datalist, and DALI readers.numpy over the cache's exports."""
    rows = Rows()
    rows.add("persistent", lambda: persistent(datalist, pipeline, opts))
    rows.add("monai-dataset", lambda: monai_dataset(datalist, pipeline, opts))
    rows.add("cache-dataset", lambda: cache_dataset(datalist, pipeline, opts))
    rows.add("gds-dataset", lambda: gds_dataset(datalist, pipeline, opts))
    rows.add("dali-numpy", lambda: dali_numpy(npy_files(cache, None, opts), opts))
    return rows


_DATALIST = typer.Option(help="decathlon datalist (e.g. demo/nifti/dataset.json)")
_PIPELINE = typer.Option(help="PIPELINE.py (or bundle config) whose deterministic head is run")


def _register(name: str, help_text: str, way: Any) -> None:
    def run(
        opts: Options,
        datalist: Annotated[Path, _DATALIST],
        pipeline: Annotated[Path, _PIPELINE] = DEFAULT_PIPELINE,
    ) -> Rows:
        rows = Rows()
        rows.add(name, lambda: way(datalist, pipeline, opts))
        return rows

    scenario(name, help_text)(run)


_register("monai-dataset", "MONAI Dataset: NIfTI + head per access.", monai_dataset)
_register("persistent", "MONAI PersistentDataset (.pt files).", persistent)
_register("cache-dataset", "MONAI CacheDataset (in RAM).", cache_dataset)
_register("gds-dataset", "MONAI GDSDataset (GPU).", gds_dataset)


@scenario("dali-numpy", "DALI fn.readers.numpy on .npy exports of a prepared cache.")
def dali_numpy_way(
    opts: Options,
    cache: Annotated[Path | None, typer.Option(help="prepared cache to export")] = None,
    npy: Annotated[Path | None, typer.Option(help="folder of <key>/*.npy (instead of --cache)")] = None,
) -> Rows:
    rows = Rows()
    if cache is not None:
        ceilings.volume_ceilings(rows, cache, opts)
    rows.add("dali-numpy", lambda: dali_numpy(npy_files(cache, npy, opts), opts))
    return rows
