"""The training benchmark's workloads: the data, transform chain and model of the tutorials users train.

- `spheres`: equal-shaped synthetic volumes, RandSpatialCropd, a small UNet (the original benchmark).
- `seg-ct`: CT-like volumes of different shapes and voxel spacings through MONAI's spleen tutorial chain
  (CropForegroundd, Orientationd, Spacingd | RandCropByPosNegLabeld(num_samples=4), flips, RandRotate90d,
  RandShiftIntensityd) and its UNet (16-256, residual units, batch norm).
- `seg-multiclass`: 4-contrast MR-like volumes with 4 classes and thick slices (2 mm), MONAI's DynUNet (MSD) tutorial
  chain with label-class crops (Orientationd, Spacingd, NormalizeIntensityd, SpatialPadd |
  RandCropByLabelClassesd(112x112x64, 2 samples), RandZoomd, RandGaussianNoised, RandGaussianSmoothd,
  RandScaleIntensityd, flips) and its DynUNet.
- `brats`: 4-contrast MR-like volumes, a 3-class label, the BraTS tutorial chain (label to 3 channels, Orientation,
  Spacing | RandSpatialCropd, flips, NormalizeIntensityd(nonzero, channel_wise), RandScale/ShiftIntensityd) and
  its SegResNet.
- `gds-seed`: seed 000's chain verbatim (EnsureTypeD(device) in the head, SpacingD(1.5) | RandRotateD, RandZoomD,
  ResizeWithPadOrCropD), batch 1 through ThreadDataLoader as the seed runs it, no model (seconds per epoch).
- `mednist`: seed 003's chain (LoadImageD, EnsureChannelFirstD, ScaleIntensityD) and DenseNet121 on 64x64
  JPEGs in 6 classes with int labels, batch 512, DataLoader(4).
- `slices`: 2D training on slices of CT-like volumes (head as `seg-ct`'s without the foreground crop |
  RandSpatialCropSamplesd of one-voxel-thick windows, 4 per item, SqueezeDimd, 2D flips, RandRotate90d,
  RandRotated, RandScaleIntensityd, RandShiftIntensityd) and a 2D UNet.
- `seg-aug`: the spleen tutorial's head and crops with the augmentations other MONAI tutorials add per item
  (RandAffined, RandAdjustContrastd, RandHistogramShiftd, RandBiasFieldd, RandGaussianSharpend,
  RandCoarseDropoutd, RandStdShiftIntensityd, flips) and its UNet.
- `seg-elastic`: the spleen tutorial's head and crops, then Rand3DElasticd (a dense random deformation drawn and
  smoothed per item, which the loader runs item by item) and flips: the workload of a tail that is not batched.

Each workload makes its data on the spot (`prep.synth`), so nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMES = ("spheres", "seg-ct", "seg-multiclass", "brats", "gds-seed", "mednist", "slices", "seg-aug", "seg-elastic")


@dataclass(frozen=True)
class Workload:
    """What one workload trains: its chain (PIPELINE.py text), data, model step and resident ceiling batch."""

    name: str
    pipeline: Callable[[Any], str]  # TrainOptions -> PIPELINE.py text
    data: Callable[[Any, Path], Path]  # (TrainOptions, folder) -> datalist
    model: str  # "unet-small", "unet-spleen", "segresnet", "dynunet", "densenet", "none"
    ceiling: Callable[[Any], dict[str, tuple[tuple[int, ...], str]]]  # key -> (shape, "float" | "binary" | "class")
    samples: int = 1  # outputs per item (num_samples of a label-driven crop)
    thread_loader: bool = False  # the peers run as the seed does: ThreadDataLoader, no workers
    describe: Callable[[Any], str] = lambda o: ""


def _spheres_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""Training benchmark pipeline (spheres): head | random tail ({c}^3 crop, flip, intensity)."""
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, RandFlipd, RandScaleIntensityd,
                              RandSpatialCropd, ScaleIntensityd)

KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    ScaleIntensityd(keys="image"),
    RandSpatialCropd(keys=KEYS, roi_size=({c}, {c}, {c}), random_size=False),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
    RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
])
'''


def _spleen_head(c: int, samples: int) -> str:
    """The spleen tutorial's chain up to its label-driven crop (`c`^3, `samples` per item): seg-ct's and the
    workloads built on it."""
    return f"""KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
    CropForegroundd(keys=KEYS, source_key="image"),
    Orientationd(keys=KEYS, axcodes="RAS"),
    Spacingd(keys=KEYS, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
    RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=({c}, {c}, {c}), pos=1, neg=1,
                           num_samples={samples}, image_key="image", image_threshold=0),
"""


def _segct_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""seg-ct: MONAI's spleen tutorial chain (head | label-driven crops, flips, rotations, shift)."""
from monai.transforms import (Compose, CropForegroundd, EnsureChannelFirstd, LoadImaged, Orientationd,
                              RandCropByPosNegLabeld, RandFlipd, RandRotate90d, RandShiftIntensityd,
                              ScaleIntensityRanged, Spacingd)

{_spleen_head(c, 4)}    RandFlipd(keys=KEYS, spatial_axis=[0], prob=0.10),
    RandFlipd(keys=KEYS, spatial_axis=[1], prob=0.10),
    RandFlipd(keys=KEYS, spatial_axis=[2], prob=0.10),
    RandRotate90d(keys=KEYS, prob=0.10, max_k=3),
    RandShiftIntensityd(keys=["image"], offsets=0.10, prob=0.50),
])
'''


def _multiclass_pipeline(o: Any) -> str:
    x, z = o.crop, o.crop // 7 * 4
    return f'''"""seg-multiclass: MONAI's DynUNet tutorial chain, label-class crops (head | crops, zoom, noise, ...)."""
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, MapLabelValued, NormalizeIntensityd,
                              Orientationd, RandCropByLabelClassesd, RandFlipd, RandGaussianNoised,
                              RandGaussianSmoothd, RandScaleIntensityd, RandZoomd, Spacingd, SpatialPadd)

KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    MapLabelValued(keys="label", orig_labels=[0, 1, 2, 4], target_labels=[0, 1, 2, 3]),
    Orientationd(keys=KEYS, axcodes="RAS"),
    Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 2.0), mode=("bilinear", "nearest")),
    NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
    SpatialPadd(keys=KEYS, spatial_size=({x}, {x}, {z})),
    RandCropByLabelClassesd(keys=KEYS, label_key="label", spatial_size=({x}, {x}, {z}), num_classes=4,
                            ratios=[1, 1, 1, 1], num_samples=2, warn=False),
    RandZoomd(keys=KEYS, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), align_corners=(True, None),
              prob=0.15),
    RandGaussianNoised(keys="image", std=0.01, prob=0.15),
    RandGaussianSmoothd(keys="image", sigma_x=(0.5, 1.15), sigma_y=(0.5, 1.15), sigma_z=(0.5, 1.15), prob=0.15),
    RandScaleIntensityd(keys="image", factors=0.3, prob=0.15),
    RandFlipd(keys=KEYS, spatial_axis=[0], prob=0.5),
    RandFlipd(keys=KEYS, spatial_axis=[1], prob=0.5),
    RandFlipd(keys=KEYS, spatial_axis=[2], prob=0.5),
])
'''


def _brats_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""brats: MONAI's BraTS tutorial chain (labels to TC/WT/ET | crop, flips, normalise, scale, shift)."""
from monai.transforms import (Compose, ConvertToMultiChannelBasedOnBratsClassesd, EnsureChannelFirstd,
                              EnsureTyped, LoadImaged, NormalizeIntensityd, Orientationd, RandFlipd,
                              RandScaleIntensityd, RandShiftIntensityd, RandSpatialCropd, Spacingd)

KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys="image"),
    EnsureTyped(keys=KEYS),
    ConvertToMultiChannelBasedOnBratsClassesd(keys="label"),
    Orientationd(keys=KEYS, axcodes="RAS"),
    Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
    RandSpatialCropd(keys=KEYS, roi_size=[{c}, {c}, {c}], random_size=False),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=1),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=2),
    NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
    RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
    RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
])
'''


def _gds_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""gds-seed: seed 000's GDSDataset notebook chain, verbatim but for the output size ({c}-based)."""
import monai.transforms as mt

device = {o.device!r}
transform = mt.Compose(
    [
        mt.LoadImageD(keys=("image", "label"), image_only=True, ensure_channel_first=True),
        mt.EnsureTypeD(keys=("image", "label"), device=device),
        mt.SpacingD(keys=("image", "label"), pixdim=1.5),
        mt.RandRotateD(
            keys=("image", "label"), prob=1.0, range_x=0.1, range_y=0.1, range_z=0.3, mode=("bilinear", "nearest"),
        ),
        mt.RandZoomD(keys=("image", "label"), prob=1.0, min_zoom=0.8, max_zoom=1.2, mode=("trilinear", "nearest")),
        mt.ResizeWithPadOrCropD(keys=("image", "label"), spatial_size=({c}, {c + c // 20}, {c + c // 10})),
    ]
)
'''


def _slices_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""slices: 2D training on slices of 3D volumes (head | slices, 2D flips, rotations, intensity)."""
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, Orientationd, RandFlipd, RandRotate90d,
                              RandRotated, RandScaleIntensityd, RandShiftIntensityd, RandSpatialCropSamplesd,
                              ScaleIntensityRanged, Spacingd, SqueezeDimd)

KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
    Orientationd(keys=KEYS, axcodes="RAS"),
    Spacingd(keys=KEYS, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
    RandSpatialCropSamplesd(keys=KEYS, roi_size=({c}, {c}, 1), num_samples=4, random_size=False),
    SqueezeDimd(keys=KEYS, dim=-1),
    RandFlipd(keys=KEYS, spatial_axis=[0], prob=0.5),
    RandFlipd(keys=KEYS, spatial_axis=[1], prob=0.5),
    RandRotate90d(keys=KEYS, prob=0.5, max_k=3),
    RandRotated(keys=KEYS, range_x=0.3, prob=0.3, mode=("bilinear", "nearest")),
    RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
    RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
])
'''


def _segaug_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""seg-aug: the spleen chain with the per-item augmentations MONAI's tutorials add after the crop."""
from monai.transforms import (Compose, CropForegroundd, EnsureChannelFirstd, LoadImaged, Orientationd,
                              RandAdjustContrastd, RandAffined, RandBiasFieldd, RandCoarseDropoutd,
                              RandCropByPosNegLabeld, RandFlipd, RandGaussianSharpend, RandHistogramShiftd,
                              RandStdShiftIntensityd, ScaleIntensityRanged, Spacingd)

{_spleen_head(c, 2)}    RandAffined(keys=KEYS, prob=0.5, rotate_range=(0.1, 0.1, 0.1), scale_range=(0.1, 0.1, 0.1),
                mode=("bilinear", "nearest"), padding_mode="border"),
    RandAdjustContrastd(keys="image", prob=0.3, gamma=(0.7, 1.5)),
    RandHistogramShiftd(keys="image", prob=0.3, num_control_points=10),
    RandBiasFieldd(keys="image", prob=0.3, coeff_range=(0.0, 0.1)),
    RandGaussianSharpend(keys="image", prob=0.2),
    RandCoarseDropoutd(keys="image", prob=0.3, holes=4, spatial_size=8),
    RandStdShiftIntensityd(keys="image", prob=0.3, factors=0.1),
    RandFlipd(keys=KEYS, spatial_axis=[0], prob=0.5),
    RandFlipd(keys=KEYS, spatial_axis=[1], prob=0.5),
])
'''


def _segelastic_pipeline(o: Any) -> str:
    c = o.crop
    return f'''"""seg-elastic: the spleen chain with a dense elastic deformation per item after the crop."""
from monai.transforms import (Compose, CropForegroundd, EnsureChannelFirstd, LoadImaged, Orientationd,
                              Rand3DElasticd, RandCropByPosNegLabeld, RandFlipd, ScaleIntensityRanged, Spacingd)

{_spleen_head(c, 2)}    Rand3DElasticd(keys=KEYS, sigma_range=(5, 8), magnitude_range=(100, 200), prob=0.5,
                   mode=("bilinear", "nearest"), padding_mode="border"),
    RandFlipd(keys=KEYS, spatial_axis=[0], prob=0.5),
    RandFlipd(keys=KEYS, spatial_axis=[1], prob=0.5),
])
'''


def _mednist_pipeline(o: Any) -> str:
    return '''"""mednist: seed 003's MedNIST chain (load, channel first, scale intensity), int class labels."""
from monai.transforms import Compose, EnsureChannelFirstD, LoadImageD, ScaleIntensityD

transform = Compose([
    LoadImageD(keys="image", image_only=True),
    EnsureChannelFirstD(keys="image"),
    ScaleIntensityD(keys="image"),
])
'''


def _nifti(kind: str, shape_range: float, spacing: tuple[float, float] | None) -> Callable[[Any, Path], Path]:
    """The workload's volumes; `--shape-range` / `--spacing-range` (o.shape_range, o.spacing_range) override."""

    def make(o: Any, folder: Path) -> Path:
        from prep.synth import nifti_dataset

        r = shape_range if o.shape_range is None else o.shape_range
        mm = spacing if o.spacing_range is None else o.spacing_range
        return nifti_dataset(folder, count=o.count, size=o.size, seed=o.seed, kind=kind, shape_range=r,
                             spacing_range=mm)  # fmt: skip

    return make


def _mednist_data(o: Any, folder: Path) -> Path:
    from prep.synth import mednist_like

    return mednist_like(folder, o.count, size=o.size, classes=6, seed=o.seed)


def _crop3(channels: int, label: str, samples: int = 1) -> Callable[[Any], dict[str, tuple[tuple[int, ...], str]]]:
    def shapes(o: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        b, c = o.batch * samples, o.crop
        return {
            "image": ((b, channels, c, c, c), "float"),
            "label": ((b, 1 if label == "binary" else 3, c, c, c), "binary"),
        }

    return shapes


WORKLOADS: dict[str, Workload] = {
    "spheres": Workload("spheres", _spheres_pipeline, _nifti("spheres", 0.0, None), "unet-small", _crop3(1, "binary"),
                        describe=lambda o: f"{o.count} x {o.size}^3 spheres, crop {o.crop}^3"),
    "seg-ct": Workload("seg-ct", _segct_pipeline, _nifti("ct", 0.2, (1.4, 2.2)), "unet-spleen",
                       _crop3(1, "binary", 4), samples=4,
                       describe=lambda o: f"{o.count} CT-like volumes ~{o.size}^3, shapes/spacings differ, "
                       f"4 pos/neg crops {o.crop}^3 per item"),
    "seg-multiclass": Workload("seg-multiclass", _multiclass_pipeline, _nifti("mr", 0.1, (1.0, 1.2)), "dynunet",
                               lambda o: {"image": ((2 * o.batch, 4, o.crop, o.crop, o.crop // 7 * 4), "float"),
                                          "label": ((2 * o.batch, 1, o.crop, o.crop, o.crop // 7 * 4), "binary")},
                               samples=2,
                               describe=lambda o: f"{o.count} 4-contrast MR-like volumes ~{o.size}^3, 4 classes, "
                               f"2 mm slices, 2 class crops {o.crop}x{o.crop}x{o.crop // 7 * 4} per item"),
    "brats": Workload("brats", _brats_pipeline, _nifti("mr", 0.1, (1.0, 1.2)), "segresnet", _crop3(4, "multi"),
                      describe=lambda o: f"{o.count} 4-contrast MR-like volumes ~{o.size}^3, crop {o.crop}^3"),
    "gds-seed": Workload("gds-seed", _gds_pipeline, _nifti("spheres", 0.2, (1.0, 2.0)), "none",
                         lambda o: {}, thread_loader=True,
                         describe=lambda o: f"{o.count} volumes ~{o.size}^3, seed 000's chain, batch 1"),
    "mednist": Workload("mednist", _mednist_pipeline, _mednist_data, "densenet",
                        lambda o: {"image": ((o.batch, 1, o.size, o.size), "float"), "label": ((o.batch,), "class")},
                        describe=lambda o: f"{o.count} {o.size}x{o.size} JPEGs in 6 classes, DenseNet121"),
    "slices": Workload("slices", _slices_pipeline, _nifti("ct", 0.2, (1.4, 2.2)), "unet-2d",
                       lambda o: {"image": ((4 * o.batch, 1, o.crop, o.crop), "float"),
                                  "label": ((4 * o.batch, 1, o.crop, o.crop), "binary")},
                       samples=4,
                       describe=lambda o: f"{o.count} CT-like volumes ~{o.size}^3, 4 slices {o.crop}x{o.crop} "
                       "per item, 2D UNet"),
    "seg-aug": Workload("seg-aug", _segaug_pipeline, _nifti("ct", 0.2, (1.4, 2.2)), "unet-spleen",
                        _crop3(1, "binary", 2), samples=2,
                        describe=lambda o: f"{o.count} CT-like volumes ~{o.size}^3, 2 pos/neg crops {o.crop}^3 "
                        "per item, the tutorials' per-item augmentations"),
    "seg-elastic": Workload("seg-elastic", _segelastic_pipeline, _nifti("ct", 0.2, (1.4, 2.2)), "unet-spleen",
                            _crop3(1, "binary", 2), samples=2,
                            describe=lambda o: f"{o.count} CT-like volumes ~{o.size}^3, 2 pos/neg crops "
                            f"{o.crop}^3 per item, Rand3DElasticd per item"),
}  # fmt: skip


def model_and_loss(kind: str, o: Any) -> tuple[Any, Any]:
    """The workload's network and loss, as its tutorial builds them (None, None for the loading-only seed)."""
    import torch
    from monai.losses import DiceLoss
    from monai.networks.layers import Norm
    from monai.networks.nets import UNet

    net: Any
    if kind == "unet-small":
        net = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=o.channels,
                   strides=(2,) * (len(o.channels) - 1))  # fmt: skip
        return net, DiceLoss(to_onehot_y=True, softmax=True)
    if kind == "unet-2d":
        net = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(16, 32, 64, 128), strides=(2, 2, 2),
                   num_res_units=2, norm=Norm.BATCH)  # fmt: skip
        return net, DiceLoss(to_onehot_y=True, softmax=True)
    if kind == "unet-spleen":
        net = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2),
                   num_res_units=2, norm=Norm.BATCH)  # fmt: skip
        return net, DiceLoss(to_onehot_y=True, softmax=True)
    if kind == "segresnet":
        from monai.networks.nets import SegResNet

        net = SegResNet(blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), init_filters=16, in_channels=4, out_channels=3,
                        dropout_prob=0.2)  # fmt: skip
        return net, DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, to_onehot_y=False, sigmoid=True)
    if kind == "dynunet":
        from monai.losses import DiceCELoss
        from monai.networks.nets import DynUNet

        strides = [[1, 1, 1], [2, 2, 1], [2, 2, 2], [2, 2, 2], [2, 2, 1]]
        net = DynUNet(spatial_dims=3, in_channels=4, out_channels=4, kernel_size=[[3, 3, 3]] * 5, strides=strides,
                      upsample_kernel_size=strides[1:], norm_name="instance")  # fmt: skip
        return net, DiceCELoss(to_onehot_y=True, softmax=True)
    if kind == "densenet":
        from monai.networks.nets import DenseNet121

        return DenseNet121(spatial_dims=2, in_channels=1, out_channels=6), torch.nn.CrossEntropyLoss()
    return None, None
