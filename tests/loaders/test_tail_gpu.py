"""The batched tail on a GPU, on the loader's tail stream, against MONAI's per-item chain on the same GPU: the
augmentations of `seg-aug` (3D) and `slices` (2D), bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tailutil import (
    assert_same,
    augment_2d,
    augment_3d,
    make_batch,
    reference_batches,
    then_deterministic,
    then_spatial,
)

from loaders.tail import BatchedTail
from loaders.tail.device import rows_of, tail_stream


def _on_gpu(spatial: tuple[int, ...]) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    return [{k: v.to("cuda:0") for k, v in make_batch(n=6, spatial=spatial, seed=s).items()} for s in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("chain", "spatial"),
    [
        (augment_3d, (20, 22, 20)),
        (augment_2d, (24, 24)),
        (then_deterministic, (20, 22, 20)),
        (then_spatial, (20, 22, 20)),
    ],
    ids=["3d", "2d", "3d-then-deterministic", "3d-then-spatial"],
)
def test_batches_on_the_tail_stream_equal_monai_on_the_gpu(chain: Any, spatial: tuple[int, ...]) -> None:
    from monai.transforms import Compose

    batches = _on_gpu(spatial)
    want = reference_batches(
        Compose(chain()).set_random_state(3), [{k: v.clone() for k, v in b.items()} for b in batches]
    )
    tail = BatchedTail(Compose(chain())).set_random_state(3)
    stream = tail_stream("cuda:0")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = [tail(b) for b in batches]
    torch.cuda.current_stream().wait_stream(stream)
    for g, w in zip(got, want):
        assert_same(g, w, keys=("image", "label"))
    assert tail.fallbacks == []


def test_rows_of_picks_rows_as_a_list_index_does() -> None:
    x = torch.arange(24.0).reshape(4, 2, 3)
    assert rows_of(x, [0, 1, 2, 3]) is x
    assert torch.equal(rows_of(x, [3, 1]), x[[3, 1]])
    assert torch.equal(rows_of(x, []), x[[]])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("size", [(24, 20), (20, 22, 18)])
@pytest.mark.parametrize(("corners", "zero_centered"), [(False, False), (True, False), (False, True), (True, True)])
def test_normalized_matrices_are_monais(device: str, size: tuple[int, ...], corners: bool, zero_centered: bool) -> None:
    """RandRotated's matrices normalized as MONAI's `to_norm_affine` normalizes them, with no host wait."""
    from monai.networks.utils import to_norm_affine

    from loaders.tail.sparse import _normalized

    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("no GPU here")
    g = torch.Generator().manual_seed(len(size))
    theta = (torch.eye(len(size) + 1) + 0.1 * torch.randn(3, len(size) + 1, len(size) + 1, generator=g)).to(device)
    want = to_norm_affine(theta, size, size, align_corners=corners, zero_centered=zero_centered)
    got = _normalized(theta, size, corners, zero_centered)
    assert got.dtype == want.dtype and got.device == want.device
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("size", [(24, 20), (20, 22, 18)])
def test_matrices_reversed_here_resample_as_monai_reverses_them(device: str, size: tuple[int, ...]) -> None:
    from monai.networks.layers import AffineTransform

    from loaders.tail.sparse import _reversed

    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("no GPU here")
    g = torch.Generator().manual_seed(len(size))
    nd = len(size)
    theta = (torch.eye(nd + 1) + 0.1 * torch.randn(3, nd + 1, nd + 1, generator=g)).to(device)
    theta[:, nd] = torch.eye(nd + 1)[nd].to(device)
    img = torch.rand(3, 1, *size, generator=g).to(device)
    plain = AffineTransform(normalized=True, reverse_indexing=False)
    monai_way = AffineTransform(normalized=True, reverse_indexing=True)(img, theta, spatial_size=size)
    ours = plain(img, _reversed(theta, nd), spatial_size=size)
    assert torch.equal(ours, monai_way)
    assert not torch.equal(plain(img, theta, spatial_size=size), ours)  # the reversal matters


@pytest.mark.gpu
@pytest.mark.parametrize("where", [None, "cuda:0"], ids=["grid-on-host", "grid-on-gpu"])
def test_rand_affine_equals_monai_on_the_gpu_with_one_item_fired(where: Any) -> None:
    """RandAffined on 96^3 items, batches in which one item fires among others: each grid made where MONAI makes
    it (the host, or the device the transform is given), bit for bit. A (4, 4) by (4, 96^3) product on an H200
    differs from the host's where two or more stacked do not."""
    import monai.transforms as mt
    from monai.transforms import Compose

    if not torch.cuda.is_available():
        pytest.skip("no GPU here")

    def chain() -> list[Any]:
        return [mt.RandAffined(keys=["image", "label"], prob=0.4, rotate_range=(0.2, 0.1, 0.1), scale_range=0.1,
                               translate_range=(3, 2, 1), mode=("bilinear", "nearest"), padding_mode="border",
                               device=where)]  # fmt: skip

    batches = [{k: v.to("cuda:0") for k, v in make_batch(n=3, spatial=(96, 96, 96), seed=s).items()} for s in range(8)]
    want = reference_batches(
        Compose(chain()).set_random_state(7), [{k: v.clone() for k, v in b.items()} for b in batches]
    )
    tail = BatchedTail(Compose(chain())).set_random_state(7)
    fired = []
    for b, w in zip(batches, want):
        got = tail(b)
        fired.append(sum(not torch.equal(got["image"][i], b["image"][i].float()) for i in range(3)))
        assert_same(got, w, keys=("image", "label"))
    assert tail.fallbacks == []
    assert 1 in fired  # a batch with one item resampled among others: the case a stacked product does not cover
