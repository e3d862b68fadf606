"""The conformance table: one row per chain the loaders must run exactly as MONAI runs it.

Adding a chain is one `Row` in `ROWS`: its data set, a function giving fresh head transforms, one giving
fresh tail transforms, the user's Compose options and PreparedLoader options. `atol` is 0 (bit for bit)
unless the row says why it rounds; `refused` is the one-line refusal PreparedLoader gives at construction
instead (a regex); `xfail` names a known gap and its owner (strict: the row fails once fixed).

`prep cache` runs a generated pipeline file that imports this module, so every transform here is built
by the same code on both sides (the head's fingerprint hashes user functions by their source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

K = ["image", "label"]
CROP3 = (16, 16, 16)
CROP2 = (16, 16)


@dataclass(frozen=True)
class Row:
    name: str
    data: str  # "3d" (equal shapes), "3d-ragged", "2d" (with a class label and a modality string)
    head: Callable[[], list[Any]]
    tail: Callable[[], list[Any]]
    compose: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, Any] = field(default_factory=dict)
    atol: float = 0.0
    note: str = ""
    refused: str | None = None  # PreparedLoader refuses at construction with this (regex)
    raises: str | None = None  # MONAI's collate raises on this chain: the loader must raise too (regex)
    xfail: str | None = None
    seeding: str = "loader"  # "loader": loader.set_random_state; "transform": before building; "determinism"
    slow: bool = False

    def chain(self) -> Any:
        from monai.transforms import Compose

        return Compose([*self.head(), *self.tail()], **self.compose)


# --- heads ---
def head_3d() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, LoadImaged, ScaleIntensityRanged

    return [
        LoadImaged(keys=K),
        EnsureChannelFirstd(keys=K),
        ScaleIntensityRanged(keys="image", a_min=0.0, a_max=4.0, b_min=0.0, b_max=1.0, clip=True),
    ]


def head_spacing() -> list[Any]:
    from monai.transforms import Spacingd

    return [*head_3d(), Spacingd(keys=K, pixdim=(1.2, 1.2, 1.2), mode=("bilinear", "nearest"))]


def head_half() -> list[Any]:
    import torch
    from monai.transforms import CastToTyped

    return [*head_3d(), CastToTyped(keys="image", dtype=torch.float16)]


def head_bf16() -> list[Any]:
    import torch
    from monai.transforms import CastToTyped

    return [*head_3d(), CastToTyped(keys="image", dtype=torch.bfloat16)]  # stored as its 2-byte pattern


def head_2d() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, EnsureTyped, LoadImaged

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), EnsureTyped(keys="class")]


def head_load() -> list[Any]:
    from monai.transforms import EnsureChannelFirstd, LoadImaged

    return [LoadImaged(keys=K), EnsureChannelFirstd(keys=K)]


def head_one_compose_fg() -> list[Any]:
    """The whole head in one Compose: MONAI's PersistentDataset then caches nothing (a Compose is random by its
    rule), so every item keeps the head's MetaTensors and CropForegroundd's coordinates as the head gives them."""
    from monai.transforms import Compose, CropForegroundd

    return [Compose([*head_3d(), CropForegroundd(keys=K, source_key="image", margin=1)])]


# --- user code a chain may hold ---
def clip_image(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function over the whole dict (not a MONAI Transform)."""
    return {**d, "image": d["image"].clamp(0.1, 0.9)}


def keys_seen(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function that fails if the loader shows it a key the user never made."""
    hidden = sorted(k for k in d if str(k).startswith("_"))
    if hidden:
        raise KeyError(f"internal keys visible to a user transform: {hidden}")
    return d


SHARED_RANGE = [0.1, 0.9]  # one list object every item gets


def add_shared_list(d: dict[str, Any]) -> dict[str, Any]:
    """A plain function adding one list object to every item (as long as a batch of two: not one value a row)."""
    return {**d, "window": SHARED_RANGE, "names": ["image", "label"]}


def _subclass_crop() -> type:
    from monai.transforms import RandSpatialCropd

    class DoublingCropd(RandSpatialCropd):
        """A user's crop subclass whose own __call__ does more than crop."""

        def __call__(self, data: Any, lazy: bool | None = None) -> Any:
            out = super().__call__(data, lazy=lazy)
            out["image"] = out["image"] * 2
            return out

    return DoublingCropd


# --- tails ---
def crop3(**kw: Any) -> Any:
    from monai.transforms import RandSpatialCropd

    return RandSpatialCropd(keys=K, roi_size=CROP3, random_size=False, **kw)


def crop2() -> Any:
    from monai.transforms import RandSpatialCropd

    return RandSpatialCropd(keys=K, roi_size=CROP2, random_size=False)


def tail_flips() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    return [crop3(), RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandRotate90d(keys=K, prob=0.5, max_k=3)]


def tail_posneg() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd

    return [
        RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(12, 12, 12), pos=1, neg=1, num_samples=2),
        RandFlipd(keys=K, prob=0.5, spatial_axis=1),
    ]


def head_fgbg() -> list[Any]:
    from monai.transforms import FgBgToIndicesd

    return [*head_3d(), FgBgToIndicesd(keys="label", image_key="image", image_threshold=0.3)]


def tail_posneg_given() -> list[Any]:
    from monai.transforms import RandCropByPosNegLabeld, RandFlipd

    return [
        RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(12, 12, 12), pos=1, neg=1, num_samples=2,
                               fg_indices_key="label_fg_indices", bg_indices_key="label_bg_indices"),
        RandFlipd(keys=K, prob=0.5, spatial_axis=1),
    ]  # fmt: skip


def head_classes() -> list[Any]:
    from monai.transforms import ClassesToIndicesd

    return [*head_3d(), ClassesToIndicesd(keys="label", num_classes=4, image_key="image", image_threshold=0.3)]


def tail_classes_given() -> list[Any]:
    from monai.transforms import RandCropByLabelClassesd

    return [RandCropByLabelClassesd(keys=K, label_key="label", spatial_size=(12, 12, 12), num_classes=4,
                                    num_samples=2, indices_key="label_cls_indices")]  # fmt: skip


def tail_intensity() -> list[Any]:
    from monai.transforms import RandGaussianNoised, RandScaleIntensityd, RandShiftIntensityd

    return [
        crop3(),
        RandScaleIntensityd(keys="image", factors=0.3, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.2, prob=1.0),
        RandGaussianNoised(keys="image", prob=1.0, std=0.05),
    ]


def tail_scale_some() -> list[Any]:
    from monai.transforms import RandScaleIntensityd, RandShiftIntensityd

    return [crop3(), RandScaleIntensityd(keys="image", factors=0.3, prob=0.5),
            RandShiftIntensityd(keys="image", offsets=0.2, prob=1.0)]  # fmt: skip


def tail_scale_some_f64() -> list[Any]:
    from monai.transforms import RandScaleIntensityd, RandShiftIntensityd

    return [crop3(), RandScaleIntensityd(keys="image", factors=0.3, prob=0.5, dtype=np.float64),
            RandShiftIntensityd(keys="image", offsets=0.2, prob=1.0)]  # fmt: skip


def tail_noise_some() -> list[Any]:
    from monai.transforms import RandGaussianNoised, RandShiftIntensityd

    return [crop3(), RandGaussianNoised(keys="image", prob=0.5, std=0.05),
            RandShiftIntensityd(keys="image", offsets=0.2, prob=1.0)]  # fmt: skip


def tail_scale_bf16() -> list[Any]:
    import torch
    from monai.transforms import CastToTyped, RandScaleIntensityd

    cast = CastToTyped(keys="image", dtype=torch.bfloat16)  # in the tail (row head-ends-bf16: in the head)
    return [crop3(), cast, RandScaleIntensityd(keys="image", factors=0.3, prob=1.0)]


def tail_scale_all() -> list[Any]:
    from monai.transforms import RandScaleIntensityd

    return [crop3(), RandScaleIntensityd(keys="image", factors=0.3, prob=1.0)]


def tail_twice() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    flip = RandFlipd(keys=K, prob=0.5, spatial_axis=0)
    return [crop3(), flip, RandRotate90d(keys=K, prob=0.5), flip]


def tail_nested() -> list[Any]:
    from monai.transforms import Compose, RandFlipd, RandRotate90d

    return [crop3(), Compose([RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandRotate90d(keys=K, prob=0.5)])]


def tail_after_fn() -> list[Any]:
    from monai.transforms import Orientationd, RandFlipd, Spacingd

    return [clip_image, Orientationd(keys=K, axcodes="LPS"), Spacingd(keys=K, pixdim=(1.0, 1.0, 1.0)),
            crop3(), RandFlipd(keys=K, prob=0.5)]  # fmt: skip


def tail_lazy() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    return [crop3(), RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandRotate90d(keys=K, prob=0.5)]


def tail_affine() -> list[Any]:
    from monai.transforms import RandAffined

    return [crop3(), RandAffined(keys=K, prob=1.0, rotate_range=(0.3, 0.3, 0.3), mode=("bilinear", "bilinear"))]


def tail_select() -> list[Any]:
    from monai.transforms import RandFlipd, SelectItemsd

    return [crop3(), RandFlipd(keys=K, prob=0.5), SelectItemsd(keys=K)]


def tail_dict_fn() -> list[Any]:
    from monai.transforms import RandFlipd

    return [crop3(), RandFlipd(keys=K, prob=0.5), keys_seen, clip_image]


def tail_shared_list() -> list[Any]:
    from monai.transforms import RandFlipd

    return [crop3(), add_shared_list, RandFlipd(keys=K, prob=0.5)]


def tail_2d() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d

    return [crop2(), RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandRotate90d(keys=K, prob=0.5)]


def tail_2d_unbatched() -> list[Any]:
    from monai.transforms import RandGibbsNoised

    return [crop2(), RandGibbsNoised(keys="image", prob=1.0)]


def tail_slices() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotated, RandScaleIntensityd, RandSpatialCropSamplesd, SqueezeDimd

    return [
        RandSpatialCropSamplesd(keys=K, roi_size=(16, 16, 1), num_samples=3, random_size=False),
        SqueezeDimd(keys=K, dim=-1),
        RandFlipd(keys=K, spatial_axis=0, prob=0.5),
        RandRotated(keys=K, range_x=0.4, prob=0.5, mode=("bilinear", "nearest")),
        RandScaleIntensityd(keys="image", factors=0.2, prob=0.5),
    ]


def tail_samples_random_size() -> list[Any]:
    from monai.transforms import RandFlipd, RandSpatialCropSamplesd

    return [
        RandSpatialCropSamplesd(keys=K, roi_size=(8, 8, 8), max_roi_size=(14, 14, 14), num_samples=2, random_size=True),
        RandFlipd(keys=K, prob=0.5),
    ]


def tail_flip_image() -> list[Any]:
    from monai.transforms import RandFlipd

    return [RandFlipd(keys="image", prob=0.5, spatial_axis=0)]  # the label stays as the head gave it


def tail_flip_only() -> list[Any]:
    from monai.transforms import RandFlipd

    return [RandFlipd(keys=K, prob=0.5)]


def tail_one_of() -> list[Any]:
    from monai.transforms import OneOf, RandFlipd, RandRotate90d

    return [crop3(), OneOf([RandFlipd(keys=K, prob=1.0), RandRotate90d(keys=K, prob=1.0)])]


def tail_some_of() -> list[Any]:
    from monai.transforms import RandFlipd, RandRotate90d, RandScaleIntensityd, SomeOf

    return [crop3(), SomeOf([RandFlipd(keys=K, prob=1.0), RandRotate90d(keys=K, prob=1.0),
                             RandScaleIntensityd(keys="image", factors=0.2, prob=1.0)], num_transforms=2)]  # fmt: skip


def tail_samples_one_of() -> list[Any]:
    from monai.transforms import OneOf, RandFlipd, RandRotate90d, RandSpatialCropSamplesd, SomeOf

    return [RandSpatialCropSamplesd(keys=K, roi_size=CROP3, num_samples=3, random_size=False),
            OneOf([RandFlipd(keys=K, prob=1.0), RandRotate90d(keys=K, prob=1.0)]),
            SomeOf([RandFlipd(keys=K, prob=1.0, spatial_axis=1), RandRotate90d(keys=K, prob=1.0)], num_transforms=1),
            RandFlipd(keys=K, prob=0.5, spatial_axis=2)]  # fmt: skip


def tail_two_sample_crops() -> list[Any]:
    from monai.transforms import RandSpatialCropSamplesd

    return [RandSpatialCropSamplesd(keys=K, roi_size=(12, 12, 12), num_samples=2, random_size=False),
            RandSpatialCropSamplesd(keys=K, roi_size=(8, 8, 8), num_samples=2, random_size=False)]  # fmt: skip


def tail_random_order() -> list[Any]:
    from monai.transforms import RandFlipd, RandomOrder, RandScaleIntensityd

    return [
        crop3(),
        RandomOrder([RandFlipd(keys=K, prob=0.5), RandScaleIntensityd(keys="image", factors=0.2, prob=1.0)]),
    ]


def tail_lambda() -> list[Any]:
    from monai.transforms import Lambda, RandFlipd

    return [crop3(), RandFlipd(keys=K, prob=0.5), Lambda(clip_image)]


def tail_subclass() -> list[Any]:
    from monai.transforms import RandFlipd

    return [_subclass_crop()(keys=K, roi_size=CROP3, random_size=False), RandFlipd(keys=K, prob=0.5)]


def tail_normalize() -> list[Any]:
    from monai.transforms import NormalizeIntensityd, RandFlipd

    return [crop3(), RandFlipd(keys=K, prob=0.5), NormalizeIntensityd(keys="image", nonzero=True)]


def tail_centre_larger() -> list[Any]:
    from monai.transforms import RandFlipd, RandSpatialCropd, ResizeWithPadOrCropd

    big = RandSpatialCropd(keys=K, roi_size=(24, 20, 26), random_center=False, random_size=False)
    return [big, ResizeWithPadOrCropd(keys=K, spatial_size=(20, 20, 20)), RandFlipd(keys=K, prob=0.5)]


def tail_random_larger() -> list[Any]:
    from monai.transforms import RandSpatialCropd, SpatialPadd

    big = RandSpatialCropd(keys=K, roi_size=(25, 16, 30), random_size=False)
    return [big, SpatialPadd(keys=K, spatial_size=(25, 16, 30))]


ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("crop-flip-rot90", "3d", head_3d, tail_flips),
        Row("posneg-num-samples", "3d", head_3d, tail_posneg),
        Row("fgbg-indices-from-head", "3d", head_fgbg, tail_posneg_given),
        Row("class-indices-from-head", "3d", head_classes, tail_classes_given),
        Row("intensity-all-fire", "3d", head_3d, tail_intensity),
        Row("scale-some-fire-f16", "3d", head_half, tail_scale_some),
        Row("scale-some-fire-dtype-f64", "3d", head_3d, tail_scale_some_f64),
        Row("noise-some-fire-f16", "3d", head_half, tail_noise_some),
        Row("scale-bf16", "3d", head_3d, tail_scale_bf16),
        Row("head-ends-bf16", "3d", head_bf16, tail_flips),  # issue 47 item 6
        Row("head-ends-bf16-scale", "3d", head_bf16, tail_scale_all),
        Row("scale-f16", "3d", head_half, tail_scale_all),
        Row("same-object-twice", "3d", head_3d, tail_twice),
        Row("nested-compose", "3d", head_3d, tail_nested),
        Row("seed-transform-before-build", "3d", head_3d, tail_flips, seeding="transform"),
        Row("seed-set-determinism", "3d", head_3d, tail_flips, seeding="determinism"),
        Row("spacing-in-head-ragged", "3d-ragged", head_spacing, tail_flips),
        Row("lazy", "3d", head_spacing, tail_lazy, compose={"lazy": True}),
        Row(
            "lazy-overrides",
            "3d",
            head_3d,
            tail_affine,
            compose={"lazy": True, "overrides": {"label": {"mode": "nearest", "padding_mode": "zeros"}}},
        ),
        Row("map-items-false", "3d", head_3d, tail_lazy, compose={"map_items": False}),
        Row("select-items-at-end", "3d", head_3d, tail_select),
        Row("plain-function-over-dict", "3d", head_3d, tail_dict_fn),
        Row("tail-adds-a-shared-list", "3d", head_3d, tail_shared_list),  # batch 2, lists of 2: collated per item
        Row("one-of", "3d", head_3d, tail_one_of),
        Row("some-of", "3d", head_3d, tail_some_of),
        Row("random-order", "3d", head_3d, tail_random_order),
        Row("samples-then-one-of", "3d", head_3d, tail_samples_one_of),  # MONAI 1.5+: one choice per item
        Row("lambda", "3d", head_3d, tail_lambda),
        Row("2d-class-label-0d", "2d", head_2d, tail_2d),
        Row("2d-batch-1-per-item", "2d", head_2d, tail_2d_unbatched, loader={"batch_size": 1}),
        Row(
            "normalize-nonzero",
            "3d",
            head_3d,
            tail_normalize,
            atol=1e-5,
            note="NormalizeIntensityd: the batched mean/std sum in another order",
        ),
        Row(
            "rand-affine",
            "3d",
            head_3d,
            tail_affine,
            note="RandAffined: exact on the CPU (one batched grid_sample); tests/loaders/test_tail_affine.py: GPU",
        ),
        Row("slices-samples-squeeze-rotate", "3d", head_3d, tail_slices),
        Row("samples-random-size", "3d", head_3d, tail_samples_random_size, raises=r"shapes differ|equal size"),
        Row("crop-subclass", "3d", head_3d, tail_subclass),  # folds.py folds exact classes only
        Row("function-ends-head", "3d", head_load, tail_after_fn, refused=r"Orientationd.*clip_image"),
        Row("two-sample-crops", "3d", head_3d, tail_two_sample_crops, refused=r"two multi-sample crops.*list of 2"),
        Row("centre-crop-larger-than-volume", "3d-ragged", head_3d, tail_centre_larger),  # item 11
        Row("centre-crop-larger-than-volume-even", "3d", head_3d, tail_centre_larger),
        Row("random-crop-larger-than-volume", "3d-ragged", head_3d, tail_random_larger),
        Row("2d-per-item-batch-2", "2d", head_2d, tail_2d_unbatched),  # item 13: ["CT", "CT"] stays a list
        Row("head-in-one-compose-foreground", "3d", head_one_compose_fg, tail_flip_image),  # issue 47 item 7
        Row("ragged-no-crop", "3d-ragged", head_3d, tail_flip_only, raises=r"shapes differ|equal size"),
    ]
}
