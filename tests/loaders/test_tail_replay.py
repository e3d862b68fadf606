"""A tail replayed from its plans (draws on the host, the work from them): bit for bit MONAI's per-item chain over
several batches, eagerly here and as graphs captured once on a GPU; transforms and inputs without a plan are
told apart before anything is drawn."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tailutil import K, assert_same, make_batch, reference_batches

from loaders.tail.plans import Drawn, fired_count, plan_of
from loaders.tail.replay import ReplayedTail


def _planned(dtype: torch.dtype = torch.float32) -> list[Any]:
    import monai.transforms as mt

    return [
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
        mt.RandScaleIntensityd(keys="image", factors=0.2, prob=0.5, dtype=dtype),
        mt.RandShiftIntensityd(keys="image", offsets=0.3, prob=0.5),
        mt.RandScaleIntensityd(keys="image", factors=0.2, prob=0.7, channel_wise=True, dtype=dtype),
        mt.RandShiftIntensityd(keys="image", offsets=0.3, prob=0.7, channel_wise=True),
        mt.RandFlipd(keys=K, spatial_axis=[1, 2], prob=0.5),
        mt.RandRotate90d(keys=K, prob=0.6, max_k=3, spatial_axes=(1, 2)),
        mt.RandFlipd(keys=K, prob=0.5),
    ]


def _given(
    batches: int, device: str, dtype: torch.dtype = torch.float32, channels: int = 2, n: int = 5
) -> list[dict[str, Any]]:
    out = []
    for s in range(batches):
        b = make_batch(n=n, spatial=(9, 10, 10), seed=s)
        image = b["image"].repeat(1, channels, 1, 1, 1)
        out.append({"image": image.to(device, dtype), "label": b["label"].to(device, dtype)})
    return out


def _compare(device: str, dtype: torch.dtype = torch.float32, batches: int = 6) -> ReplayedTail:
    from monai.transforms import Compose

    given = _given(batches, device, dtype)
    chain = Compose(_planned(dtype)).set_random_state(7)
    want = reference_batches(chain, [{k: v.clone() for k, v in b.items()} for b in given])
    replayed = ReplayedTail(Compose(_planned(dtype)).set_random_state(7).transforms)
    for b, w in zip(given, want):
        assert replayed.covers(b)
        before = {k: v.clone() for k, v in b.items()}
        got = replayed.run(b)
        assert_same(got, w)
        assert_same(b, before)  # the input is never written
    return replayed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_equals_monai(dtype: torch.dtype) -> None:
    replayed = _compare("cpu", dtype)
    assert replayed.captures == 0


def test_draws_have_the_shapes_said() -> None:
    batch = _given(1, "cpu")[0]
    like = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    for t in _planned():
        plan = plan_of(t, like)
        assert plan is not None
        said = plan.values_like(5)
        d = plan.draw(5)
        drawn = d.values
        assert sorted(said) == sorted(drawn)
        for name, a in drawn.items():
            want = tuple(said[name].shape)
            count = fired_count(d.kind)
            if name == "coords" and count is not None:  # the affine's products: the fired rows' alone
                want = (max(count, 1), *want[1:])
            assert want == a.shape
            assert said[name].dtype == torch.from_numpy(np.zeros(1, a.dtype)).dtype


def test_no_plan_no_draw() -> None:
    """A transform without a plan, or an integer image, leaves the tail uncovered, and nothing is drawn: the
    transforms' random states are where they were."""
    import monai.transforms as mt

    flip = mt.RandFlipd(keys=K, prob=0.5).set_random_state(1)
    state = flip.R.get_state()[1].copy()
    rotate = mt.RandRotate90d(keys=K, prob=0.5)  # the batch's (9, 10) plane is not square: odd turns reshape
    batch = _given(1, "cpu")[0]
    assert not ReplayedTail([flip, rotate]).covers(batch)
    ints = {k: v.to(torch.int32) for k, v in batch.items()}
    assert not ReplayedTail([flip]).covers(ints)
    doubles = {k: v.to(torch.float64) for k, v in batch.items()}  # its items would leave in two dtypes
    assert not ReplayedTail([flip, mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5)]).covers(doubles)
    assert np.array_equal(flip.R.get_state()[1], state)
    with pytest.raises(ValueError, match="no plan"):
        ReplayedTail([flip, rotate]).run(batch)


def test_a_meta_factor_has_no_plan() -> None:
    import monai.transforms as mt

    batch = _given(1, "cpu")[0]
    batch["image_meta_dict"] = torch.ones(5, 1)
    assert not ReplayedTail([mt.RandShiftIntensityd(keys="image", offsets=0.1, factor_key="f")]).covers(batch)


@pytest.mark.gpu
def test_graphs_equal_monai_on_the_gpu() -> None:
    """Captured once per transform, replayed for every batch after, each batch equal to MONAI's on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    replayed = _compare("cuda:0", batches=8)
    assert replayed.captures == len(_planned())


def _elastic() -> list[Any]:
    import monai.transforms as mt

    return [
        mt.Rand3DElasticd(K, sigma_range=(1, 3), magnitude_range=(2, 5), prob=0.6, mode=("bilinear", "nearest"),
                          padding_mode="border"),
        mt.RandFlipd(K, spatial_axis=0, prob=0.5),
        mt.RandScaleIntensityd(keys="image", factors=0.2, prob=0.5),
    ]  # fmt: skip


def _affine() -> list[Any]:
    import monai.transforms as mt

    return [
        mt.RandAffined(keys=K, prob=0.5, rotate_range=(0.1, 0.1, 0.1), scale_range=(0.1, 0.1, 0.1),
                       mode=("bilinear", "nearest"), padding_mode="border"),
        mt.RandFlipd(K, spatial_axis=1, prob=0.5),
    ]  # fmt: skip


def _compare_elastic(device: str, batches: int, chain_of: Any = _elastic) -> ReplayedTail:
    from monai.transforms import Compose

    given = _given(batches, device, channels=1)
    chain = Compose(chain_of()).set_random_state(11)
    want = reference_batches(chain, [{k: v.clone() for k, v in b.items()} for b in given])
    replayed = ReplayedTail(Compose(chain_of()).set_random_state(11).transforms)
    for b, w in zip(given, want):
        _same_or_refused(replayed, b, w)
    return replayed


def _same_or_refused(replayed: ReplayedTail, b: dict[str, Any], w: dict[str, Any]) -> None:
    """The replay bit for bit MONAI's where it covers the batch; where it does not (a plan not shown exact on a CUDA
    device: RandAffined's and RandRotated's matrices), refused, its numbers still within 1e-5 of MONAI's."""
    chain = replayed._chain(b)
    assert chain is not None
    exact = b["image"].device.type == "cpu" or all(p.exact_on_cuda for p in chain.plans)
    assert replayed.covers(b) == exact
    got = replayed.replay(b, replayed.draw(b))
    if exact:
        assert_same(got, w)
        return
    assert_same(got, w, keys=("image",), atol=1e-5)
    assert (got["label"] != w["label"]).float().mean() < 1e-3  # nearest: a coordinate on a half may round the other way


def test_elastic_eager_equals_monai() -> None:
    """Rand3DElasticd's plan, item by item (its kernels' length drawn per item), against MONAI on the CPU."""
    _compare_elastic("cpu", 3)


def test_affine_eager_equals_monai() -> None:
    """RandAffined's plan (every item resampled, the fired ones kept) against MONAI on the CPU."""
    _compare_elastic("cpu", 3, _affine)


def test_elastic_with_a_range_has_no_plan() -> None:
    import monai.transforms as mt

    ranged = mt.Rand3DElasticd(K, sigma_range=(1, 3), magnitude_range=(2, 5), rotate_range=0.1)
    assert not ReplayedTail([ranged]).covers(_given(1, "cpu")[0])


@pytest.mark.gpu
def test_elastic_graphs_equal_monai_on_the_gpu() -> None:
    """Its graphs captured per row and kernel length, replayed after: each batch MONAI's on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    replayed = _compare_elastic("cuda:0", 8)
    assert replayed.captures >= 3
    replayed = _compare_elastic("cuda:0", 6, _affine)
    assert replayed.captures >= 2  # the flip's, and the affine's for each pattern of fired rows met


def _seg_aug() -> list[Any]:
    from tailutil import augment_3d

    return augment_3d()


def test_seg_augs_chain_eager_equals_monai() -> None:
    """The tutorials' augmentations, every one planned (the sharpening and the dropout run from their draws between
    the graphs), against MONAI on the CPU."""
    import monai.transforms as mt

    batch = _given(1, "cpu", channels=1)[0]
    like = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    kinds = [type(plan_of(t, like)).__name__ for t in _seg_aug()]
    assert "Eager" not in kinds and {"_Flip", "_AffinePlan", "_SharpenItems", "_DropoutItems"} <= set(kinds)
    assert plan_of(mt.RandGaussianSharpend(keys="image", prob=0.5), {k: v.double() for k, v in like.items()}) is None
    _compare_elastic("cpu", 3, _seg_aug)


def _drawn_apart() -> list[Any]:
    """Plans whose draws carry everything their work needs: the affine's host products, the sharpening's sigmas,
    the dropout's holes and fills (over the item's range, over a range given, or a number; holes kept too)."""
    import monai.transforms as mt

    return [
        *_seg_aug(),
        mt.RandGaussianSharpend(keys=K, prob=0.7),
        mt.RandCoarseDropoutd(keys=K, prob=0.7, holes=2, spatial_size=3, max_holes=4, fill_value=(0.2, 0.6)),
        mt.RandCoarseDropoutd(keys="image", prob=0.7, holes=3, spatial_size=2, fill_value=0.25),
        mt.RandCoarseDropoutd(keys="image", prob=0.7, holes=2, spatial_size=4, dropout_holes=False),
    ]


@pytest.mark.parametrize("patterns", [0, 8])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_draws_made_by_one_tail_replayed_by_another_equal_monai(
    device: str, patterns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a host feeder does: one tail makes the draws (its random state MONAI's), another of other random
    states does the work from them alone (as graphs on a GPU): MONAI's batches, bit for bit, every plan exact on a
    CUDA device, and the whole tail drawable; its work on every item kept by masks (0), or on the fired rows alone
    (8: the affine's products then drawn for those rows alone)."""
    from monai.transforms import Compose

    from loaders import tunables

    monkeypatch.setattr(tunables, "TAIL_PATTERNS", patterns)

    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no GPU here")
    given = _given(6, device, channels=1, n=4)
    want = reference_batches(Compose(_drawn_apart()).set_random_state(11), [{k: v.clone() for k, v in b.items()}
                                                                          for b in given])  # fmt: skip
    drawer = ReplayedTail(Compose(_drawn_apart()).set_random_state(11).transforms)
    worker = ReplayedTail(Compose(_drawn_apart()).set_random_state(99).transforms)
    rows = set()  # the affine's products' rows, batch by batch
    for b, w in zip(given, want):
        assert drawer.drawable(b) and worker.covers(b)
        drawn = drawer.draw(b)
        rows |= {d.values["coords"].shape[0] for d in drawn if isinstance(d, Drawn) and "coords" in d.values}
        got = worker.replay(b, drawn)
        assert_same(got, w)
        assert not worker.checks or all(bool(ok) for ok, _ in worker.checks)
    assert rows == {4} if patterns == 0 else bool(rows) and min(rows) < 4


@pytest.mark.gpu
def test_seg_augs_chain_on_the_gpu() -> None:
    """The same on the GPU: its planned transforms as graphs, bit for bit MONAI's."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    _compare_elastic("cuda:0", 6, _seg_aug)


def _intensity() -> list[Any]:
    import monai.transforms as mt

    return [
        mt.RandAdjustContrastd(keys="image", prob=0.6, gamma=(0.7, 1.5), invert_image=True, retain_stats=True),
        mt.RandStdShiftIntensityd(keys="image", prob=0.6, factors=0.2, channel_wise=True),
        mt.RandHistogramShiftd(keys="image", prob=0.6, num_control_points=6),
        mt.RandBiasFieldd(keys="image", prob=0.6, coeff_range=(0.0, 0.2), degree=2),
        mt.RandAdjustContrastd(keys="image", prob=0.6, gamma=(0.7, 1.5)),
    ]


def _compare_intensity(device: str, batches: int, n: int = 5) -> ReplayedTail:
    from monai.transforms import Compose

    given = _given(batches, device, channels=2, n=n)
    want = reference_batches(
        Compose(_intensity()).set_random_state(5), [{k: v.clone() for k, v in b.items()} for b in given]
    )
    replayed = ReplayedTail(Compose(_intensity()).set_random_state(5).transforms)
    like = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in given[0].items()}
    assert not any(type(plan_of(t, like)).__name__ == "Eager" for t in _intensity())  # every one planned
    for b, w in zip(given, want):
        assert_same(replayed.run(b), w)
    return replayed


@pytest.mark.parametrize("patterns", [0, 6])
def test_intensity_plans_eager_equal_monai(patterns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast (inverted, its stats kept), channel-wise std shift, histogram shift and bias field plans: on every
    item kept by the mask, and on the fired rows alone (a graph per pattern)."""
    from loaders import tunables

    monkeypatch.setattr(tunables, "TAIL_PATTERNS", patterns)
    _compare_intensity("cpu", 3)
    _compare_elastic("cpu", 3, _seg_aug)


@pytest.mark.gpu
@pytest.mark.parametrize("patterns", [0, 6])
def test_intensity_graphs_equal_monai_on_the_gpu(patterns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """As graphs: by the masks, one graph a transform; on the fired rows alone, one a transform and pattern."""
    from loaders import tunables

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    monkeypatch.setattr(tunables, "TAIL_PATTERNS", patterns)
    captures = _compare_intensity("cuda:0", 6).captures
    if patterns:
        assert len(_intensity()) <= captures <= len(_intensity()) * 2**5  # batches of 5
    else:
        assert captures == len(_intensity())


@pytest.mark.gpu
def test_the_batched_tail_replays_where_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLOCKPREP_TAIL_REPLAY: the loader's tail (`BatchedTail`) replays a planned chain, batches equal to MONAI's."""
    from monai.transforms import Compose

    from loaders import tunables
    from loaders.tail import BatchedTail
    from loaders.tail.device import tail_stream

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    monkeypatch.setattr(tunables, "TAIL_REPLAY", "here")
    given = _given(4, "cuda:0", channels=1)

    def chain() -> list[Any]:  # seg-aug's without RandAffined (not replayed on a GPU: `_same_or_refused`)
        return [t for t in _seg_aug() if type(t).__name__ != "RandAffined"]

    want = reference_batches(
        Compose(chain()).set_random_state(2), [{k: v.clone() for k, v in b.items()} for b in given]
    )
    tail = BatchedTail(Compose(chain())).set_random_state(2)
    stream = tail_stream("cuda:0")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = [tail(b) for b in given]
    torch.cuda.current_stream().wait_stream(stream)
    for g, w in zip(got, want):
        assert_same(g, w)
    assert tail._replay is not None and tail._replay.captures > 0


@pytest.mark.gpu
def test_fired_rows_alone_equal_monai_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The costly plans on their fired rows alone (a graph per pattern), bit for bit MONAI's on the GPU."""
    from loaders import tunables

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    monkeypatch.setattr(tunables, "TAIL_PATTERNS", 6)
    _compare_elastic("cuda:0", 6, _affine)
    _compare_intensity("cuda:0", 6)
    _compare_elastic("cuda:0", 6, _seg_aug)


def _slices() -> list[Any]:
    """`slices`' tail after its folded crop: one-voxel-thick windows squeezed, 2D flips and turns, intensity."""
    import monai.transforms as mt

    return [
        mt.SqueezeDimd(keys=K, dim=-1),
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
        mt.RandRotate90d(keys=K, prob=0.5, max_k=3),
        mt.RandRotated(keys=K, range_x=0.3, prob=0.6, mode=("bilinear", "nearest")),
        mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        mt.RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ]


def _compare_slices(device: str, batches: int) -> ReplayedTail:
    from monai.transforms import Compose

    given = []
    for s in range(batches):
        b = make_batch(n=7, spatial=(12, 12, 1), seed=s)
        given.append({k: b[k].to(device, torch.float32) for k in K})
    want = reference_batches(
        Compose(_slices()).set_random_state(9), [{k: v.clone() for k, v in b.items()} for b in given]
    )
    replayed = ReplayedTail(Compose(_slices()).set_random_state(9).transforms)
    like = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in given[0].items()}
    assert plan_of(_slices()[0], like) is not None
    for b, w in zip(given, want):
        _same_or_refused(replayed, b, w)
    return replayed


@pytest.mark.parametrize("patterns", [0, 8])
def test_slices_tail_eager_equals_monai(patterns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SqueezeDimd and RandRotated planned too: `slices`' whole tail, against MONAI on the CPU."""
    from loaders import tunables

    monkeypatch.setattr(tunables, "TAIL_PATTERNS", patterns)
    _compare_slices("cpu", 3)


@pytest.mark.gpu
def test_slices_tail_graphs_equal_monai_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    _compare_slices("cuda:0", 6)


def test_a_plan_that_cannot_be_made_leaves_the_tail_uncovered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MONAI whose transform lacks what a plan reads: no replay (the tail runs as the others), no error."""
    import monai.transforms as mt

    from loaders.tail import plans

    def broken(t: Any, keys: Any, like: Any) -> Any:
        raise AttributeError("'RandFlipd' object has no attribute 'flipper'")

    monkeypatch.setitem(plans._PLANS, "RandFlipd", broken)
    assert not ReplayedTail([mt.RandFlipd(keys=K, prob=0.5)]).covers(_given(1, "cpu")[0])


@pytest.mark.parametrize(("smooth", "want"), [(False, True), (True, False)])
def test_a_tail_says_whether_its_batches_could_be_drawn_alone(smooth: bool, want: bool) -> None:
    """`BatchedTail.drawable` (feeder="auto" tries a host feeder only where it is True): None before a first batch;
    then True where every transform has a plan run from its draws, False where one runs eagerly."""
    from monai.transforms import Compose, RandFlipd, RandGaussianSmoothd, RandScaleIntensityd

    from loaders.tail import BatchedTail

    chain: list[Any] = [RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandScaleIntensityd(keys="image", factors=0.1)]
    if smooth:
        chain.append(RandGaussianSmoothd(keys="image", prob=0.2))
    tail = BatchedTail(Compose(chain)).set_random_state(1)
    assert tail.drawable() is None
    batch = make_batch(2)
    tail({"image": batch["image"], "label": batch["label"].float()})  # a float label, as the chain's head leaves it
    assert tail.drawable() is want


def test_fired_rows_are_picked_by_a_device_index_made_from_the_mask() -> None:
    """A costly plan's graph is one a count of fired items: their rows' index made from the mask where the work
    runs, for every mask of a batch of five, in order; `on_fired` puts the worked rows back where they were."""
    import itertools

    from loaders.tail.device import Picked, fired_index
    from loaders.tail.plans import fired_kind, on_fired

    x = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    for bits in itertools.product([False, True], repeat=5):
        fired = np.array(bits)
        kind = fired_kind(fired)
        assert kind == ("fired", int(fired.sum()))
        mask = torch.from_numpy(fired)
        assert fired_index(mask, kind[1]).tolist() == np.flatnonzero(fired).tolist()
        got = on_fired(x, kind, mask, lambda v, rows: v * 10 + len(rows))
        want = torch.where(mask[:, None], x * 10 + int(fired.sum()), x)
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="device index"):
        list(Picked(torch.arange(2)))
