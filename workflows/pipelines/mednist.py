"""Example pipeline for MedNIST-like 2D images (64x64 grayscale JPEGs with a class label), as in MONAI's
MedNIST tutorial: the head (load, channel first, intensity scaling) is prepared once by `prep cache`; the
tail (random rotation, flip and zoom) runs at training time.
"""

from __future__ import annotations

import numpy as np
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    RandRotated,
    RandZoomd,
    ScaleIntensityd,
)

transform = Compose(
    [
        LoadImaged(keys="image", image_only=True),
        EnsureChannelFirstd(keys="image"),
        ScaleIntensityd(keys="image"),
        # random tail: everything from here on stays for training time
        RandRotated(keys="image", range_x=np.pi / 12, prob=0.5, keep_size=True),
        RandFlipd(keys="image", spatial_axis=0, prob=0.5),
        RandZoomd(keys="image", min_zoom=0.9, max_zoom=1.1, prob=0.5),
    ]
)
