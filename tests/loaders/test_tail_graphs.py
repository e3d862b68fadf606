"""The batched tail's kernels launched as CUDA graphs on the tail stream: bit for bit MONAI's per-item chain on the
same GPU; a transform whose work cannot be captured is undone and run again uncaptured, with the same numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tailutil import assert_same, augment_2d, augment_3d, make_batch, reference_batches, then_deterministic

from loaders import tunables
from loaders.tail import BatchedTail
from loaders.tail.device import tail_stream

K = ["image", "label"]


@pytest.fixture(autouse=True)
def _captured_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail's graphs in this process too (by default only a feeder's process captures), its segments' (a tail
    of planned transforms is replayed otherwise: tests/loaders/test_tail_replay.py)."""
    monkeypatch.setattr(tunables, "TAIL_GRAPHS", True)
    monkeypatch.setattr(tunables, "TAIL_REPLAY", False)


def _chain_2d() -> list[Any]:
    import monai.transforms as mt

    return [*augment_2d(), mt.EnsureTyped(keys=K, dtype=torch.float32)]


def _refusing() -> list[Any]:
    """A chain whose middle transform reads the GPU on the host (MONAI's `slices.any()` where `nonzero`): its
    capture fails, and the flip captured before it in the same segment must be undone with it."""
    import monai.transforms as mt

    return [
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
        mt.RandStdShiftIntensityd(keys="image", prob=1.0, factors=0.1, nonzero=True),
        mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        mt.RandFlipd(keys=K, spatial_axis=[1], prob=0.5),
    ]


def _run(
    chain: Any, spatial: tuple[int, ...], batches: int = 4, dtype: torch.dtype = torch.float32
) -> tuple[list[Any], list[Any], BatchedTail]:
    from monai.transforms import Compose

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    given = []
    for s in range(batches):
        b = make_batch(n=6, spatial=spatial, seed=s)
        given.append({"image": b["image"].to("cuda:0", dtype), "label": b["label"].float().to("cuda:0")})
    want = reference_batches(
        Compose(chain()).set_random_state(3), [{k: v.clone() for k, v in b.items()} for b in given]
    )
    tail = BatchedTail(Compose(chain())).set_random_state(3)
    stream = tail_stream("cuda:0")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = [tail(b) for b in given]
    torch.cuda.current_stream().wait_stream(stream)
    return got, want, tail


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("chain", "spatial"),
    [(augment_3d, (20, 22, 20)), (_chain_2d, (24, 24)), (then_deterministic, (20, 22, 20))],
    ids=["3d", "2d", "3d-then-deterministic"],
)
def test_captured_batches_equal_monai_on_the_gpu(chain: Any, spatial: tuple[int, ...]) -> None:
    got, want, tail = _run(chain, spatial)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert tail._graphs.launched >= len(got)  # at least a segment a batch was launched as a graph
    assert tail._graphs.refused == {}


@pytest.mark.gpu
def test_a_transform_that_cannot_be_captured_is_undone_and_run_again() -> None:
    got, want, tail = _run(_refusing, (20, 22, 20))
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert set(tail._graphs.refused) == {1}, (
        tail._graphs.refused
    )  # the std shift with nonzero; the flips and the scaling stay captured
    assert tail._graphs.launched >= 2 * len(got)


def _drawn_on_the_host(**affine: Any) -> list[Any]:
    """Transforms whose draws numpy makes on the host, ahead on a thread (the elastic's offsets, the noise):
    captured, only their copies up are in the graph."""
    import monai.transforms as mt

    return [
        mt.Rand3DElasticd(K, sigma_range=(2, 3), magnitude_range=(2, 5), prob=0.6, mode=("bilinear", "nearest"),
                          padding_mode="border", **affine),
        mt.RandGaussianNoised("image", prob=0.5, std=0.1),
        mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.5),
    ]  # fmt: skip


@pytest.mark.gpu
def test_draws_made_on_the_host_are_captured_with_their_copies() -> None:
    got, want, tail = _run(_drawn_on_the_host, (20, 22, 20), batches=5)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert tail.fallbacks == [] and tail._graphs.refused == {}
    assert tail._graphs.launched >= len(got)


@pytest.mark.gpu
def test_an_elastic_with_an_affine_range_equals_monai() -> None:
    """MONAI's own transform makes each item's grid (its sigma copied up and read back): refused, or captured."""
    got, want, _ = _run(lambda: _drawn_on_the_host(rotate_range=(0.1, 0.1, 0.1)), (20, 22, 20), batches=3)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))


@pytest.mark.gpu
def test_an_undone_segment_puts_back_draws_made_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The elastic's offsets and the noise are drawn ahead; a transform after them in the segment fails its
    capture (its refusal forgotten at each batch's start): each batch's draws are undone and drawn again, exactly
    (after the first batch, from draws made ahead)."""
    import monai.transforms as mt

    from loaders.tail import graphs

    def chain() -> list[Any]:
        return [*_drawn_on_the_host(), mt.RandStdShiftIntensityd(keys="image", prob=1.0, factors=0.1, nonzero=True)]

    undone: list[tuple[int, list[int], str]] = []
    undo = graphs.Segments._undo

    def forgetting(self: Any, tb: Any, refused: list[int], error: Exception) -> Any:
        rewind = undo(self, tb, refused, error)
        undone.append((rewind.index, refused, str(error).splitlines()[0][:200]))
        return rewind

    monkeypatch.setattr(graphs.Segments, "_undo", forgetting)
    got, want, tail = _run(chain, (20, 22, 20), batches=2)  # the refusal kept: one undo
    assert [u[:2] for u in undone] == [(0, [3])], undone
    begin = graphs.Graphs.begin

    def forgotten(self: Any, tb: Any) -> Any:
        self.refused.clear()
        return begin(self, tb)

    monkeypatch.setattr(graphs.Graphs, "begin", forgotten)
    got, want, tail = _run(chain, (20, 22, 20), batches=4)  # the refusal forgotten each batch: one undo a batch
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert [u[:2] for u in undone] == [(0, [3])] * 5, undone  # each time the std shift's read, nothing else


@pytest.mark.gpu
def test_graphs_off_launch_nothing_as_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tunables, "TAIL_GRAPHS", False)
    got, want, tail = _run(_chain_2d, (24, 24), batches=2)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert tail._graphs.launched == 0


@pytest.mark.gpu
def test_a_feeders_empty_segments_warn_of_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment where no transform launched anything (a flip that never fires) is an empty graph: torch warns
    of it, but not in a feeder's process."""
    import warnings

    import monai.transforms as mt

    from loaders.tail import graphs

    monkeypatch.setattr(graphs, "in_feeder", False)  # restored after the test
    with warnings.catch_warnings(record=True) as seen:  # the filter `in_a_feeder` adds is undone after it
        warnings.simplefilter("always")
        graphs.in_a_feeder()
        _, _, tail = _run(lambda: [mt.RandFlipd(keys=K, spatial_axis=[0], prob=0.0)], (8, 8), batches=2)
    assert tail._graphs.launched >= 2
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)]


def test_on_the_cpu_nothing_is_captured() -> None:
    from monai.transforms import Compose

    b = make_batch(n=3, spatial=(12, 12), seed=0)
    tail = BatchedTail(Compose(_chain_2d())).set_random_state(3)
    tail(b)
    assert tail._graphs.launched == 0 and tail._graphs.pool is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("invert", "stats"), [(False, False), (True, True)])
def test_contrast_on_the_gpu_reads_nothing_back(
    dtype: torch.dtype, invert: bool, stats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MONAI divides by the range read back; on a CUDA device that is a multiplication by its reciprocal, made
    here on the device: the same numbers with no read."""
    import monai.transforms as mt

    from loaders.tail import device

    reads: list[int] = []
    spans = device.item_spans
    monkeypatch.setattr(device, "item_spans", lambda *a: reads.append(1) or spans(*a))

    def chain() -> list[Any]:
        return [mt.RandAdjustContrastd("image", prob=0.7, gamma=(0.7, 1.5), invert_image=invert, retain_stats=stats)]

    got, want, tail = _run(chain, (20, 22, 20), dtype=dtype)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image",))
    assert reads == [] and tail._graphs.refused == {}


@pytest.mark.gpu
@pytest.mark.parametrize("approx", ["erf", "sampled"])
@pytest.mark.parametrize("spatial", [(20, 22, 20), (24, 26)])
def test_sharpening_kernels_made_at_once_equal_monai(approx: str, spatial: tuple[int, ...]) -> None:
    """Sigmas far apart, so the batch's kernels differ in length (each one a slice of a longer row)."""
    import monai.transforms as mt

    def chain() -> list[Any]:
        wide = (0.2, 3.0)
        return [mt.RandGaussianSharpend("image", sigma1_x=wide, sigma1_y=wide, sigma1_z=wide, sigma2_x=0.4,
                                        sigma2_y=(0.1, 0.6), sigma2_z=0.4, prob=0.8, approx=approx)]  # fmt: skip

    got, want, tail = _run(chain, spatial)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert tail._graphs.refused == {}


@pytest.mark.gpu
def test_by_default_only_a_feeders_process_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    from loaders.tail import graphs

    monkeypatch.setattr(tunables, "TAIL_GRAPHS", "feeder")
    _, _, here = _run(_chain_2d, (24, 24), batches=2)
    assert here._graphs.launched == 0
    monkeypatch.setattr(graphs, "in_feeder", True)
    got, want, there = _run(_chain_2d, (24, 24), batches=2)
    assert there._graphs.launched >= 2
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
