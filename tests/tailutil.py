"""Helpers for the BatchedTail tests: a batch, MONAI's per-item reference, the comparison."""

from __future__ import annotations

import copy
from typing import Any

import torch

from loaders.tail import BatchedTail

K = ["image", "label"]


def per_item(name: str, *args: Any, **kwargs: Any) -> Any:
    """MONAI's transform `name` as a user's subclass of it (same behaviour, another class), which the batched tail
    runs per item through MONAI: the fallback path, whatever MONAI transforms it batches."""
    import monai.transforms as mt

    cls = getattr(mt, name)
    own = type(f"Own{name}", (cls,), {"__module__": __name__})
    globals()[own.__name__] = own  # importable by name (deep copies and pickles find it)
    return own(*args, **kwargs)


def make_batch(n: int = 4, spatial: tuple[int, ...] = (20, 22, 20), seed: int = 0) -> dict[str, Any]:
    """Images (float32, 1 channel) with spheres and their uint8 labels."""
    g = torch.Generator().manual_seed(seed)
    image = torch.rand((n, 1, *spatial), generator=g)
    grids = torch.meshgrid(*[torch.arange(s, dtype=torch.float32) for s in spatial], indexing="ij")
    label = torch.zeros((n, 1, *spatial), dtype=torch.uint8)
    for i in range(n):
        centre = [s * (0.3 + 0.1 * i) for s in spatial]
        dist = sum((gr - c) ** 2 for gr, c in zip(grids, centre))
        label[i, 0] = (dist < (min(spatial) / 4) ** 2).to(torch.uint8)
        image[i, 0] += 2.0 * label[i, 0]
    return {"image": image, "label": label}


def reference(transforms: list[Any], batch: dict[str, Any], seed: int) -> dict[str, Any]:
    """MONAI's way: the chain item by item, then list_data_collate."""
    from monai.data import list_data_collate
    from monai.transforms import Compose

    chain = Compose(copy.deepcopy(transforms))
    chain.set_random_state(seed)
    n = batch["image"].shape[0]
    outs: list[Any] = []
    for i in range(n):
        out = chain({k: v[i].clone() for k, v in batch.items()})
        outs.append(out)
    collated = list_data_collate(outs)
    return {k: v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v for k, v in collated.items()}


def reference_batches(chain: Any, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MONAI's way over several batches: one (seeded) Compose, item after item through every batch, each batch
    collated."""
    from monai.data import list_data_collate

    outs = []
    for b in batches:
        items = [chain({k: v[i].clone() for k, v in b.items()}) for i in range(b["image"].shape[0])]
        got = list_data_collate(items)
        outs.append({k: v.as_subclass(torch.Tensor) for k, v in got.items()})
    return outs


def batched(transforms: list[Any], batch: dict[str, Any], seed: int) -> tuple[dict[str, Any], BatchedTail]:
    tail = BatchedTail(copy.deepcopy(transforms))
    tail.set_random_state(seed)
    return tail({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}), tail


def assert_same(got: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...] = ("image", "label"), atol=0.0):
    for k in keys:
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        if atol == 0.0:
            assert torch.equal(got[k], want[k]), (k, (got[k].float() - want[k].float()).abs().max())
        else:
            torch.testing.assert_close(got[k].float(), want[k].float(), atol=atol, rtol=0)


def augment_3d() -> list[Any]:
    """The 3D augmentations `seg-aug` adds after the crop (every prob 0.5), for the GPU tests."""
    import monai.transforms as mt

    return [
        mt.RandAffined(keys=K, prob=0.5, rotate_range=(0.1, 0.1, 0.1), scale_range=(0.1, 0.1, 0.1),
                       mode=("bilinear", "nearest"), padding_mode="border"),
        mt.RandAdjustContrastd(keys="image", prob=0.5, gamma=(0.7, 1.5)),
        mt.RandHistogramShiftd(keys="image", prob=0.5, num_control_points=10),
        mt.RandBiasFieldd(keys="image", prob=0.5, coeff_range=(0.0, 0.1)),
        mt.RandGaussianSharpend(keys="image", prob=0.5),
        mt.RandCoarseDropoutd(keys="image", prob=0.5, holes=4, spatial_size=4),
        mt.RandStdShiftIntensityd(keys="image", prob=0.5, factors=0.1),
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
    ]  # fmt: skip


def then_deterministic() -> list[Any]:
    """`seg-aug`'s augmentations, then deterministic transforms users put after them."""
    import monai.transforms as mt

    return [
        *augment_3d(),
        mt.ScaleIntensityd("image", channel_wise=True),
        mt.ScaleIntensityRanged("image", a_min=0.1, a_max=0.9, b_min=-1.0, b_max=1.0, clip=True),
        mt.ThresholdIntensityd("image", threshold=0.5, above=True, cval=0.0),
        mt.MapLabelValued("label", [0, 1], [2, 5], dtype=torch.uint8),
        mt.ToTensord(["image", "label"]),
    ]


def then_spatial() -> list[Any]:
    """`seg-aug`'s augmentations, then deterministic spatial transforms that act on each channel alone."""
    import monai.transforms as mt

    return [
        *augment_3d(),
        mt.SpatialPadd(K, spatial_size=(24, 24, 24), mode=("reflect", "constant")),
        mt.CenterSpatialCropd(K, roi_size=(18, 20, 16)),
        mt.Flipd(K, spatial_axis=2),
        mt.Rotate90d(K, k=1, spatial_axes=(0, 2)),
        mt.Resized(K, spatial_size=(16, 16, 16), mode=("trilinear", "nearest")),
        mt.Rotated(K, angle=(0.2, 0.1, -0.3), mode=("bilinear", "nearest")),
        mt.Zoomd(K, zoom=1.2, mode=("trilinear", "nearest")),
        mt.DivisiblePadd(K, k=12),
    ]


def augment_2d() -> list[Any]:
    """The 2D augmentations of `slices` (every prob 0.5), for the GPU tests."""
    import monai.transforms as mt

    return [
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
        mt.RandRotate90d(keys=K, prob=0.5, max_k=3),
        mt.RandRotated(keys=K, range_x=0.3, prob=0.5, mode=("bilinear", "nearest")),
        mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        mt.RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ]
