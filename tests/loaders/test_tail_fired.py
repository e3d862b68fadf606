"""The tutorials' per-item intensity augmentations, run on the items they fire on, against MONAI's per-item chain
+ list_data_collate on deep copies of the same transforms: bit for bit on the CPU (the bias field too: numpy's
recurrence, op for op)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import K, assert_same, batched, make_batch, reference  # noqa: E402

CHAINS = {
    "contrast": [mt.RandAdjustContrastd("image", prob=0.5, gamma=(0.7, 1.5))],
    "contrast_invert_stats": [mt.RandAdjustContrastd("image", prob=0.6, invert_image=True, retain_stats=True)],
    "histogram": [mt.RandHistogramShiftd("image", prob=0.5, num_control_points=10)],
    "histogram_range": [mt.RandHistogramShiftd(K, prob=0.7, num_control_points=(4, 9))],
    "histogram_range_image": [mt.RandHistogramShiftd("image", prob=0.7, num_control_points=(4, 9))],
    "sharpen": [mt.RandGaussianSharpend("image", prob=0.5)],
    "std_shift": [mt.RandStdShiftIntensityd("image", prob=0.5, factors=0.1)],
    "std_shift_nonzero": [mt.RandStdShiftIntensityd("image", prob=0.6, factors=(0.1, 0.4), nonzero=True)],
    "dropout": [mt.RandCoarseDropoutd(K, prob=0.5, holes=4, spatial_size=5)],
    "dropout_fill": [mt.RandCoarseDropoutd("image", prob=0.6, holes=2, max_holes=5, spatial_size=3, fill_value=0.5)],
    "dropout_keep": [mt.RandCoarseDropoutd("image", prob=0.6, holes=3, spatial_size=6, dropout_holes=False)],
    "dropout_image": [mt.RandCoarseDropoutd("image", prob=0.7, holes=4, spatial_size=5)],
    "dropout_keep_range": [
        mt.RandCoarseDropoutd("image", prob=0.7, holes=2, spatial_size=4, fill_value=(0.1, 0.9), dropout_holes=False)
    ],
    "bias": [mt.RandBiasFieldd("image", prob=0.5, coeff_range=(0.0, 0.1))],
    "bias_degree": [mt.RandBiasFieldd("image", prob=0.8, degree=4, coeff_range=(0.1, 0.3))],
    "gibbs": [mt.RandGibbsNoised(K, prob=0.5, alpha=(0.2, 0.6))],
    "kspace": [mt.RandKSpaceSpikeNoised("image", prob=0.5, intensity_range=(9, 11))],
    "rician": [mt.RandRicianNoised("image", prob=0.5, std=0.1)],
    "shuffle": [mt.RandCoarseShuffled(K, prob=0.5, holes=3, spatial_size=4)],
    "low_resolution": [mt.RandSimulateLowResolutiond(K, prob=0.5, zoom_range=(0.5, 0.9))],
    "lambda": [mt.RandLambdad("image", func=lambda x: x * 1.5 + 0.1, prob=0.5)],
    "lambda_both": [mt.RandLambdad(K, func=lambda x: x.flip(1), prob=0.6)],
    "mri_tail": [
        mt.RandGibbsNoised("image", prob=0.3, alpha=(0.1, 0.5)),
        mt.RandRicianNoised("image", prob=0.3, std=0.05),
        mt.RandKSpaceSpikeNoised("image", prob=0.2),
        mt.RandFlipd(keys=K, spatial_axis=[1], prob=0.5),
    ],
    "seg_aug_tail": [
        mt.RandAdjustContrastd(keys="image", prob=0.3, gamma=(0.7, 1.5)),
        mt.RandHistogramShiftd(keys="image", prob=0.3, num_control_points=10),
        mt.RandBiasFieldd(keys="image", prob=0.3, coeff_range=(0.0, 0.1)),
        mt.RandGaussianSharpend(keys="image", prob=0.2),
        mt.RandCoarseDropoutd(keys="image", prob=0.3, holes=4, spatial_size=8),
        mt.RandStdShiftIntensityd(keys="image", prob=0.3, factors=0.1),
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
    ],
}


def _without_monais(monkeypatch: Any, cls: Any, chain: list[Any], batch: dict[str, Any], seed: int) -> Any:
    """The batched tail with MONAI's own `cls.__call__` failing the test if called; (batch, tail)."""
    monkeypatch.setattr(cls, "__call__", lambda *a, **k: pytest.fail(f"MONAI's own {cls.__name__} ran"))
    try:
        return batched(chain, batch, seed)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("seed", [0, 7])
def test_equals_monai_per_item(name: str, seed: int) -> None:
    batch = make_batch(n=6)
    got, tail = batched(CHAINS[name], batch, seed)
    assert_same(
        got,
        reference(CHAINS[name], batch, seed),
    )
    assert tail.fallbacks == []


def test_histogram_shift_maps_the_fired_items_at_once_and_leaves_a_one_value_image(monkeypatch: Any) -> None:
    chain = CHAINS["histogram_range_image"]
    batch = make_batch(n=6)
    batch["image"][1] = 0.25  # MONAI returns a one-value image as it is
    calls: list[int] = []
    monkeypatch.setattr(mt.RandHistogramShift, "__call__", lambda *a, **k: calls.append(1))
    got, tail = batched(chain, batch, 5)
    monkeypatch.undo()
    assert calls == [] and tail.fallbacks == []
    with pytest.warns(UserWarning, match="single value"):  # the one-value item is among those it fires on
        want = reference(chain, batch, 5)
    assert_same(got, want, keys=("image",))


@pytest.mark.parametrize("spatial", [(20, 22), (20, 22, 18)])
def test_bias_fields_are_monais(spatial: tuple[int, ...]) -> None:
    from loaders.tail.fired import bias_fields

    inner = mt.RandBiasField(prob=1.0, degree=3)
    coeffs = []
    want = []
    for seed in range(3):
        inner.set_random_state(seed)
        inner.randomize(img_size=spatial)
        coeffs.append(list(inner._coeff))
        want.append(inner._generate_random_field(spatial, inner.degree, inner._coeff))
    got = bias_fields(spatial, 3, coeffs, "cpu")[:, 0].numpy()
    for g, w in zip(got, want):
        assert abs(g - w).max() <= 1e-12


def test_the_last_fired_item_leaves_the_inner_as_monai() -> None:
    chain = [mt.RandHistogramShiftd("image", prob=0.5, num_control_points=(4, 9))]
    batch = make_batch(n=6)
    _, tail = batched(chain, batch, 3)
    want = mt.Compose([chain[0]])
    want.set_random_state(3)
    for i in range(6):
        want({"image": batch["image"][i].clone()})
    got_inner, want_inner = tail.transforms[0].shifter, chain[0].shifter
    assert got_inner.R.get_state()[2] == want_inner.R.get_state()[2]
    assert list(got_inner.floating_control_points) == list(want_inner.floating_control_points)


def test_monai_runs_only_on_the_items_it_fires_on() -> None:
    """`fired_whole`: MONAI's dict transform is called once per fired item, never on the others (whose values it
    leaves, or makes float32: RandSimulateLowResolutiond), and a transform none of whose keys is there draws as
    MONAI does (nothing for RandSimulateLowResolutiond, its prob for the others)."""
    from loaders.tail.fired import fired_whole
    from loaders.tail.tailbatch import TailBatch

    t = mt.RandRicianNoised("image", prob=0.4, std=0.1, allow_missing_keys=True).set_random_state(2)
    twin = mt.RandRicianNoised("image", prob=0.4).set_random_state(2)  # the dict's own state draws the probs only
    fired = int((twin.R.rand(6) < 0.4).sum())
    calls = []
    real = type(t).__call__

    def counted(self: object, data: dict) -> dict:
        calls.append(1)
        return real(self, data)

    type(t).__call__ = counted  # type: ignore[method-assign]
    try:
        batch = TailBatch(make_batch(n=6), 6)
        assert fired_whole(t, batch)
    finally:
        type(t).__call__ = real  # type: ignore[method-assign]
    assert len(calls) == fired and 0 < fired < 6, (calls, fired)  # seed 2: some fire, some do not
    low = mt.RandSimulateLowResolutiond("image", prob=0.5, allow_missing_keys=True).set_random_state(1)
    before = low.R.get_state()[2]
    assert fired_whole(low, TailBatch({"other": torch.zeros(3, 1, 4, 4, 4)}, 3)) and low.R.get_state()[2] == before
    shuffle = mt.RandCoarseShuffled("image", prob=0.5, holes=1, spatial_size=2, allow_missing_keys=True)
    before = shuffle.set_random_state(1).R.get_state()[2]
    assert fired_whole(shuffle, TailBatch({"other": torch.zeros(3, 1, 4, 4, 4)}, 3))
    assert shuffle.R.get_state()[2] != before  # its prob drawn for each of the three items


def test_sharpening_reads_no_sigma_back_and_equals_monai(monkeypatch: Any) -> None:
    """The filters' sigmas reach MONAI's `gaussian_1d` as device tensors whose `float()` is their host value (no
    read back); MONAI's own `GaussianSharpen` is not called, and the batch is still MONAI's."""
    from loaders.tail.gauss import known

    s = known(torch.tensor(2.5), 2.5)
    assert float(s) == 2.5 and type(torch.abs(s)) is torch.Tensor
    assert float(known(torch.tensor(2.5), 1.0)) == 1.0  # the host value, not the tensor's
    chain = [mt.RandGaussianSharpend("image", prob=0.7)]
    batch = make_batch(n=6)
    got, tail = _without_monais(monkeypatch, mt.GaussianSharpen, chain, batch, 4)
    assert tail.fallbacks == []
    assert_same(got, reference(chain, batch, 4), keys=("image",))


@pytest.mark.parametrize("affine", [True, False], ids=["no-read", "one-read"])
@pytest.mark.parametrize("name", ["dropout_image", "dropout_fill", "dropout_keep", "dropout_keep_range"])
def test_dropout_fills_float_items_where_they_are(name: str, affine: bool, monkeypatch: Any) -> None:
    """Float keys: the holes filled without MONAI's round trip through numpy (its own transform is not called),
    the numbers MONAI's. A random fill computed from the items' min and max where they are, nothing read back
    (where numpy's uniform is the plain affine map); otherwise the batch's min and max read once."""
    from loaders.tail import dropout

    if affine and not dropout.uniform_is_affine():
        pytest.skip("this numpy's uniform is not lo + (hi - lo) * u rounded apart (a fused multiply-add build)")
    monkeypatch.setattr(dropout, "uniform_is_affine", lambda: affine)
    chain = CHAINS[name]
    batch = make_batch(n=6)
    reads = _counted_spans(monkeypatch)
    got, tail = _without_monais(monkeypatch, mt.RandCoarseDropout, chain, batch, 2)
    assert tail.fallbacks == [] and len(reads) == (chain[0].dropper.fill_value is None and not affine)
    assert_same(got, reference(chain, batch, 2), keys=("image",))
    assert not torch.equal(got["image"], batch["image"])  # some item was dropped out


@pytest.mark.parametrize("affine", [True, False], ids=["no-read", "one-read"])
@pytest.mark.parametrize("holes", [True, False], ids=["holes-filled", "holes-kept"])
def test_dropout_refuses_a_range_that_is_not_finite_as_numpy_does(affine: bool, holes: bool, monkeypatch: Any) -> None:
    """An item holding inf: numpy's uniform refuses its range in MONAI's transform, and the batched tail raises
    the same error (read once, after the tail's work, where nothing is read mid-tail)."""
    from loaders.tail import dropout

    monkeypatch.setattr(dropout, "uniform_is_affine", lambda: affine)
    chain = [mt.RandCoarseDropoutd("image", prob=1.0, holes=2, spatial_size=3, dropout_holes=holes)]
    batch = make_batch(n=4)
    batch["image"][2, 0, 1, 1, 1] = float("inf")
    with pytest.raises(RuntimeError) as monais:  # Compose wraps the transform's error
        reference(chain, batch, 2)
    assert isinstance(monais.value.__cause__, OverflowError) and str(monais.value.__cause__) == dropout.RANGE_ERROR
    with pytest.raises(OverflowError, match=dropout.RANGE_ERROR):
        batched(chain, batch, 2)


def test_dropout_reads_no_range_when_no_item_fires(monkeypatch: Any) -> None:
    chain = [mt.RandCoarseDropoutd("image", holes=2, spatial_size=2, prob=0.0)]
    batch = make_batch(n=6)
    reads = _counted_spans(monkeypatch)
    got, tail = batched(chain, batch, 2)
    assert tail.fallbacks == [] and reads == []
    assert_same(got, reference(chain, batch, 2), keys=("image",))


def _counted_spans(monkeypatch: Any) -> list[int]:
    """Each call of `device.item_spans` (one read of the batch back to the host) appended to the list."""
    from loaders.tail import device as b

    reads: list[int] = []
    spans = b.item_spans
    monkeypatch.setattr(b, "item_spans", lambda *a: reads.append(1) or spans(*a))
    return reads


def test_dropout_of_a_uint8_key_goes_through_monai() -> None:
    chain = CHAINS["dropout"]  # image and label: the label is uint8
    batch = make_batch(n=6)
    got, tail = batched(chain, batch, 3)
    assert_same(got, reference(chain, batch, 3))


@pytest.mark.parametrize("name", ["contrast", "contrast_invert_stats"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_contrast_reads_the_ranges_once_and_equals_monai(name: str, dtype: str, monkeypatch: Any) -> None:
    """MONAI's own AdjustContrast is not called; each item's range comes from one read of the batch."""
    chain = CHAINS[name]
    batch = make_batch(n=6)
    batch["image"] = batch["image"].to(getattr(torch, dtype))
    reads = _counted_spans(monkeypatch)
    got, tail = _without_monais(monkeypatch, mt.AdjustContrast, chain, batch, 6)
    assert tail.fallbacks == [] and reads == [1]
    assert_same(got, reference(chain, batch, 6), keys=("image",))


def test_the_host_range_is_the_devices() -> None:
    from loaders.tail.contrast import host_range

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for invert in (False, True):
            x = (torch.randn(1000, generator=g) * 7.3 + 1.1).to(dtype)
            y = -x if invert else x
            want = float((y.max() - y.min()) + 1e-7)
            assert host_range((float(x.min()), float(x.max())), x.dtype, invert) == want
