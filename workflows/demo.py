"""`make demo`: the main job end to end on synthetic data: synth -> bmap -> cache -> load benchmark.

python -m workflows.demo --out demo
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def step(title: str) -> None:
    """Print a step header."""
    print(f"\n== {title}", flush=True)


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
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s; outputs under {out}/")


def main() -> None:
    """Command-line entry."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo"), help="output folder (default: demo)")
    parser.add_argument("--count", type=int, default=16, help="number of volumes")
    parser.add_argument("--size", type=int, default=64, help="volume edge in voxels")
    args = parser.parse_args()
    run(args.out, args.count, args.size)


if __name__ == "__main__":
    main()
