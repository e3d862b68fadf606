"""The transform table: one row per random dictionary transform of MONAI that its tutorials use (and
`OneOf` / `SomeOf` / `RandomOrder`), each alone in the tail (after a crop where shapes differ), named for
the transform it is about. `test_table.py` runs each through PreparedLoader and the drop-in against MONAI
and writes the verdicts into docs/tail.md. Rows as in `chaintable` (they are in `heldout.ALL`).
"""

from __future__ import annotations

from typing import Any

from chaintable import CROP3, K, Row, crop2, crop3, head_2d, head_3d

IMG = "image"
S12 = (12, 12, 12)


def brighter(x: Any) -> Any:
    """RandLambdad's function (a module-level function: the pipeline file imports this module)."""
    return x * 1.5 + 0.1


def _t(name: str, *args: Any, **kw: Any) -> Any:
    import monai.transforms as mt

    return getattr(mt, name)(*args, **kw)


# name -> (data, tail builder); every builder makes fresh objects
_TAILS: dict[str, tuple[str, Any]] = {
    "RandFlipd": ("3d", lambda: [_t("RandFlipd", K, prob=0.5, spatial_axis=0)]),
    "RandAxisFlipd": ("3d", lambda: [_t("RandAxisFlipd", K, prob=0.7)]),
    "RandRotate90d": ("3d", lambda: [_t("RandRotate90d", K, prob=0.7, max_k=3)]),
    "RandRotated": (
        "3d",
        lambda: [_t("RandRotated", K, range_x=0.3, range_y=0.3, range_z=0.3, prob=0.8, mode=("bilinear", "nearest"))],
    ),
    "RandZoomd": (
        "3d",
        lambda: [_t("RandZoomd", K, min_zoom=0.8, max_zoom=1.2, prob=0.8, mode=("trilinear", "nearest"))],
    ),
    "RandAffined": (
        "3d",
        lambda: [
            _t(
                "RandAffined",
                K,
                prob=0.8,
                rotate_range=(0.2, 0.2, 0.2),
                scale_range=(0.1, 0.1, 0.1),
                mode=("bilinear", "nearest"),
            )
        ],
    ),
    "Rand2DElasticd": (
        "2d",
        lambda: [
            crop2(),
            _t("Rand2DElasticd", K, spacing=(5, 5), magnitude_range=(1, 2), prob=0.8, mode=("bilinear", "nearest")),
        ],
    ),
    "Rand3DElasticd": (
        "3d",
        lambda: [
            _t(
                "Rand3DElasticd",
                K,
                sigma_range=(5, 7),
                magnitude_range=(50, 100),
                prob=0.8,
                mode=("bilinear", "nearest"),
            )
        ],
    ),
    "RandSpatialCropd": ("3d", lambda: [crop3()]),
    "RandSpatialCropSamplesd": (
        "3d",
        lambda: [_t("RandSpatialCropSamplesd", K, roi_size=CROP3, num_samples=2, random_size=False)],
    ),
    "RandCropByPosNegLabeld": (
        "3d",
        lambda: [_t("RandCropByPosNegLabeld", K, label_key="label", spatial_size=S12, pos=1, neg=1, num_samples=2)],
    ),
    "RandCropByLabelClassesd": (
        "3d",
        lambda: [_t("RandCropByLabelClassesd", K, label_key="label", spatial_size=S12, num_classes=2, num_samples=2)],
    ),
    "RandWeightedCropd": ("3d", lambda: [_t("RandWeightedCropd", K, w_key=IMG, spatial_size=S12, num_samples=2)]),
    "RandScaleCropd": ("3d", lambda: [_t("RandScaleCropd", K, roi_scale=0.7, random_size=False)]),
    "RandScaleIntensityd": ("3d", lambda: [_t("RandScaleIntensityd", IMG, factors=0.3, prob=0.7)]),
    "RandShiftIntensityd": ("3d", lambda: [_t("RandShiftIntensityd", IMG, offsets=0.2, prob=0.7)]),
    "RandStdShiftIntensityd": ("3d", lambda: [_t("RandStdShiftIntensityd", IMG, factors=0.2, prob=0.7)]),
    "RandGaussianNoised": ("3d", lambda: [_t("RandGaussianNoised", IMG, prob=0.7, std=0.05)]),
    "RandGaussianSmoothd": (
        "3d",
        lambda: [_t("RandGaussianSmoothd", IMG, sigma_x=(0.5, 1.0), sigma_y=(0.5, 1.0), sigma_z=(0.5, 1.0), prob=0.7)],
    ),
    "RandGaussianSharpend": ("3d", lambda: [_t("RandGaussianSharpend", IMG, prob=0.7)]),
    "RandAdjustContrastd": ("3d", lambda: [_t("RandAdjustContrastd", IMG, prob=0.7, gamma=(0.7, 1.5))]),
    "RandHistogramShiftd": ("3d", lambda: [_t("RandHistogramShiftd", IMG, num_control_points=5, prob=0.7)]),
    "RandBiasFieldd": ("3d", lambda: [_t("RandBiasFieldd", IMG, prob=0.7, coeff_range=(0.0, 0.1))]),
    "RandCoarseDropoutd": ("3d", lambda: [_t("RandCoarseDropoutd", IMG, holes=3, spatial_size=4, prob=0.7)]),
    "RandCoarseShuffled": ("3d", lambda: [_t("RandCoarseShuffled", IMG, holes=3, spatial_size=4, prob=0.7)]),
    "RandGibbsNoised": ("3d", lambda: [_t("RandGibbsNoised", IMG, prob=0.7, alpha=(0.1, 0.5))]),
    "RandKSpaceSpikeNoised": ("3d", lambda: [_t("RandKSpaceSpikeNoised", IMG, prob=0.7, intensity_range=(10, 12))]),
    "RandRicianNoised": ("3d", lambda: [_t("RandRicianNoised", IMG, prob=0.7, std=0.05)]),
    "RandSimulateLowResolutiond": (
        "3d",
        lambda: [_t("RandSimulateLowResolutiond", IMG, prob=0.7, zoom_range=(0.5, 0.9))],
    ),
    "RandLambdad": ("3d", lambda: [_t("RandLambdad", IMG, func=brighter, prob=0.7)]),
    "OneOf": ("3d", lambda: [_t("OneOf", [_t("RandFlipd", K, prob=1.0), _t("RandRotate90d", K, prob=1.0)])]),
    "SomeOf": (
        "3d",
        lambda: [
            _t(
                "SomeOf",
                [
                    _t("RandFlipd", K, prob=1.0),
                    _t("RandRotate90d", K, prob=1.0),
                    _t("RandScaleIntensityd", IMG, factors=0.2, prob=1.0),
                ],
                num_transforms=2,
            )
        ],
    ),
    "RandomOrder": (
        "3d",
        lambda: [
            _t("RandomOrder", [_t("RandFlipd", K, prob=0.5), _t("RandScaleIntensityd", IMG, factors=0.2, prob=1.0)])
        ],
    ),
    "ScaleIntensityd": ("3d", lambda: [_t("RandFlipd", K, prob=0.5), _t("ScaleIntensityd", IMG, channel_wise=True)]),
    "ScaleIntensityRanged": (
        "3d",
        lambda: [
            _t("RandFlipd", K, prob=0.5),
            _t("ScaleIntensityRanged", IMG, a_min=0.0, a_max=0.5, b_min=0.0, b_max=1.0, clip=True),
        ],
    ),
    "ThresholdIntensityd": (
        "3d",
        lambda: [_t("RandScaleIntensityd", IMG, factors=0.2, prob=0.7), _t("ThresholdIntensityd", IMG, threshold=0.3)],
    ),
    "MapLabelValued": (
        "3d",
        lambda: [_t("RandFlipd", K, prob=0.5), _t("MapLabelValued", "label", orig_labels=[0, 1], target_labels=[2, 0])],
    ),
    "CenterSpatialCropd": (
        "3d",
        lambda: [_t("RandFlipd", K, prob=0.5), _t("CenterSpatialCropd", K, roi_size=(12, 10, 8))],
    ),
    "SpatialPadd": ("3d", lambda: [_t("RandFlipd", K, prob=0.5), _t("SpatialPadd", K, spatial_size=(40, 40, 40))]),
    "Resized": (
        "3d",
        lambda: [
            _t("RandFlipd", K, prob=0.5),
            _t("Resized", K, spatial_size=(16, 16, 16), mode=("trilinear", "nearest")),
        ],
    ),
    "ToTensord": ("3d", lambda: [_t("RandRotate90d", K, prob=0.5), _t("ToTensord", K)]),
}

_HEADS = {"3d": head_3d, "2d": head_2d}
_ATOL: dict[str, float] = {}  # name -> the float rounding a row is allowed (and why), where not bit for bit

TRANSFORMS: dict[str, Row] = {
    name: Row(name, data, _HEADS[data], tail, atol=_ATOL.get(name, 0.0)) for name, (data, tail) in _TAILS.items()
}
