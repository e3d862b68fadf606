"""`make demo`: the main job end to end on synthetic data: synth -> bmap -> cache -> load benchmark.

python -m workflows.demo --out demo
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer


def step(title: str) -> None:
    """Print a step header."""
    print(f"\n== {title}", flush=True)


def bmap_step(out: Path, train: Path) -> None:
    """Map the JPEG tree (bmap.json and the flat seed form), then verify it against the raw device if readable."""
    from prep.errors import PrepError
    from prep.mapping import build_bmap, seed_from_bmap, verify_bmap

    step(f"block map of {train} (FIEMAP)")
    try:
        summary = build_bmap(train, out / "bmap.json", require_mountpoint=False)
    except PrepError as exc:
        print(f"  skipped: {exc}")
        return
    n, skipped = seed_from_bmap(out / "bmap.json", out / "bmap.seed.json")
    print(f"  {summary.line()}\n  seed: {n} one-extent files -> {out / 'bmap.seed.json'} ({len(skipped)} left out)")
    try:
        mismatches = verify_bmap(out / "bmap.json")
    except PrepError as exc:  # the raw device needs root (and a container that lets root open it)
        print(f"  verify skipped: {exc}")
        return
    print(f"  verify: {len(mismatches)} mismatches" + "".join(f"\n    {m}" for m in mismatches))


def cache_step(out: Path, datalist: Path, workers: int = 2) -> None:
    """Prepare the NIfTI datalist with the spheres pipeline into OUT/cache (resumes or reports up to date)."""
    from prep.cache import prepare_cache
    from prep.errors import PrepError

    pipeline = Path(__file__).parent / "pipelines" / "spheres.py"
    step(f"prepared cache: {datalist} through {pipeline.name}'s deterministic head, {workers} dask workers")
    try:
        summary = prepare_cache(datalist, pipeline, out / "cache", workers=workers)
    except PrepError as exc:
        print(f"  failed: {exc}")
        return
    print("  " + "\n  ".join(summary.lines()))


def bench_step(out: Path, batchsize: int = 4, batches: int = 2) -> None:
    """A small load benchmark over the demo data: every way that runs here, one table (bench_out-style files
    under OUT/bench). `make bench` runs a larger one."""
    from workflows.bench.core import Options
    from workflows.bench.report import finish
    from workflows.bench.ways import run_all

    step(f"load benchmark: {batches} batches of {batchsize}, cold, every way that runs here")
    if not (out / "cache" / "manifest.json").is_file():
        print(f"  skipped: no prepared cache under {out / 'cache'}")
        return
    opts = Options(batchsize=batchsize, batches=batches, cold=True, out=out / "bench", work=out / "bench" / "work")
    finish(run_all(out, opts), opts)


def run(out: Path, count: int = 16, size: int = 64) -> None:
    """Run every stage that exists on a synthetic dataset under `out`."""
    from prep import synth

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step(f"synthetic data: {count} NIfTI image/label pairs of {size}^3, and a JPEG class tree")
    datalist = out / "nifti" / "dataset.json"
    if not datalist.exists():
        synth.nifti_dataset(out / "nifti", count=count, size=size, seed=0)
    train = out / "images" / "train"
    if not train.exists():
        synth.image_tree(out / "images", classes=4, per_class=32, seed=0)
    print(f"  datalist: {datalist}\n  images:   {train}")
    bmap_step(out, train)
    cache_step(out, datalist)
    bench_step(out)  # last: it reads every earlier output (NIfTI, JPEG tree, cache, bmap)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s; outputs under {out}/")


def main(
    out: Annotated[Path, typer.Option(help="output folder")] = Path("demo"),
    count: Annotated[int, typer.Option(min=1, help="number of volumes")] = 16,
    size: Annotated[int, typer.Option(min=8, help="volume edge in voxels")] = 64,
) -> None:
    """Synthetic data -> block map -> prepared cache -> load benchmark, e.g. `python -m workflows.demo --out demo`."""
    run(out, count, size)


if __name__ == "__main__":
    typer.run(main)
