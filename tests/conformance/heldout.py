"""The held-out table: chains of the same kinds as the conformance table's, written after it, over the
multi-modal sets (other key names, 2D and 3D, a multi-class label, flipped affines, per-item values).

Rows as in `chaintable`; `ALL` is the three tables (with `tutorials`), the one the runners and the generated
pipeline files read.
"""

from __future__ import annotations

from typing import Any

from chaintable import ROWS, Row
from transforms import TRANSFORMS
from tutorials import TUTORIALS

M = ["t1", "t2", "seg"]  # 3D: two modalities and a 0..3 label
MI = ["image", "seg"]  # after the modalities are concatenated
P = ["img", "msk"]  # 2D: a two-channel image and a 0..2 label


# --- user code ---
def twice_plus_one(x: Any) -> Any:
    return x * 2 + 1


def squared(x: Any) -> Any:
    return x * x


def halve_t1(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function over the whole dict."""
    return {**d, "t1": d["t1"] / 2}


def shift_img(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "img": d["img"] - 0.25}


def older(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function that reads a datalist value (the head's non-tensor output)."""
    return {**d, "t1": d["t1"] + d["age"] / 100}


def tag_ct(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function adding per-item values of its own: one repeated string, an int, a list."""
    return {**d, "modality": "CT", "n_views": 2, "views": ["ax", "ax"]}


def first_sample(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return samples[0]


# --- heads ---
def load3(keys: list[str] = M) -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, LoadImaged

    return [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys)]


def head_mm() -> list[Any]:
    from monai.transforms import ConcatItemsd, DeleteItemsd, Orientationd, ScaleIntensityRanged

    return [*load3(), Orientationd(keys=M, axcodes="RAS"),
            ScaleIntensityRanged(keys="t2", a_min=-200, a_max=1100, b_min=0.0, b_max=1.0, clip=True),
            ConcatItemsd(keys=["t1", "t2"], name="image"), DeleteItemsd(keys=["t1", "t2"])]  # fmt: skip


def head_orient() -> list[Any]:
    from monai.transforms import Orientationd

    return [*load3(), Orientationd(keys=M, axcodes="RAS")]


def head_spacing_fg() -> list[Any]:
    from monai.transforms import CropForegroundd, Spacingd

    return [*load3(), Spacingd(keys=M, pixdim=(1.4, 1.4, 1.4), mode=("bilinear", "bilinear", "nearest")),
            CropForegroundd(keys=M, source_key="seg", margin=1)]  # fmt: skip


def head_onehot() -> list[Any]:
    from monai.transforms import AsDiscreted

    return [*load3(["t1", "seg"]), AsDiscreted(keys="seg", to_onehot=4)]


def head_cast() -> list[Any]:
    import torch
    from monai.transforms import CastToTyped

    return [*load3(), CastToTyped(keys=["t1", "seg"], dtype=(torch.float16, torch.uint8))]


def head_fgbg_named() -> list[Any]:
    from monai.transforms import FgBgToIndicesd

    fgbg = FgBgToIndicesd(keys="seg", fg_postfix="_pos", bg_postfix="_neg", image_key="t1", image_threshold=0.2)
    return [*load3(["t1", "seg"]), fgbg]


def head_classes_named() -> list[Any]:
    from monai.transforms import ClassesToIndicesd

    return [*load3(["t1", "seg"]), ClassesToIndicesd(keys="seg", indices_postfix="_by_class", num_classes=4)]


def head_lambdad() -> list[Any]:
    from monai.transforms import Lambdad

    return [*load3(), Lambdad(keys="t1", func=twice_plus_one)]


def head_nested() -> list[Any]:
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd

    return [Compose([LoadImaged(keys=M), Compose([EnsureChannelFirstd(keys=M), Orientationd(keys=M, axcodes="LPS")])])]


def head_select() -> list[Any]:
    from monai.transforms import SelectItemsd

    return [*load3(), SelectItemsd(keys=["t1", "seg"])]


def head_copy() -> list[Any]:
    from monai.transforms import CopyItemsd

    return [*load3(), CopyItemsd(keys="seg", times=1, names="seg_copy")]


def head_typed_values() -> list[Any]:
    from monai.transforms import EnsureTyped

    return [*load3(), EnsureTyped(keys=["age", "dose"])]


def head_untracked() -> list[Any]:
    from monai.transforms import EnsureTyped, ScaleIntensityd

    return [*load3(), ScaleIntensityd(keys="t2"), EnsureTyped(keys=M, track_meta=False)]


def head_numpy() -> list[Any]:
    from monai.transforms import EnsureTyped

    return [*load3(), EnsureTyped(keys=M, data_type="numpy")]


def head_meta_dicts() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, LoadImaged

    return [LoadImaged(keys=M, image_only=False), EnsureChannelFirstd(keys=M)]


def head_half_typed() -> list[Any]:
    import torch
    from monai.transforms import EnsureTyped

    return [*load3(), EnsureTyped(keys="t1", dtype=torch.float16)]


def load2() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, LoadImaged, ScaleIntensityd

    return [LoadImaged(keys=P), EnsureChannelFirstd(keys=P), ScaleIntensityd(keys="img", channel_wise=True)]


def head_2d_indices() -> list[Any]:
    from monai.transforms import ClassesToIndicesd, FgBgToIndicesd

    return [*load2(), ClassesToIndicesd(keys="msk", num_classes=3, image_key="img", image_threshold=0.1),
            FgBgToIndicesd(keys="msk")]  # fmt: skip


def head_2d_onehot() -> list[Any]:
    from monai.transforms import AsDiscreted

    return [*load2(), AsDiscreted(keys="msk", to_onehot=3)]


# --- tails ---
def crop(keys: list[str], roi: tuple[int, ...], **kw: Any) -> Any:
    from monai.transforms import RandSpatialCropd

    return RandSpatialCropd(keys=keys, roi_size=roi, random_size=False, **kw)


def tail_mm_posneg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd, RandRotate90d

    return [RandCropByPosNegLabeld(keys=MI, label_key="seg", spatial_size=(10, 10, 10), pos=2, neg=1, num_samples=3,
                                   image_key="image", image_threshold=0.3),
            RandFlipd(keys=MI, prob=0.5, spatial_axis=[0, 2]),
            RandRotate90d(keys=MI, prob=0.5, spatial_axes=(1, 2))]  # fmt: skip


def tail_mm_classes() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, RandZoomd

    return [RandCropByLabelClassesd(keys=MI, label_key="seg", spatial_size=(8, 8, 8), ratios=[0, 1, 2, 1],
                                    num_classes=4, num_samples=4),
            RandZoomd(keys=MI, prob=1.0, min_zoom=0.8, max_zoom=1.2, mode=("trilinear", "nearest"))]  # fmt: skip


def tail_fg_posneg_smaller() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, ResizeWithPadOrCropd

    return [RandCropByPosNegLabeld(keys=M, label_key="seg", spatial_size=(14, 14, 30), pos=1, neg=1, num_samples=2,
                                   allow_smaller=True),
            ResizeWithPadOrCropd(keys=M, spatial_size=(14, 14, 14))]  # fmt: skip


def tail_onehot_classes() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, SpatialPadd

    return [RandCropByLabelClassesd(keys=["t1", "seg"], label_key="seg", spatial_size=(24, 10, 10), num_samples=2,
                                    allow_smaller=True),
            SpatialPadd(keys=["t1", "seg"], spatial_size=(24, 10, 10))]  # fmt: skip


def tail_given_fgbg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandGaussianNoised

    return [RandCropByPosNegLabeld(keys=["t1", "seg"], label_key="seg", spatial_size=(9, 9, 9), pos=0.5, neg=1,
                                   num_samples=1, fg_indices_key="seg_pos", bg_indices_key="seg_neg"),
            RandGaussianNoised(keys="t1", prob=0.5, std=0.1)]  # fmt: skip


def tail_given_classes() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, RandShiftIntensityd

    return [RandCropByLabelClassesd(keys=["t1", "seg"], label_key="seg", spatial_size=(9, 9, 9), ratios=[1, 1, 1, 1],
                                    num_classes=4, num_samples=3, indices_key="seg_by_class"),
            RandShiftIntensityd(keys="t1", offsets=0.3, prob=0.7)]  # fmt: skip


def tail_one_of_nested() -> list[Any]:
    from monai.transforms import Compose, Lambdad, OneOf, RandAffined, RandFlipd, RandRotate90d

    return [crop(MI, (12, 12, 12)),
            OneOf([Compose([RandFlipd(keys=MI, prob=1.0), RandRotate90d(keys=MI, prob=1.0)]),
                   RandAffined(keys=MI, prob=1.0, translate_range=(2, 2, 2), mode=("bilinear", "nearest")),
                   Lambdad(keys="image", func=squared)], weights=[2, 1, 1])]  # fmt: skip


def tail_random_order_intensity() -> list[Any]:
    from monai.transforms import RandGaussianNoised, RandomOrder, RandScaleIntensityd, RandShiftIntensityd

    return [crop(M, (12, 12, 12)),
            RandomOrder([RandScaleIntensityd(keys="t1", factors=0.2, prob=1.0),
                         RandShiftIntensityd(keys=["t1", "t2"], offsets=5, prob=0.5),
                         RandGaussianNoised(keys="t1", prob=0.5, std=0.05)])]  # fmt: skip


def tail_lambda_fn() -> list[Any]:
    from monai.transforms import Lambdad, RandFlipd

    return [crop(M, (12, 12, 12)), Lambdad(keys="t1", func=squared), halve_t1, RandFlipd(keys=M, prob=0.5)]


def tail_affine_nearest() -> list[Any]:
    from monai.transforms import RandAffined

    return [crop(M, (12, 12, 12)),
            RandAffined(keys=M, prob=0.8, rotate_range=(0.2, 0.0, 0.0), scale_range=0.1, translate_range=2,
                        mode=("bilinear", "bilinear", "nearest"), padding_mode="border")]  # fmt: skip


def tail_zoom_rotate() -> list[Any]:
    from monai.transforms import RandRotated, RandZoomd

    return [crop(MI, (12, 12, 12)), RandZoomd(keys=MI, prob=0.7, mode=("trilinear", "nearest")),
            RandRotated(keys=MI, range_x=0.3, prob=1.0, mode=("bilinear", "nearest"))]  # fmt: skip


def tail_half_some() -> list[Any]:
    from monai.transforms import RandGaussianNoised, RandScaleIntensityd

    return [crop(M, (12, 12, 12)), RandGaussianNoised(keys="t1", prob=0.5, std=0.1),
            RandScaleIntensityd(keys=["t1", "t2"], factors=0.2, prob=0.5)]  # fmt: skip


def tail_cast() -> list[Any]:
    import torch
    from monai.transforms import CastToTyped, RandShiftIntensityd

    return [crop(M, (12, 12, 12)), CastToTyped(keys=["t1", "seg"], dtype=(torch.float64, torch.int64)),
            RandShiftIntensityd(keys=["t1", "t2"], offsets=0.4, prob=0.5)]  # fmt: skip


def tail_flips3() -> list[Any]:
    from monai.transforms import RandAxisFlipd, RandFlipd, RandRotate90d

    return [crop(M, (12, 14, 12)), RandFlipd(keys=M, prob=0.5), RandAxisFlipd(keys=M, prob=0.5),
            RandRotate90d(keys=M, prob=0.5, spatial_axes=(0, 2))]  # fmt: skip


def tail_track_meta() -> list[Any]:
    import torch
    from monai.transforms import EnsureTyped, RandFlipd

    return [
        crop(M, (12, 12, 12)),
        RandFlipd(keys=M, prob=0.5),
        EnsureTyped(keys=M, track_meta=True, dtype=torch.float32),
    ]


def tail_items_ops() -> list[Any]:
    from monai.transforms import ConcatItemsd, CopyItemsd, DeleteItemsd, RandFlipd, SelectItemsd

    return [crop(M, (12, 12, 12)), CopyItemsd(keys="seg", names="seg2"), ConcatItemsd(keys=["t1", "t2"], name="both"),
            DeleteItemsd(keys="t2"), RandFlipd(keys=["both", "seg2"], prob=0.5),
            SelectItemsd(keys=["both", "seg", "seg2"])]  # fmt: skip


def tail_select_drops_values() -> list[Any]:
    from monai.transforms import RandFlipd, SelectItemsd

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5), SelectItemsd(keys=["t1", "seg"])]


def tail_map_items_false() -> list[Any]:
    from monai.transforms import Lambda, RandCropByPosNegLabeld, RandFlipd

    return [RandCropByPosNegLabeld(keys=M, label_key="seg", spatial_size=(10, 10, 10), num_samples=2),
            Lambda(first_sample), RandFlipd(keys=M, prob=0.5)]  # fmt: skip


def tail_random_size() -> list[Any]:
    from monai.transforms import RandSpatialCropd, ResizeWithPadOrCropd

    return [RandSpatialCropd(keys=M, roi_size=(8, 8, 8), max_roi_size=(14, 14, 14), random_size=True),
            ResizeWithPadOrCropd(keys=M, spatial_size=(12, 12, 12))]  # fmt: skip


def tail_scale_crop_ragged() -> list[Any]:
    from monai.transforms import RandFlipd, RandScaleCropd, ResizeWithPadOrCropd

    return [RandScaleCropd(keys=M, roi_scale=0.5, max_roi_scale=0.8, random_size=True),
            RandFlipd(keys=M, prob=0.5), ResizeWithPadOrCropd(keys=M, spatial_size=(12, 12, 12))]  # fmt: skip


def tail_crop_samples() -> list[Any]:
    from monai.transforms import RandFlipd, RandSpatialCropSamplesd

    return [RandSpatialCropSamplesd(keys=M, roi_size=(10, 10, 10), num_samples=3, random_size=False),
            RandFlipd(keys=M, prob=0.5)]  # fmt: skip


def tail_intensity_more() -> list[Any]:
    from monai.transforms import RandAdjustContrastd, RandGaussianSmoothd, RandStdShiftIntensityd

    return [crop(MI, (12, 12, 12)), RandStdShiftIntensityd(keys="image", factors=0.3, prob=0.6),
            RandAdjustContrastd(keys="image", prob=0.6), RandGaussianSmoothd(keys="image", prob=0.5)]  # fmt: skip


def tail_deterministic_after() -> list[Any]:
    from monai.transforms import NormalizeIntensityd, RandFlipd, ScaleIntensityRanged

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5),
            ScaleIntensityRanged(keys="t2", a_min=-100, a_max=900, b_min=0.0, b_max=1.0, clip=True),
            NormalizeIntensityd(keys="t1", channel_wise=True)]  # fmt: skip


def tail_centre_rot() -> list[Any]:
    from monai.transforms import RandRotate90d, ResizeWithPadOrCropd

    return [crop(M, (12, 12, 12), random_center=False), ResizeWithPadOrCropd(keys=M, spatial_size=(12, 12, 12)),
            RandRotate90d(keys=M, prob=0.5)]  # fmt: skip


def tail_onehot_in_tail() -> list[Any]:
    import torch
    from monai.transforms import AsDiscreted, CastToTyped, RandFlipd

    return [crop(M, (12, 12, 12)), CastToTyped(keys="seg", dtype=torch.long), AsDiscreted(keys="seg", to_onehot=4),
            RandFlipd(keys=M, prob=0.5)]  # fmt: skip


def tail_nested_deep() -> list[Any]:
    from monai.transforms import Compose, RandFlipd, RandRotate90d, RandScaleIntensityd

    inner = Compose([RandRotate90d(keys=M, prob=0.5), RandScaleIntensityd(keys="t1", factors=0.1, prob=0.5)])
    return [Compose([crop(M, (12, 12, 12)), Compose([RandFlipd(keys=M, prob=0.5), inner])])]


def tail_values() -> list[Any]:
    from monai.transforms import RandFlipd

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5, spatial_axis=1)]


def tail_untracked() -> list[Any]:
    from monai.transforms import RandFlipd, RandGaussianNoised

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5), RandGaussianNoised(keys="t2", prob=1.0, std=0.2)]


def tail_copy_head() -> list[Any]:
    from monai.transforms import RandFlipd

    keys = [*M, "seg_copy"]
    return [crop(keys, (12, 12, 12)), RandFlipd(keys=keys, prob=0.5)]


def tail_t1_seg() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    keys = ["t1", "seg"]
    return [crop(keys, (12, 12, 12)), RandFlipd(keys=keys, prob=0.5), RandRotate90d(keys=keys, prob=0.5)]


def tail_cast_posneg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd

    return [RandCropByPosNegLabeld(keys=M, label_key="seg", spatial_size=(10, 10, 10), pos=1, neg=1, num_samples=2),
            RandFlipd(keys=M, prob=0.5, spatial_axis=0)]  # fmt: skip


def tail_int16_some() -> list[Any]:
    from monai.transforms import RandGaussianNoised, RandShiftIntensityd

    return [crop(M, (12, 12, 12)), RandGaussianNoised(keys="t2", prob=0.5, std=3.0),
            RandShiftIntensityd(keys="t2", offsets=3, prob=1.0)]  # fmt: skip


def tail_fn_reads_value() -> list[Any]:
    from monai.transforms import RandFlipd

    return [crop(M, (12, 12, 12)), older, RandFlipd(keys=M, prob=0.5)]


def tail_lambdad_value() -> list[Any]:
    from monai.transforms import Lambdad

    return [crop(M, (12, 12, 12)), Lambdad(keys="age", func=twice_plus_one)]


def tail_delete_value() -> list[Any]:
    from monai.transforms import DeleteItemsd, RandFlipd

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5), DeleteItemsd(keys=["pid", "tags"])]


def tail_one_of_value() -> list[Any]:
    from monai.transforms import Lambdad, OneOf, RandFlipd

    return [crop(M, (12, 12, 12)), OneOf([RandFlipd(keys=M, prob=1.0), Lambdad(keys="pid", func=str.upper)])]


def tail_2d_posneg_select() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, ResizeWithPadOrCropd, SelectItemsd

    return [RandCropByPosNegLabeld(keys=P, label_key="msk", spatial_size=(30, 16), num_samples=3, allow_smaller=True),
            ResizeWithPadOrCropd(keys=P, spatial_size=(24, 16)),
            SelectItemsd(keys=["img", "msk", "pid", "tags"])]  # fmt: skip


def tail_classes_threshold() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, RandFlipd

    return [RandCropByLabelClassesd(keys=M, label_key="seg", spatial_size=(10, 10, 10), ratios=[1, 1, 2, 0],
                                    num_classes=4, num_samples=2, image_key="t1", image_threshold=0.4),
            RandFlipd(keys=M, prob=0.5)]  # fmt: skip


def tail_given_fgbg_smaller() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, ResizeWithPadOrCropd

    return [RandCropByPosNegLabeld(keys=["t1", "seg"], label_key="seg", spatial_size=(18, 18, 18), num_samples=2,
                                   fg_indices_key="seg_pos", bg_indices_key="seg_neg", allow_smaller=True),
            ResizeWithPadOrCropd(keys=["t1", "seg"], spatial_size=(16, 16, 16))]  # fmt: skip


def tail_lazy_flags() -> list[Any]:
    from monai.transforms import RandAffined, RandRotate90d

    return [crop(M, (12, 12, 12), lazy=True), RandRotate90d(keys=M, prob=0.5, lazy=True),
            RandAffined(keys=M, prob=1.0, rotate_range=(0.2, 0.2, 0.2), mode=("bilinear", "bilinear", "nearest"),
                        lazy=True)]  # fmt: skip


def tail_label_crop_image_only() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd

    return [RandCropByPosNegLabeld(keys=["t1"], label_key="seg", spatial_size=(10, 10, 10), num_samples=2),
            RandFlipd(keys="t1", prob=0.5)]  # fmt: skip


def tail_crop_some_keys() -> list[Any]:
    from monai.transforms import RandFlipd, RandGaussianNoised

    return [crop(["t1", "seg"], (12, 12, 12)), RandFlipd(keys=["t1", "seg"], prob=0.5),
            RandGaussianNoised(keys="t2", prob=0.5, std=2.0)]  # fmt: skip


def tail_some_of_count() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d, RandShiftIntensityd, SomeOf

    return [crop(M, (12, 12, 12)),
            SomeOf([RandFlipd(keys=M, prob=1.0), RandRotate90d(keys=M, prob=1.0),
                    RandShiftIntensityd(keys="t1", offsets=0.5, prob=1.0)], num_transforms=(1, 3))]  # fmt: skip


def tail_missing_keys() -> list[Any]:
    from monai.transforms import RandFlipd, RandScaleIntensityd

    return [crop(M, (12, 12, 12)), RandFlipd(keys=["t1", "seg", "absent"], prob=0.5, allow_missing_keys=True),
            RandScaleIntensityd(keys=["t1", "nothing"], factors=0.2, prob=1.0, allow_missing_keys=True)]  # fmt: skip


def tail_lambdad_new_key() -> list[Any]:
    from monai.transforms import Lambdad, RandFlipd

    return [crop(M, (12, 12, 12)), Lambdad(keys="t1", func=squared, overwrite="t1_sq"),
            RandFlipd(keys=["t1", "t1_sq"], prob=0.5)]  # fmt: skip


def tail_numpy() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    return [crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5), RandRotate90d(keys=M, prob=0.5)]


def tail_rand_lambda() -> list[Any]:
    from monai.transforms import DataStatsd, RandLambdad, ToTensord

    return [crop(M, (12, 12, 12)), RandLambdad(keys="t1", func=squared, prob=0.5),
            DataStatsd(keys="t1", data_shape=True, value_range=False), ToTensord(keys=M)]  # fmt: skip


def tail_onehot_posneg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd

    return [RandCropByPosNegLabeld(keys=["t1", "seg"], label_key="seg", spatial_size=(10, 10, 10), num_samples=2,
                                   pos=1, neg=1),
            RandFlipd(keys=["t1", "seg"], prob=0.5)]  # fmt: skip


def tail_adds_values_first() -> list[Any]:
    from monai.transforms import RandFlipd

    return [tag_ct, crop(M, (12, 12, 12)), RandFlipd(keys=M, prob=0.5)]


def tail_adds_values() -> list[Any]:
    from monai.transforms import RandFlipd

    return [crop(["t1", "seg"], (12, 12, 12)), tag_ct, RandFlipd(keys=["t1", "seg"], prob=0.5)]


# --- 2D tails ---
def tail_2d_posneg() -> list[Any]:
    from monai.transforms import RandAffined, RandCropByPosNegLabeld, RandRotate90d

    return [RandCropByPosNegLabeld(keys=P, label_key="msk", spatial_size=(12, 12), pos=1, neg=2, num_samples=4),
            RandRotate90d(keys=P, prob=0.5),
            RandAffined(keys=P, prob=0.5, rotate_range=0.4, mode=("bilinear", "nearest"))]  # fmt: skip


def tail_2d_classes_smaller() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, ResizeWithPadOrCropd

    return [RandCropByLabelClassesd(keys=P, label_key="msk", spatial_size=(30, 12), ratios=[1, 2, 3], num_classes=3,
                                    num_samples=2, allow_smaller=True),
            ResizeWithPadOrCropd(keys=P, spatial_size=(24, 12))]  # fmt: skip


def tail_2d_zoom_noise() -> list[Any]:
    from monai.transforms import RandAdjustContrastd, RandGaussianNoised, RandZoomd

    return [crop(P, (14, 14)), RandZoomd(keys=P, prob=0.8, min_zoom=0.9, max_zoom=1.3, mode=("bilinear", "nearest")),
            RandGaussianNoised(keys="img", prob=0.5), RandAdjustContrastd(keys="img", prob=0.5)]  # fmt: skip


def tail_2d_onehot_classes() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd, RandFlipd

    return [RandCropByLabelClassesd(keys=P, label_key="msk", spatial_size=(10, 10), num_samples=1),
            RandFlipd(keys=P, prob=0.5)]  # fmt: skip


def tail_2d_one_of() -> list[Any]:
    from monai.transforms import OneOf, RandFlipd, RandRotate90d, RandScaleIntensityd

    return [crop(P, (14, 14)), OneOf([RandFlipd(keys=P, prob=1.0), RandRotate90d(keys=P, prob=1.0),
                                      RandScaleIntensityd(keys="img", factors=0.3, prob=1.0)])]  # fmt: skip


def tail_2d_posneg_image() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandRotated

    return [RandCropByPosNegLabeld(keys=P, label_key="msk", spatial_size=(12, 12), num_samples=2, image_key="img",
                                   image_threshold=0.2),
            RandRotated(keys=P, range_x=0.5, prob=0.8, mode=("bilinear", "nearest"))]  # fmt: skip


def tail_2d_given_classes() -> list[Any]:
    from monai.transforms import DeleteItemsd, RandCropByLabelClassesd, RandFlipd

    return [RandCropByLabelClassesd(keys=P, label_key="msk", spatial_size=(10, 10), num_classes=3, num_samples=2,
                                    indices_key="msk_cls_indices"),
            RandFlipd(keys=P, prob=0.5),
            DeleteItemsd(keys=["msk_cls_indices", "msk_fg_indices", "msk_bg_indices"])]  # fmt: skip


def tail_2d_given_fgbg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandRotate90d

    return [RandCropByPosNegLabeld(keys=P, label_key="msk", spatial_size=(10, 10), num_samples=3,
                                   fg_indices_key="msk_fg_indices", bg_indices_key="msk_bg_indices"),
            RandRotate90d(keys=P, prob=0.5)]  # fmt: skip


def tail_2d_fn() -> list[Any]:
    from monai.transforms import Lambdad, RandFlipd

    return [crop(P, (14, 14)), Lambdad(keys="img", func=twice_plus_one), shift_img, RandFlipd(keys=P, prob=0.5)]


HELDOUT: dict[str, Row] = {
    r.name: r
    for r in [
        Row("ho-mm-posneg-3-samples", "mm3d", head_mm, tail_mm_posneg),
        Row("ho-mm-classes-ratios-4-samples", "mm3d", head_mm, tail_mm_classes),
        Row("ho-spacing-fg-posneg-allow-smaller", "mm3d-ragged", head_spacing_fg, tail_fg_posneg_smaller),
        Row("ho-onehot-classes-allow-smaller", "mm3d", head_onehot, tail_onehot_classes),
        Row("ho-given-fgbg-postfix", "mm3d", head_fgbg_named, tail_given_fgbg),
        Row("ho-given-classes-postfix", "mm3d-ragged", head_classes_named, tail_given_classes),
        Row("ho-one-of-nested-compose", "mm3d", head_mm, tail_one_of_nested),
        Row("ho-random-order-intensity", "mm3d", load3, tail_random_order_intensity),
        Row("ho-lambdad-head-and-tail", "mm3d", head_lambdad, tail_lambda_fn),
        Row("ho-affine-nearest-border", "mm3d", load3, tail_affine_nearest),
        Row("ho-zoom-rotate", "mm3d-ragged", head_mm, tail_zoom_rotate),
        Row("ho-half-head-some-fire", "mm3d", head_cast, tail_half_some),
        Row("ho-cast-in-tail", "mm3d", load3, tail_cast),
        Row("ho-flips-ragged-orientation", "mm3d-ragged", head_orient, tail_flips3),
        Row("ho-track-meta-in-tail", "mm3d", load3, tail_track_meta),
        Row("ho-items-ops-in-tail", "mm3d", load3, tail_items_ops),
        Row("ho-select-drops-values", "mm3d", load3, tail_select_drops_values),
        Row(
            "ho-map-items-false-log-stats",
            "mm3d",
            load3,
            tail_map_items_false,
            compose={"map_items": False, "log_stats": True},
        ),  # fmt: skip
        Row("ho-log-stats", "mm3d-ragged", head_orient, tail_flips3, compose={"log_stats": True}),
        Row("ho-random-size-crop", "mm3d-ragged", load3, tail_random_size),
        Row("ho-scale-crop-ragged", "mm3d-ragged", load3, tail_scale_crop_ragged),
        Row("ho-crop-samples", "mm3d", load3, tail_crop_samples, loader={"batch_size": 3}),
        Row("ho-intensity-more", "mm3d", head_mm, tail_intensity_more),
        Row(
            "ho-deterministic-after-crop",
            "mm3d",
            load3,
            tail_deterministic_after,
            atol=1e-5,
            note="NormalizeIntensityd: batched mean/std (9.5e-7)",
        ),
        Row("ho-centre-crop-fg-ragged", "mm3d-ragged", head_spacing_fg, tail_centre_rot),
        Row("ho-onehot-in-tail", "mm3d", load3, tail_onehot_in_tail),
        Row("ho-nested-head-and-tail", "mm3d", head_nested, tail_nested_deep),
        Row("ho-nested-tail-seed-transform", "mm3d", load3, tail_nested_deep, seeding="transform"),
        Row("ho-random-order-determinism", "mm3d", load3, tail_random_order_intensity, seeding="determinism"),
        Row("ho-nested-head-lps", "mm3d", head_nested, tail_t1_seg),  # the head's Compose takes a seed first
        Row("ho-select-in-head", "mm3d", head_select, tail_t1_seg),
        Row("ho-copy-in-head", "mm3d", head_copy, tail_copy_head),
        Row("ho-typed-values-in-head", "mm3d-ragged", head_typed_values, tail_values, loader={"batch_size": 3}),
        Row("ho-untracked-head", "mm3d", head_untracked, tail_untracked),
        Row(
            "ho-2d-posneg-4-samples",
            "mm2d",
            load2,
            tail_2d_posneg,
            atol=1e-5,
            note="RandAffined in 2D: one batched grid_sample (2.9e-7)",
        ),
        Row("ho-2d-classes-allow-smaller-ragged", "mm2d-ragged", load2, tail_2d_classes_smaller),
        Row("ho-2d-zoom-noise", "mm2d", load2, tail_2d_zoom_noise),
        Row("ho-2d-onehot-classes", "mm2d", head_2d_onehot, tail_2d_onehot_classes, loader={"batch_size": 1}),
        Row("ho-2d-one-of-seed-transform", "mm2d", load2, tail_2d_one_of, seeding="transform"),
        Row("ho-2d-lambdad-and-function", "mm2d-ragged", load2, tail_2d_fn, loader={"batch_size": 3}),
        Row("ho-cast-head-posneg-uint8", "mm3d", head_cast, tail_cast_posneg),
        Row("ho-int16-noise-some-fire", "mm3d", load3, tail_int16_some),
        Row("ho-function-reads-value", "mm3d", load3, tail_fn_reads_value),
        Row("ho-lambdad-on-value", "mm3d", load3, tail_lambdad_value),
        Row("ho-delete-values-in-tail", "mm3d", load3, tail_delete_value),
        Row("ho-one-of-value", "mm3d", load3, tail_one_of_value),
        Row("ho-2d-posneg-select-values", "mm2d-ragged", load2, tail_2d_posneg_select),
        Row("ho-classes-image-threshold", "mm3d-ragged", load3, tail_classes_threshold),
        Row("ho-given-fgbg-allow-smaller", "mm3d-ragged", head_fgbg_named, tail_given_fgbg_smaller),
        Row(
            "ho-lazy-none-transform-flags",
            "mm3d",
            load3,
            tail_lazy_flags,
            compose={"lazy": None},
            atol=1e-5,
            note="lazy crop + rotate90 + affine resampled at once (1.2e-7)",
        ),
        Row("ho-label-crop-image-only", "mm3d", load3, tail_label_crop_image_only),
        Row("ho-crop-some-keys", "mm3d", load3, tail_crop_some_keys),
        Row("ho-some-of-count", "mm3d", load3, tail_some_of_count),
        Row("ho-allow-missing-keys", "mm3d", load3, tail_missing_keys),
        Row("ho-lambdad-new-key", "mm3d", load3, tail_lambdad_new_key),
        Row("ho-numpy-head", "mm3d", head_numpy, tail_numpy),
        Row("ho-2d-posneg-image-determinism", "mm2d", load2, tail_2d_posneg_image, seeding="determinism"),
        Row("ho-meta-dicts-image-only-false", "mm3d", head_meta_dicts, tail_values),
        Row("ho-half-typed-some-fire", "mm3d", head_half_typed, tail_half_some),
        Row("ho-rand-lambda-datastats-totensor", "mm3d-ragged", load3, tail_rand_lambda),
        Row("ho-onehot-posneg", "mm3d", head_onehot, tail_onehot_posneg),
        Row("ho-2d-given-classes", "mm2d-ragged", head_2d_indices, tail_2d_given_classes),
        Row(
            "ho-2d-given-fgbg-lists-reach-collate",
            "mm2d",
            head_2d_indices,
            tail_2d_given_fgbg,
            raises=r"shapes differ|equal size",
        ),  # fmt: skip
        Row("ho-function-adds-values", "mm3d", head_select, tail_adds_values),  # "CT" twice: ["CT", "CT"]
        Row("ho-function-adds-values-batch-1", "mm3d", head_select, tail_adds_values, loader={"batch_size": 1}),
        Row("ho-function-adds-values-ragged", "mm3d-ragged", load3, tail_adds_values_first),  # MONAI per item
    ]
}

ALL: dict[str, Row] = {**ROWS, **HELDOUT, **TUTORIALS, **TRANSFORMS}
