"""Batched RandAffined against MONAI's per-item RandAffined (same draws; float tolerance where it interpolates)."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import K, assert_same, batched, make_batch, per_item, reference  # noqa: E402

ROT = (math.pi / 6, math.pi / 8, math.pi / 5)


def affine(**kw: Any) -> Any:
    base: dict[str, Any] = dict(prob=0.6, rotate_range=ROT, scale_range=0.15, translate_range=(2, 3, 1))
    base.update(kw)
    return mt.RandAffined(K, **base)


CASES = {
    "bilinear_nearest_border": [affine(mode=("bilinear", "nearest"), padding_mode="border")],
    "bilinear_zeros": [affine(mode="bilinear", padding_mode="zeros", shear_range=(0.1, 0.1, 0.05))],
    "nearest_zeros_prob1": [affine(prob=1.0, mode="nearest", padding_mode="zeros")],
    "reflection": [affine(mode=("bilinear", "nearest"), padding_mode="reflection")],
    "out_size": [affine(spatial_size=(12, 14, 16), mode=("bilinear", "nearest"), padding_mode="zeros")],
    "prob0_out_size": [affine(prob=0.0, spatial_size=(16, -1, 10), mode=("bilinear", "nearest"))],
    "prob0": [affine(prob=0.0)],
    "cache_grid": [affine(spatial_size=(16, 16, 16), cache_grid=True, mode=("bilinear", "nearest"))],
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 42])
def test_rand_affine_equals_monai(name: str, seed: int) -> None:
    batch = make_batch()
    got, tail = batched(CASES[name], batch, seed)
    want = reference(CASES[name], batch, seed)
    assert tail.fallbacks == []
    assert got["label"].dtype == want["label"].dtype == torch.float32  # MONAI's RandAffined gives float32
    assert_same(got, want)  # each item's grid made as MONAI makes it: bit for bit


def test_rand_affine_2d_and_mixed_chain() -> None:
    batch = make_batch(n=6, spatial=(28, 24))
    chain = [
        mt.RandCropByPosNegLabeld(K, "label", spatial_size=(16, 16), num_samples=2),
        mt.RandAffined(K, prob=0.5, rotate_range=0.4, scale_range=(0.1, 0.2), mode=("bilinear", "nearest")),
        mt.RandFlipd(K, prob=0.5),
        mt.RandGaussianSmoothd("image", prob=0.5),
        per_item("RandGibbsNoised", "image", prob=0.5),
        mt.RandShiftIntensityd("image", offsets=0.2, prob=0.5),
    ]
    got, tail = batched(chain, batch, seed=6)
    assert tail.fallbacks == ["OwnRandGibbsNoised"]
    assert got["image"].shape == (12, 1, 16, 16)
    assert_same(got, reference(chain, batch, seed=6))


class MyAffined(mt.RandAffined):
    """A user's subclass: its behaviour may differ, so it runs per item through MONAI."""


def test_subclass_runs_per_item() -> None:
    batch = make_batch(n=3, spatial=(12, 12, 12))
    chain = [MyAffined(K, prob=1.0, rotate_range=0.3, mode=("bilinear", "nearest"))]
    got, tail = batched(chain, batch, seed=1)
    assert tail.fallbacks == ["MyAffined"]
    assert_same(got, reference(chain, batch, seed=1))
