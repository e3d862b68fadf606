"""The tutorial chains: MONAI's own tutorials and the seeds' programs, as their users write them,
at CPU sizes on the conformance sets (crop and pad sizes scaled to 24^3 volumes; augmentation probabilities
raised where a tutorial's 0.1-0.15 would rarely fire in five items and two epochs).

Rows as in `chaintable`; `heldout.ALL` holds them with the other tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from chaintable import K, Row

CROP = (12, 12, 12)


# --- heads ---
def head_spleen() -> list[Any]:
    """The spleen tutorial's head (intensity window scaled to the set's 0..4 values)."""
    from monai.transforms import (
        CropForegroundd,
        EnsureChannelFirstd,
        LoadImaged,
        Orientationd,
        ScaleIntensityRanged,
        Spacingd,
    )

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K),
            ScaleIntensityRanged(keys=["image"], a_min=0.0, a_max=4.0, b_min=0.0, b_max=1.0, clip=True),
            CropForegroundd(keys=K, source_key="image"), Orientationd(keys=K, axcodes="RAS"),
            Spacingd(keys=K, pixdim=(1.2, 1.2, 1.1), mode=("bilinear", "nearest"))]  # fmt: skip


def head_btcv() -> list[Any]:
    """BTCV / SwinUNETR's head: orientation and spacing before the window, then the foreground crop."""
    from monai.transforms import (
        CropForegroundd,
        EnsureChannelFirstd,
        LoadImaged,
        Orientationd,
        ScaleIntensityRanged,
        Spacingd,
    )

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), Orientationd(keys=K, axcodes="RAS"),
            Spacingd(keys=K, pixdim=(1.1, 1.1, 1.2), mode=("bilinear", "nearest")),
            ScaleIntensityRanged(keys=["image"], a_min=0.5, a_max=3.5, b_min=0.0, b_max=1.0, clip=True),
            CropForegroundd(keys=K, source_key="image")]  # fmt: skip


def head_brats() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, EnsureTyped, LoadImaged, Orientationd, Spacingd

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), EnsureTyped(keys=K),
            Orientationd(keys=K, axcodes="RAS"),
            Spacingd(keys=K, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest"))]  # fmt: skip


def head_mednist() -> list[Any]:
    """MedNIST's head on the 2D set (its images share one size: padded/cropped to one here)."""
    from monai.transforms import EnsureChannelFirstd, EnsureTyped, LoadImaged, ResizeWithPadOrCropd, ScaleIntensityd

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), ScaleIntensityd(keys="image"),
            ResizeWithPadOrCropd(keys=K, spatial_size=(24, 24)), EnsureTyped(keys="class")]  # fmt: skip


def head_seed000() -> list[Any]:
    """Seed 000 (MONAI's GDSDataset notebook), its device cpu as on a machine without CUDA."""
    from monai.transforms import EnsureTypeD, LoadImageD, SpacingD

    return [LoadImageD(keys=("image", "label"), image_only=True, ensure_channel_first=True),
            EnsureTypeD(keys=("image", "label"), device="cpu"),
            SpacingD(keys=("image", "label"), pixdim=1.5)]  # fmt: skip


def head_seed001() -> list[Any]:
    """Seed 001's cached part: load, channel first, channel-wise scaling."""
    from monai.transforms import EnsureChannelFirstd, LoadImaged, ScaleIntensityd

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), ScaleIntensityd(keys=K, channel_wise=True)]


# --- tails ---
def tail_spleen() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld

    return [RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=CROP, pos=1, neg=1, num_samples=4,
                                   image_key="image", image_threshold=0)]  # fmt: skip


def tail_btcv() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd, RandRotate90d, RandShiftIntensityd

    return [RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=CROP, pos=1, neg=1, num_samples=4,
                                   image_key="image", image_threshold=0),
            RandFlipd(keys=K, spatial_axis=[0], prob=0.3), RandFlipd(keys=K, spatial_axis=[1], prob=0.3),
            RandFlipd(keys=K, spatial_axis=[2], prob=0.3), RandRotate90d(keys=K, prob=0.3, max_k=3),
            RandShiftIntensityd(keys=["image"], offsets=0.10, prob=0.50)]  # fmt: skip


def tail_dynunet() -> list[Any]:
    """The DynUNet (MSD) tutorial's training tail."""
    from monai.transforms import (
        CastToTyped,
        RandCropByPosNegLabeld,
        RandFlipd,
        RandGaussianNoised,
        RandGaussianSmoothd,
        RandScaleIntensityd,
        RandZoomd,
        SpatialPadd,
    )

    return [SpatialPadd(keys=K, spatial_size=CROP),
            RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=CROP, pos=1, neg=1, num_samples=1,
                                   image_key="image", image_threshold=0),
            RandZoomd(keys=K, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), align_corners=(True, None),
                      prob=0.5),
            CastToTyped(keys=K, dtype=(np.float32, np.uint8)),
            RandGaussianNoised(keys=["image"], std=0.01, prob=0.5),
            RandGaussianSmoothd(keys=["image"], sigma_x=(0.5, 1.15), sigma_y=(0.5, 1.15), sigma_z=(0.5, 1.15),
                                prob=0.5),
            RandScaleIntensityd(keys=["image"], factors=0.3, prob=0.5),
            RandFlipd(keys=K, spatial_axis=[0], prob=0.5), RandFlipd(keys=K, spatial_axis=[1], prob=0.5),
            RandFlipd(keys=K, spatial_axis=[2], prob=0.5),
            CastToTyped(keys=K, dtype=(np.float32, np.uint8))]  # fmt: skip


def tail_brats() -> list[Any]:
    from monai.transforms import (
        NormalizeIntensityd,
        RandFlipd,
        RandScaleIntensityd,
        RandShiftIntensityd,
        RandSpatialCropd,
    )

    return [RandSpatialCropd(keys=K, roi_size=CROP, random_size=False),
            RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandFlipd(keys=K, prob=0.5, spatial_axis=1),
            RandFlipd(keys=K, prob=0.5, spatial_axis=2),
            NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
            RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
            RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0)]  # fmt: skip


def tail_mednist() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotated, RandZoomd

    return [RandRotated(keys="image", range_x=np.pi / 12, prob=0.5, keep_size=True),
            RandFlipd(keys="image", spatial_axis=0, prob=0.5),
            RandZoomd(keys="image", min_zoom=0.9, max_zoom=1.1, prob=0.5)]  # fmt: skip


def tail_seed000() -> list[Any]:
    from monai.transforms import RandRotateD, RandZoomD, ResizeWithPadOrCropD

    return [RandRotateD(keys=("image", "label"), prob=1.0, range_x=0.1, range_y=0.1, range_z=0.3,
                        mode=("bilinear", "nearest")),
            RandZoomD(keys=("image", "label"), prob=1.0, min_zoom=0.8, max_zoom=1.2, mode=("trilinear", "nearest")),
            ResizeWithPadOrCropD(keys=("image", "label"), spatial_size=(18, 19, 20))]  # fmt: skip


def tail_seed001() -> list[Any]:
    from monai.transforms import RandFlipd, SpatialPadd

    return [RandFlipd(K, prob=0.5, spatial_axis=0), SpatialPadd(K, spatial_size=(28, 28, 28))]


_NORMALISES = "NormalizeIntensityd(nonzero, channel_wise): the batched mean/std sum in another order"

TUTORIALS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("tutorial-spleen", "3d-ragged", head_spleen, tail_spleen),
        Row("tutorial-btcv", "3d-ragged", head_btcv, tail_btcv),
        Row("tutorial-dynunet", "3d", head_spleen, tail_dynunet),
        Row("tutorial-brats", "3d", head_brats, tail_brats, atol=1e-5, note=_NORMALISES),
        Row("tutorial-mednist", "2d", head_mednist, tail_mednist, loader={"batch_size": 2}),
        Row("seed000-gds-notebook", "3d-ragged", head_seed000, tail_seed000),
        Row("seed001-cache-example", "3d", head_seed001, tail_seed001),
    ]
}
