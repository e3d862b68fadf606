"""What several `prep cache` tests share: the repository's paths and a pipeline whose head is slow on purpose."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPHERES = REPO / "workflows" / "pipelines" / "spheres.py"


def slow_pipeline(seconds: float) -> str:
    """A PIPELINE.py whose head sleeps `seconds` an item (a run long enough to kill mid-way), then a random flip."""
    return f"""
import time
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandFlipd

class Slow(MapTransform):
    def __call__(self, d):
        time.sleep({seconds})
        return d

transform = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
                     Slow(keys=["image"]), RandFlipd(keys=["image"], prob=0.5)])
"""
