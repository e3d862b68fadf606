"""Example pipeline for the synthetic spheres dataset (`prep synth nifti`): `make cache` uses it.

The head (load, channel first, resample to 1 mm, intensity scaling) is deterministic and is prepared once
by `prep cache`; the tail (random foreground/background crops, random flips) runs at training time.
"""

from __future__ import annotations

from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandCropByPosNegLabeld,
    RandFlipd,
    ScaleIntensityRanged,
    Spacingd,
)

KEYS = ["image", "label"]
PATCH = (32, 32, 32)

transform = Compose(
    [
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys=KEYS),
        Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=0.0, a_max=1000.0, b_min=0.0, b_max=1.0, clip=True),
        # random tail: everything from here on stays for training time
        RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=PATCH, pos=1, neg=1, num_samples=2),
        RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
    ]
)
