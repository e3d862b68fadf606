"""Speed sanity: seconds per batch of BatchedTail against MONAI's per-item chain + list_data_collate.

`python -m workflows.bench.tail_speed --size 160 --crop 96 --batch 4 --device cpu` prints one line per chain. Not a
benchmark with a ceiling (that is `python -m workflows.benchmark train`); it shows what batching buys.
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
from collections.abc import Callable
from typing import Any

KEYS = ["image", "label"]


def chains(crop: int) -> dict[str, list[Any]]:
    """A crop with a flip and an intensity scale, MONAI's 3D tutorial tail, an affine tail, a weighted crop's and
    an elastic one's."""
    import math

    from monai import transforms as mt

    roi = (crop, crop, crop)
    return {
        "crop+flip+scale": [
            mt.RandSpatialCropd(KEYS, roi_size=roi),
            mt.RandFlipd(KEYS, prob=0.5, spatial_axis=0),
            mt.RandScaleIntensityd("image", factors=0.1, prob=0.5),
        ],
        "posneg(2)+flips+rot90+shift": [
            mt.RandCropByPosNegLabeld(KEYS, "label", spatial_size=roi, num_samples=2),
            mt.RandFlipd(KEYS, prob=0.1, spatial_axis=0),
            mt.RandFlipd(KEYS, prob=0.1, spatial_axis=1),
            mt.RandFlipd(KEYS, prob=0.1, spatial_axis=2),
            mt.RandRotate90d(KEYS, prob=0.1, max_k=3),
            mt.RandShiftIntensityd("image", offsets=0.1, prob=0.5),
        ],
        "crop+affine": [
            mt.RandSpatialCropd(KEYS, roi_size=roi),
            mt.RandAffined(
                KEYS, prob=1.0, rotate_range=(math.pi / 12,) * 3, scale_range=0.1, mode=("bilinear", "nearest")
            ),
        ],
        "weighted(2)+flip": [
            mt.RandWeightedCropd(KEYS, w_key="image", spatial_size=roi, num_samples=2),
            mt.RandFlipd(KEYS, prob=0.5, spatial_axis=0),
        ],
        "crop+elastic": [
            mt.RandSpatialCropd(KEYS, roi_size=roi),
            mt.Rand3DElasticd(KEYS, sigma_range=(5, 8), magnitude_range=(100, 200), prob=0.5,
                              mode=("bilinear", "nearest"), padding_mode="border"),
        ],
    }  # fmt: skip


def make_batch(batch: int, size: int, device: str) -> dict[str, Any]:
    """Random images and a sphere label, (batch, 1, size, size, size)."""
    import torch

    g = torch.Generator().manual_seed(0)
    image = torch.rand((batch, 1, size, size, size), generator=g)
    axis = torch.arange(size, dtype=torch.float32) - size / 2
    dist = axis.view(-1, 1, 1) ** 2 + axis.view(1, -1, 1) ** 2 + axis.view(1, 1, -1) ** 2
    label = (dist < (size / 4) ** 2).to(torch.uint8).expand(batch, 1, size, size, size).contiguous()
    return {"image": image.to(device), "label": label.to(device)}


def per_item(transforms: list[Any]) -> Callable[[dict[str, Any]], Any]:
    """MONAI's way: the chain item by item, then list_data_collate."""
    from monai.data import list_data_collate
    from monai.transforms import Compose

    chain = Compose(transforms)
    chain.set_random_state(0)

    def run(batch: dict[str, Any]) -> Any:
        n = int(batch["image"].shape[0])
        return list_data_collate([chain({k: v[i] for k, v in batch.items()}) for i in range(n)])

    return run


def seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Best of `repeats` (after one warm-up call)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def compare(size: int, crop: int, batch: int, device: str, repeats: int) -> list[dict[str, Any]]:
    """Seconds per batch for each chain, batched vs per item, on `device`."""
    import torch

    from loaders.tail import BatchedTail

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    data = make_batch(batch, size, device)
    rows = []
    for name, transforms in chains(crop).items():
        tail = BatchedTail(copy.deepcopy(transforms)).set_random_state(0)
        items = per_item(copy.deepcopy(transforms))
        t_batched = seconds(functools.partial(tail, data), repeats, sync)
        t_items = seconds(functools.partial(items, data), repeats, sync)
        rows.append({"chain": name, "batched_s": t_batched, "per_item_s": t_items, "speedup": t_items / t_batched})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=160, help="volume edge (voxels)")
    parser.add_argument("--crop", type=int, default=96, help="crop edge (voxels)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"batch ({args.batch}, 1, {args.size}^3) float32 image + uint8 label, crop {args.crop}^3, {args.device}")
    for row in compare(args.size, args.crop, args.batch, args.device, args.repeats):
        print(
            f"{row['chain']:<30} BatchedTail {row['batched_s'] * 1e3:8.1f} ms   "
            f"MONAI per item + collate {row['per_item_s'] * 1e3:8.1f} ms   x{row['speedup']:.1f}"
        )


if __name__ == "__main__":
    main()
