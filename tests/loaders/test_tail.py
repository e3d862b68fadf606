"""BatchedTail against MONAI's per-item chain + list_data_collate, on deep copies of the same transforms."""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import K, assert_same, batched, make_batch, per_item, reference  # noqa: E402

from loaders.errors import PrepError  # noqa: E402
from loaders.tail import BatchedTail, batched_names  # noqa: E402

EXACT = {
    "spatial_crop": [mt.RandSpatialCropd(K, roi_size=(12, 10, 16))],
    "spatial_crop_center": [mt.RandSpatialCropd(K, roi_size=(12, 10, -1), random_center=False)],
    "flip_all_axes": [mt.RandFlipd(K, prob=0.5)],
    "flip_axis1": [mt.RandFlipd(K, prob=0.5, spatial_axis=1)],
    "flip_axes02": [mt.RandFlipd(K, prob=0.5, spatial_axis=(0, -1))],
    "rot90": [mt.RandRotate90d(K, prob=0.7, max_k=3, spatial_axes=(0, 2))],
    "axis_flip": [mt.RandAxisFlipd(K, prob=0.6)],
    "axis_flip_then_flip": [mt.RandAxisFlipd(K, prob=1.0), mt.RandFlipd(K, prob=0.5, spatial_axis=1)],
    "axis_flip_missing_key": [mt.RandAxisFlipd(["mask", "image"], prob=0.5, allow_missing_keys=True)],
    "ensure_typed": [mt.RandFlipd(K, prob=0.5), mt.EnsureTyped(K, dtype=torch.float16)],
    "to_tensord": [mt.RandFlipd(K, prob=0.5), mt.ToTensord(K)],
    "to_tensord_untracked": [
        mt.RandRotate90d(K, 0.5, 3, (0, 2)),
        mt.ToTensord(K, dtype=torch.float16, track_meta=False),
    ],
    "scale_intensity": [mt.RandScaleIntensityd("image", factors=0.3, prob=0.6), mt.ScaleIntensityd("image")],
    "scale_intensity_range_of": [mt.RandFlipd(K, prob=0.5), mt.ScaleIntensityd(K, minv=-1.0, maxv=2.5, dtype=None)],
    "scale_intensity_one_bound": [
        mt.RandShiftIntensityd("image", offsets=0.5, prob=0.6),
        mt.ScaleIntensityd("image", minv=None, maxv=3.0),
    ],  # fmt: skip
    "scale_intensity_factor": [mt.RandFlipd(K, prob=0.5), mt.ScaleIntensityd("image", None, None, factor=0.4)],
    "scale_intensity_range": [
        mt.RandScaleIntensityd("image", factors=0.3, prob=0.6),
        mt.ScaleIntensityRanged("image", a_min=0.2, a_max=2.5, b_min=0.0, b_max=1.0, clip=True),
    ],
    "threshold_intensity": [
        mt.RandShiftIntensityd("image", offsets=0.5, prob=0.6),
        mt.ThresholdIntensityd("image", threshold=1.0, above=False, cval=-1.0),
    ],
    "map_label_value": [mt.RandFlipd(K, prob=0.5), mt.MapLabelValued("label", [0, 1], [3, 7], dtype=torch.uint8)],
    "center_crop": [mt.RandFlipd(K, prob=0.5), mt.CenterSpatialCropd(K, roi_size=(12, 10, 16))],
    "center_scale_crop": [mt.RandFlipd(K, prob=0.5), mt.CenterScaleCropd(K, roi_scale=0.6)],
    "spatial_crop_fixed": [mt.RandFlipd(K, prob=0.5), mt.SpatialCropd(K, roi_center=(10, 11, 9), roi_size=(8, 7, 8))],
    "spatial_pad": [mt.RandFlipd(K, prob=0.5), mt.SpatialPadd(K, spatial_size=(24, 26, 22), mode="reflect")],
    "spatial_pad_modes": [mt.RandFlipd(K, prob=0.5), mt.SpatialPadd(K, (25, 24, 24), mode=("edge", "constant"))],
    "border_pad": [mt.RandScaleIntensityd("image", factors=0.3, prob=0.6), mt.BorderPadd(K, spatial_border=2)],
    "divisible_pad": [mt.RandFlipd(K, prob=0.5), mt.DivisiblePadd(K, k=16)],
    "resize_with_pad_or_crop": [mt.RandFlipd(K, prob=0.5), mt.ResizeWithPadOrCropd(K, (16, 28, 20))],
    "flipd": [mt.RandScaleIntensityd("image", factors=0.3, prob=0.6), mt.Flipd(K, spatial_axis=1)],
    "rotate90d": [mt.RandFlipd(K, prob=0.5), mt.Rotate90d(K, k=1, spatial_axes=(0, 2))],
    "resized": [mt.RandFlipd(K, prob=0.5), mt.Resized(K, (16, 18, 12), mode=("trilinear", "nearest"))],
    "rotated": [mt.RandFlipd(K, prob=0.5), mt.Rotated(K, angle=(0.2, 0.1, -0.3), mode=("bilinear", "nearest"))],
    "rotated_grown": [mt.RandFlipd(K, prob=0.5), mt.Rotated(K, angle=0.3, keep_size=False)],
    "zoomd": [mt.RandFlipd(K, prob=0.5), mt.Zoomd(K, zoom=1.3, mode=("trilinear", "nearest"))],
    "zoomd_shrunk": [mt.RandFlipd(K, prob=0.5), mt.Zoomd(K, zoom=0.7, keep_size=False)],
    "affined": [
        mt.RandFlipd(K, prob=0.5),
        mt.Affined(K, rotate_params=(0.1, 0.2, 0.3), scale_params=(1.1, 0.9, 1.0), mode=("bilinear", "nearest")),
    ],
    "label_classes": [mt.RandCropByLabelClassesd(K, "label", (8, 8, 8), ratios=[1, 2], num_classes=2, num_samples=3)],
    "label_classes_after_flip": [
        mt.RandFlipd(K, prob=0.5),
        mt.RandCropByLabelClassesd(
            K, "label", (9, 8, 7), num_classes=2, num_samples=2, image_key="image", image_threshold=0.5
        ),
        mt.RandScaleIntensityd("image", factors=0.3, prob=0.6),
    ],
    "cast_to_typed": [mt.CastToTyped(K, dtype=(torch.float16, torch.uint8)), mt.RandRotate90d(K, 0.5, 3, (0, 2))],
    "copy_then_delete": [
        mt.CopyItemsd("image", times=2, names=["a", "b"]),
        mt.RandScaleIntensityd("a", factors=0.3, prob=0.7),
        mt.DeleteItemsd("b"),
        mt.RandFlipd(["a", "label"], prob=0.5),
    ],
    "scale": [mt.RandScaleIntensityd("image", factors=0.3, prob=0.6)],
    "scale_label_dtype": [mt.RandScaleIntensityd(K, factors=0.3, prob=1.0)],
    "shift": [mt.RandShiftIntensityd("image", offsets=0.5, prob=0.6)],
    "shift_label": [mt.RandShiftIntensityd(K, offsets=2.0, prob=0.6)],
    "noise": [mt.RandGaussianNoised("image", prob=0.6, std=0.2)],
    "zoom": [mt.RandZoomd(K, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), align_corners=(True, None))],
    "zoom_some": [mt.RandZoomd(K, min_zoom=0.7, max_zoom=1.3, prob=0.4, padding_mode="constant")],
    "zoom_two_factors": [mt.RandZoomd("image", min_zoom=(0.8, 1.0), max_zoom=(1.1, 1.2), prob=0.6, keep_size=True)],
    "smooth": [
        mt.RandGaussianSmoothd("image", sigma_x=(0.5, 1.15), sigma_y=(0.5, 1.15), sigma_z=(0.5, 1.15), prob=0.5)
    ],
    "smooth_both_keys": [mt.RandGaussianSmoothd(K, sigma_x=(0.25, 1.5), prob=0.7)],
    "dynunet_tail": [
        mt.RandZoomd(
            K, min_zoom=0.9, max_zoom=1.2, mode=("trilinear", "nearest"), align_corners=(True, None), prob=0.5
        ),
        mt.RandGaussianNoised("image", std=0.01, prob=0.5),
        mt.RandGaussianSmoothd("image", sigma_x=(0.5, 1.15), sigma_y=(0.5, 1.15), sigma_z=(0.5, 1.15), prob=0.5),
        mt.RandScaleIntensityd("image", factors=0.3, prob=0.5),
        mt.RandFlipd(K, spatial_axis=[0], prob=0.5),
    ],
    "samples": [mt.RandSpatialCropSamplesd(K, roi_size=(8, 9, 10), num_samples=3)],
    "pos_neg": [mt.RandCropByPosNegLabeld(K, "label", spatial_size=(8, 8, 8), pos=1, neg=1, num_samples=2)],
    "weighted": [mt.RandWeightedCropd(K, w_key="image", spatial_size=(8, 7, 6), num_samples=3)],
    "weighted_by_another_key": [mt.RandWeightedCropd("image", w_key="label", spatial_size=(9, 9, 9), num_samples=2)],
    "pos_neg_image_key": [
        mt.RandCropByPosNegLabeld(K, "label", (10, 8, 6), pos=2, neg=1, num_samples=3, image_key="image")
    ],
    "issue_tail": [
        mt.RandSpatialCropd(K, roi_size=(16, 16, 16)),
        mt.RandFlipd(K, prob=0.5, spatial_axis=0),
        mt.RandScaleIntensityd("image", factors=0.1, prob=0.5),
    ],
    "tutorial_chain": [
        mt.RandCropByPosNegLabeld(K, "label", spatial_size=(12, 12, 12), num_samples=2),
        mt.RandFlipd(K, prob=0.3, spatial_axis=0),
        mt.RandFlipd(K, prob=0.3, spatial_axis=1),
        mt.RandRotate90d(K, prob=0.4, max_k=3),
        mt.RandShiftIntensityd("image", offsets=0.1, prob=0.5),
        mt.RandGaussianNoised("image", prob=0.5),
    ],
}


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.parametrize("seed", [0, 123])
def test_equals_monai_per_item(name: str, seed: int) -> None:
    batch = make_batch()
    got, tail = batched(EXACT[name], batch, seed)
    assert_same(got, reference(EXACT[name], batch, seed))
    assert tail.fallbacks == []


DETERMINISTIC = {
    "concat": [mt.RandFlipd(K, prob=0.5), mt.ConcatItemsd(K, name="both")],
    "concat_last_dim": [mt.ConcatItemsd(K, name="both", dim=-1), mt.RandFlipd(["both"], prob=0.5, spatial_axis=0)],
    "argmax_then_onehot": [
        mt.ConcatItemsd(K, name="both"),
        mt.RandFlipd(["both"], prob=0.5, spatial_axis=1),
        mt.AsDiscreted("both", argmax=True, to_onehot=2),
    ],
    "threshold_and_onehot": [
        mt.RandScaleIntensityd("image", factors=0.3, prob=0.5),
        mt.AsDiscreted(K, threshold=(1.5, None), to_onehot=(None, 3), dtype=torch.float16),
    ],
    "argmax_no_keepdim": [mt.ConcatItemsd(K, name="both"), mt.AsDiscreted("both", argmax=True, keepdim=False)],
}


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_concat_and_as_discrete_over_the_batch(name: str) -> None:
    """ConcatItemsd one dim later over the batch; AsDiscreted: MONAI's own over the batch, its dim one later."""
    batch = make_batch()
    got, tail = batched(DETERMINISTIC[name], batch, 3)
    want = reference(DETERMINISTIC[name], batch, 3)
    assert_same(got, want, keys=tuple(k for k in ("image", "label", "both") if k in want))
    assert tail.fallbacks == []


def test_some_items_flip_and_others_not() -> None:
    batch = make_batch(n=8)
    t = [mt.RandFlipd(K, prob=0.5, spatial_axis=2)]
    got, _ = batched(t, batch, seed=5)
    flipped = [bool(torch.equal(got["image"][i], batch["image"][i].flip(-1))) for i in range(8)]
    kept = [bool(torch.equal(got["image"][i], batch["image"][i])) for i in range(8)]
    assert any(flipped) and any(kept) and all(f != k for f, k in zip(flipped, kept))
    assert_same(got, reference(t, batch, seed=5))


@pytest.mark.parametrize("prob", [0.0, 1.0])
def test_prob_extremes(prob: float) -> None:
    batch = make_batch()
    chain = [
        mt.RandFlipd(K, prob=prob),
        mt.RandRotate90d(K, prob=prob, spatial_axes=(0, 2)),
        mt.RandScaleIntensityd("image", factors=0.5, prob=prob),
        mt.RandShiftIntensityd("image", offsets=0.5, prob=prob),
        mt.RandGaussianNoised("image", prob=prob),
    ]
    got, _ = batched(chain, batch, seed=9)
    assert_same(got, reference(chain, batch, seed=9))
    assert torch.equal(got["label"], batch["label"]) == (prob == 0.0)


def test_labels_keep_dtype() -> None:
    for dtype in (torch.uint8, torch.int64):
        batch = make_batch()
        batch["label"] = batch["label"].to(dtype)
        chain = EXACT["tutorial_chain"]
        got, _ = batched(chain, batch, seed=1)
        assert got["label"].dtype == dtype
        assert_same(got, reference(chain, batch, seed=1))


def test_2d() -> None:
    batch = make_batch(n=5, spatial=(30, 26))
    chain = [
        mt.RandCropByPosNegLabeld(K, "label", spatial_size=(12, 12), num_samples=2),
        mt.RandSpatialCropd(K, roi_size=(10, 10)),
        mt.RandFlipd(K, prob=0.5),
        mt.RandRotate90d(K, prob=0.5),
        mt.RandAxisFlipd(K, prob=0.5),
        mt.RandScaleIntensityd("image", factors=0.2, prob=0.5, channel_wise=True),
        mt.RandGaussianNoised("image", prob=0.5),
    ]
    got, _ = batched(chain, batch, seed=3)
    assert got["image"].shape == (10, 1, 10, 10)
    assert_same(got, reference(chain, batch, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_channel_wise_multichannel(dtype: torch.dtype) -> None:
    """Per-channel factors and offsets; on half types channel by channel with python scalars, as MONAI's loop."""
    batch = make_batch(n=6)
    batch["image"] = torch.cat([batch["image"], 1 - batch["image"], 3 * batch["image"]], dim=1).to(dtype)
    chain = [
        mt.RandScaleIntensityd("image", factors=0.4, prob=0.7, channel_wise=True, dtype=None),
        mt.RandShiftIntensityd("image", offsets=0.4, prob=0.7, channel_wise=True),
    ]
    got, tail = batched(chain, batch, seed=4)
    assert_same(got, reference(chain, batch, seed=4))
    assert tail.fallbacks == []


@pytest.mark.parametrize("channel_wise", [False, True])
@pytest.mark.parametrize(("minv", "maxv", "dtype"), [(0.0, 1.0, torch.float32), (2.0, None, None), (None, 5.0, None)])
def test_scale_intensity_by_each_items_range(channel_wise: bool, minv: Any, maxv: Any, dtype: Any) -> None:
    """ScaleIntensityd over the batch: each item's (channel's) own min and max; an item (a channel) that is constant
    takes MONAI's other branch; integer images too."""
    batch = make_batch(n=5)
    image = torch.cat([batch["image"], 1 - batch["image"], torch.full_like(batch["image"], 0.25)], dim=1)
    image[3] = 2.0  # a constant item
    batch["image"] = image if dtype is not None else (image * 40).to(torch.int16)
    chain = [mt.RandFlipd(K, prob=0.5), mt.ScaleIntensityd("image", minv, maxv, channel_wise=channel_wise, dtype=dtype)]
    got, tail = batched(chain, batch, seed=6)
    assert_same(got, reference(chain, batch, seed=6))
    assert tail.fallbacks == []


def test_resized_with_anti_aliasing_runs_per_item() -> None:
    """Its smoothing over every item's channels at once is not MONAI's bit for bit: per item, MONAI's numbers."""
    batch = make_batch()
    chain = [mt.RandFlipd(K, prob=0.5), mt.Resized("image", (10, 11, 10), anti_aliasing=True)]
    got, tail = batched(chain, batch, seed=2)
    assert_same(got, reference(chain, batch, seed=2))
    assert tail.fallbacks == ["Resized"]


def test_fallback_runs_per_item_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    batch = make_batch()
    chain = [
        mt.RandSpatialCropd(K, roi_size=(12, 12, 12)),
        per_item("RandGibbsNoised", "image", prob=0.5),
        mt.RandFlipd(K, prob=0.5),
        per_item("RandCoarseShuffled", "image", prob=0.5, holes=2, spatial_size=4),
    ]
    with caplog.at_level(logging.WARNING, logger="loaders.tail"):
        tail = BatchedTail(copy.deepcopy(chain))
        tail.set_random_state(11)
        got = tail({k: v.clone() for k, v in batch.items()})
        tail(batch)
    assert tail.fallbacks == ["OwnRandGibbsNoised", "OwnRandCoarseShuffled"]
    lines = [r for r in caplog.records if r.name == "loaders.tail"]
    assert len(lines) == 1 and "OwnRandGibbsNoised, OwnRandCoarseShuffled" in lines[0].getMessage()
    assert_same(got, reference(chain, batch, seed=11), atol=1e-6)


def test_random_size_crop_ragged_then_fixed() -> None:
    """Random-size windows make ragged items; a following fixed crop makes them stackable again."""
    batch = make_batch()
    chain = [
        mt.RandSpatialCropd(K, roi_size=(12, 12, 12), random_size=True),
        mt.RandFlipd(K, prob=0.5),
        mt.RandSpatialCropd(K, roi_size=(10, 10, 10)),
        mt.RandScaleIntensityd("image", factors=0.2, prob=0.5),
    ]
    got, tail = batched(chain, batch, seed=2)
    assert tail.fallbacks == ["RandFlipd", "RandSpatialCropd"]  # per item while ragged
    assert_same(got, reference(chain, batch, seed=2))
    with pytest.raises(PrepError, match="random_size=False"):
        batched(chain[:2], batch, seed=2)


def test_metatensor_input_gives_plain_tensors() -> None:
    from monai.data import MetaTensor

    batch = make_batch()
    meta = {k: MetaTensor(v, affine=torch.eye(4) * 2) for k, v in batch.items()}
    chain = EXACT["issue_tail"]
    got, _ = batched(chain, meta, seed=8)
    assert all(type(got[k]) is torch.Tensor for k in K)
    assert_same(got, reference(chain, batch, seed=8))


def test_passthrough_and_sample_expansion() -> None:
    batch: dict[str, Any] = dict(make_batch(n=3))
    batch["name"] = ["a", "b", "c"]
    batch["spacing"] = torch.tensor([[1.0], [2.0], [3.0]])
    batch["cls"] = torch.tensor([7, 8, 9])
    chain = [mt.RandSpatialCropSamplesd(K, roi_size=(8, 8, 8), num_samples=2)]
    got, _ = batched(chain, batch, seed=0)
    assert got["cls"].tolist() == [7, 7, 8, 8, 9, 9]
    assert got["name"] == ["a", "a", "b", "b", "c", "c"]
    assert got["spacing"].flatten().tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert got["image"].shape[0] == 6


def test_set_random_state_matches_compose_and_repeats() -> None:
    batch = make_batch()
    chain = mt.Compose(EXACT["issue_tail"])
    tail = BatchedTail(chain)
    a = tail.set_random_state(7)(batch)
    b = tail.set_random_state(7)(batch)
    c = tail(batch)
    assert torch.equal(a["image"], b["image"]) and not torch.equal(b["image"], c["image"])


def test_does_not_modify_input() -> None:
    batch = make_batch()
    before = {k: v.clone() for k, v in batch.items()}
    tail = BatchedTail(EXACT["tutorial_chain"] + EXACT["noise"] + EXACT["scale_label_dtype"])
    tail.set_random_state(0)
    tail(batch)
    assert all(torch.equal(before[k], batch[k]) for k in batch)


def test_import_loaders_stays_light() -> None:
    import subprocess

    code = "import loaders, loaders.tail, sys; print('torch' in sys.modules, 'monai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_batched_names_cover_the_issue_list() -> None:
    want = {"RandCropByPosNegLabeld", "RandSpatialCropd", "RandSpatialCropSamplesd", "RandFlipd", "RandRotate90d"}
    want |= {"RandScaleIntensityd", "RandShiftIntensityd", "RandGaussianNoised", "RandAffined", "RandAxisFlipd"}
    assert want <= set(batched_names())


@pytest.mark.parametrize(
    "crop",
    [
        lambda: mt.RandSpatialCropd(K, roi_size=(12, 12, 12)),
        lambda: mt.RandSpatialCropSamplesd(K, roi_size=(10, 12, 12), num_samples=3, random_size=False),
    ],
    ids=["one sample", "three samples"],
)
@pytest.mark.parametrize("weights", [None, (0.2, 0.5, 0.3)])
def test_one_of_inside_is_batched_over_the_items_that_chose_each(crop: Any, weights: Any) -> None:
    """Each item's choice drawn by the OneOf as MONAI draws it (from 1.5 one for all of an item's samples),
    each chosen transform batched over its items; the same numbers as MONAI's chain item by item."""
    batch = make_batch(n=5)
    chain = [
        crop(),
        mt.OneOf(
            [
                mt.RandFlipd(K, prob=1.0, spatial_axis=0),
                mt.RandScaleIntensityd("image", factors=0.5, prob=1.0),
                mt.RandGaussianNoised("image", prob=0.8, std=0.1),
            ],
            weights=weights,
        ),
        mt.RandFlipd(K, prob=0.5, spatial_axis=1),
    ]
    got, tail = batched(chain, batch, seed=4)
    assert tail.fallbacks == []
    assert_same(got, reference(chain, batch, seed=4))


@pytest.mark.parametrize("second", ["per item", "declined"])
def test_one_of_that_cannot_be_batched_runs_per_item_with_every_draw_put_back(second: str) -> None:
    """A choice without a batched version runs the OneOf per item from the start; one whose batched version
    declines them (a zoom flagged lazy, which the eager OneOf runs eagerly: found once the flips have drawn for
    their items) puts every draw back first: the same numbers as MONAI's chain either way."""
    batch = make_batch(n=6)
    other = {
        "per item": lambda: per_item("RandGibbsNoised", "image", prob=1.0),
        "declined": lambda: mt.RandZoomd(
            K, prob=1.0, min_zoom=0.8, max_zoom=1.2, mode=("trilinear", "nearest"), lazy=True
        ),
    }[second]()
    chain = [mt.RandSpatialCropd(K, roi_size=(12, 12, 12)), mt.OneOf([mt.RandFlipd(K, prob=1.0), other])]
    got, tail = batched(chain, batch, seed=9)
    assert tail.fallbacks == ["OneOf"]
    assert_same(got, reference(chain, batch, seed=9))


def test_lazy_compose_runs_whole_chain_per_item() -> None:
    """MONAI's lazy resampling fuses the crop and the affine into one resample: only MONAI itself gives that."""
    batch = make_batch(n=3)
    transforms = [
        mt.RandSpatialCropd(K, roi_size=(12, 12, 12)),
        mt.RandAffined(K, prob=1.0, rotate_range=0.3, mode=("bilinear", "nearest")),
    ]
    lazy = mt.Compose(copy.deepcopy(transforms), lazy=True)
    tail = BatchedTail(lazy).set_random_state(3)
    got = tail({k: v.clone() for k, v in batch.items()})
    assert tail.fallbacks == ["Compose"]
    want = mt.Compose(copy.deepcopy(transforms), lazy=True).set_random_state(3)
    items = [want({k: v[i].clone() for k, v in batch.items()}) for i in range(3)]
    torch.testing.assert_close(got["image"], torch.stack([it["image"].as_tensor() for it in items]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32, torch.bool])
@pytest.mark.parametrize("channels", [1, 3])
def test_pos_neg_label_dtypes_and_one_hot(dtype: torch.dtype, channels: int) -> None:
    """MONAI's background of a uint8 label (no image_key) is every voxel; other dtypes exclude the foreground."""
    batch = make_batch()
    if channels > 1:  # one-hot: background channel, then two classes
        fg = batch["label"]
        batch["label"] = torch.cat([1 - fg, fg, torch.zeros_like(fg)], dim=1)
    batch["label"] = batch["label"].to(dtype)
    chain = [mt.RandCropByPosNegLabeld(K, "label", spatial_size=(6, 6, 6), pos=1, neg=3, num_samples=4)]
    got, _ = batched(chain, batch, seed=13)
    assert_same(got, reference(chain, batch, seed=13))


class InPlaceShiftd(mt.MapTransform):
    """A transform that writes into its input, as some MONAI transforms do."""

    def __call__(self, data: dict[str, Any]) -> dict[str, Any]:
        d = dict(data)
        for k in self.key_iterator(d):
            d[k].add_(1)
        return d


@pytest.mark.parametrize("first", ["none", "crop", "random_size_crop"])
def test_fallback_never_writes_the_callers_batch(first: str) -> None:
    batch = make_batch()
    before = {k: v.clone() for k, v in batch.items()}
    head = {
        "none": [],
        "crop": [mt.RandSpatialCropd(K, roi_size=(8, 8, 8))],
        "random_size_crop": [mt.RandSpatialCropd(K, roi_size=(8, 8, 8), random_size=True)],
    }[first]
    tail = BatchedTail([*head, InPlaceShiftd("image"), mt.RandSpatialCropd(K, roi_size=(6, 6, 6))])
    out = tail(batch)
    assert all(torch.equal(before[k], batch[k]) for k in batch)
    assert out["image"].shape == (4, 1, 6, 6, 6)


def test_single_transform_and_device_argument() -> None:
    batch = make_batch()
    t = mt.RandFlipd(K, prob=0.5, spatial_axis=0)
    tail = BatchedTail(copy.deepcopy(t), device="cpu").set_random_state(21)
    got = tail(batch)
    assert got["image"].device.type == "cpu"
    assert_same(got, reference([t], batch, seed=21))


def test_rot90_of_a_non_square_plane() -> None:
    """Odd turns of a 20x22 plane change the shape: batches MONAI can collate are equal, the others raise."""
    batch = make_batch()
    chain = [mt.RandRotate90d(K, prob=0.9, max_k=3, spatial_axes=(0, 1))]
    stacked = ragged = 0
    for seed in range(40):
        try:
            want = reference(chain, batch, seed)
        except RuntimeError:  # MONAI's collate cannot stack items of different shapes
            ragged += 1
            with pytest.raises(PrepError, match="shapes differ"):
                batched(chain, batch, seed)
            continue
        stacked += 1
        assert_same(batched(chain, batch, seed)[0], want)
    assert stacked and ragged


@pytest.mark.parametrize("form", ["compose", "nested", "list", "single"])
def test_building_keeps_the_callers_seeding(form: str) -> None:
    """Seeded first, wrapped after: the draws are those of the objects as the caller seeded them."""
    from monai.data import list_data_collate

    batch = make_batch()
    flip, scale = mt.RandFlipd(K, prob=0.5, spatial_axis=0), mt.RandScaleIntensityd("image", factors=0.3, prob=0.5)
    chain: Any = {
        "compose": mt.Compose([flip, scale]),
        "nested": mt.Compose([mt.Compose([flip]), scale]),
        "list": [flip, scale],
        "single": flip,
    }[form]
    if isinstance(chain, mt.Compose):
        chain.set_random_state(17)
    else:
        flip.set_random_state(17)
        scale.set_random_state(18)
    want_chain = copy.deepcopy(chain)
    got = BatchedTail(chain)(batch)
    items = []
    for i in range(4):
        item: Any = {k: v[i].clone() for k, v in batch.items()}
        for t in want_chain if isinstance(want_chain, list) else [want_chain]:
            item = t(item)
        items.append(item)
    want = {k: v.as_subclass(torch.Tensor) for k, v in list_data_collate(items).items()}
    assert_same(got, want)


BRATS = [
    mt.RandSpatialCropd(K, roi_size=(12, 12, 12)),
    mt.RandFlipd(K, prob=0.5, spatial_axis=0),
    mt.RandFlipd(K, prob=0.5, spatial_axis=1),
    mt.RandFlipd(K, prob=0.5, spatial_axis=2),
    mt.NormalizeIntensityd("image", nonzero=True, channel_wise=True),
    mt.RandScaleIntensityd("image", factors=0.1, prob=1.0),
    mt.RandShiftIntensityd("image", offsets=0.1, prob=1.0),
]


@pytest.mark.parametrize("nonzero", [True, False])
@pytest.mark.parametrize("channel_wise", [True, False])
def test_normalize_intensity_brats_tail(nonzero: bool, channel_wise: bool) -> None:
    batch = make_batch()
    image = torch.cat([batch["image"], 3 * batch["image"] + 1, torch.zeros_like(batch["image"])], dim=1)
    image[:, :, :4] = 0  # background slab: nonzero=True leaves it at 0
    image[1] = 0  # an item with no nonzero voxel at all
    batch["image"] = image
    chain = list(BRATS)
    chain[4] = mt.NormalizeIntensityd("image", nonzero=nonzero, channel_wise=channel_wise)
    got, tail = batched(chain, batch, seed=12)
    assert tail.fallbacks == []
    assert_same(got, reference(chain, batch, seed=12), atol=2e-5)


def test_normalize_intensity_with_given_values_runs_per_item() -> None:
    batch = make_batch()
    chain = [mt.RandFlipd(K, prob=0.5), mt.NormalizeIntensityd("image", subtrahend=0.5, divisor=0.25)]
    got, tail = batched(chain, batch, seed=2)
    assert tail.fallbacks == ["NormalizeIntensityd"]
    assert_same(got, reference(chain, batch, seed=2))


@pytest.mark.parametrize("n", [1, 2])
def test_per_item_lists_of_one_object_stay_lists(n: int) -> None:
    """["CT", "CT"] (or ["CT"] for one item) through a per-item transform stays a list, as MONAI collates it."""
    batch: dict[str, Any] = dict(make_batch(n=n))
    batch["modality"] = ["CT"] * n
    chain = [per_item("RandGibbsNoised", "image", prob=1.0), mt.RandFlipd(K, prob=0.5)]  # the first: per item
    got, tail = batched(chain, batch, seed=3)
    assert tail.fallbacks == ["OwnRandGibbsNoised"]
    from monai.data import list_data_collate

    assert got["modality"] == list_data_collate([{"modality": "CT"}] * n)["modality"] == ["CT"] * n
    _, origin = tail.set_random_state(3).run(batch)
    assert origin == list(range(n))


def test_one_object_twice_draws_item_by_item_as_monai() -> None:
    flip = mt.RandFlipd(K, prob=0.5, spatial_axis=0)
    chain = [flip, mt.RandRotate90d(K, prob=0.5, spatial_axes=(0, 2)), flip]
    batch = make_batch(n=6)
    got, _ = batched(chain, batch, seed=4)
    assert_same(got, reference(chain, batch, seed=4))


def test_reseed_gives_monai_s_generators_in_place() -> None:
    """RandSpatialCropSamples seeded again in place: the same states as MONAI's set_random_state(seed=) gives,
    one generator each; where they share one (as MONAI's constructor leaves them), MONAI's own call."""
    import numpy as np
    from monai.transforms import RandSpatialCropSamples

    from loaders.tail.crops import reseed

    ours = RandSpatialCropSamples(roi_size=(4, 4), num_samples=3, random_size=False)
    monai = RandSpatialCropSamples(roi_size=(4, 4), num_samples=3, random_size=False)
    shared = ours.R is ours.cropper.R
    for seed in (7, 2**32 + 5, 123456789):
        before = (ours.R, ours.cropper.R)
        reseed(ours, seed)
        monai.set_random_state(seed=seed)
        assert ours.R is not ours.cropper.R
        for a, b in ((ours.R, monai.R), (ours.cropper.R, monai.cropper.R)):
            sa, sb = a.get_state(), b.get_state()
            assert np.array_equal(sa[1], sb[1]) and sa[2:] == sb[2:]
        if not shared or seed != 7:  # after the first call each has its own: kept, seeded again
            assert ours.R is before[0] and ours.cropper.R is before[1]
        ours.cropper.randomize([9, 9])
        monai.cropper.randomize([9, 9])
        assert ours.cropper._slices == monai.cropper._slices
