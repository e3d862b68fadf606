"""RandAffined's grids described in a draw (`Products`) against MONAI's own `AffineGrid`, on the host and on a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from loaders.tail.products import Products  # noqa: E402

SIZE = (12, 9, 7)


def _matrices(m: int, seed: int) -> np.ndarray:
    """m matrices as RandAffined draws them: MONAI's own, from its random parameters."""
    grid = mt.RandAffineGrid(rotate_range=(math.pi / 6,) * 3, scale_range=0.2, translate_range=(3, 2, 1))
    grid.set_random_state(seed)
    mats = []
    for _ in range(m):
        grid(SIZE, randomize=True, lazy=True)
        mats.append(torch.as_tensor(grid.get_transformation_matrix()).to(torch.float32).numpy())
    return np.stack(mats)


def _monai(matrix: np.ndarray) -> np.ndarray:
    """MONAI's grid for one matrix on the host, its first three rows flat."""
    grid, _ = mt.AffineGrid(affine=torch.from_numpy(matrix), device=torch.device("cpu"))(SIZE)
    return np.asarray(grid).reshape(4, -1)[:3]


@pytest.mark.parametrize("m", [1, 3])
def test_products_are_monais_affine_grids(m: int) -> None:
    mats = _matrices(m, seed=m)
    mats[-1] = 0  # an item the transform did not fire on: a row of zeros
    p = Products(mats, SIZE)
    host = np.asarray(p)
    assert host.shape == p.shape == (m, 3, math.prod(SIZE)) and host.dtype == p.dtype == np.float32
    for i in range(m - 1):
        assert np.array_equal(host[i], _monai(mats[i]))
    assert not host[-1].any()
    assert np.array_equal(p.on("cpu").numpy(), host)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_products_made_on_the_gpu_are_the_hosts(m: int) -> None:
    """Made on the device where a product there was shown to give the host's numbers, else copied up: the host's
    bit for bit either way."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    p = Products(_matrices(m, seed=10 + m), SIZE)
    got = p.on("cuda:0")
    assert got.device.type == "cuda"
    assert np.array_equal(got.cpu().numpy(), np.asarray(p))
