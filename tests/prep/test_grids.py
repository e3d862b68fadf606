"""prep.grids: an image and its label resampled by MONAI share one sampling grid, with MONAI's own values."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.transforms import Spacingd

from prep import grids
from prep.grids import shared_grids


def _pair(seed: int = 0) -> dict[str, MetaTensor]:
    rng = np.random.default_rng(seed)
    affine = torch.diag(torch.tensor([1.5, 0.8, 1.0, 1.0], dtype=torch.float64))
    image = MetaTensor(torch.from_numpy(rng.random((1, 40, 36, 33), dtype=np.float32)), affine=affine)
    label = MetaTensor(torch.from_numpy((rng.random((1, 40, 36, 33)) > 0.7).astype(np.float32)), affine=affine)
    return {"image": image, "label": label}


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls that reach torch's own affine_grid under the sharing wrapper."""
    with shared_grids():
        pass  # installs the wrapper
    calls: list[int] = []
    own = F.affine_grid.__wrapped__  # type: ignore[attr-defined]

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return own(*args)

    monkeypatch.setattr(F, "affine_grid", grids._shared(counted))
    return calls


def test_spacingd_of_image_and_label_equals_monai_with_one_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    spacing = Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest"))
    expected = spacing(_pair())
    calls = _counting(monkeypatch)
    with shared_grids():
        got = spacing(_pair())
    assert len(calls) == 1  # the label's resampling reused the image's grid
    for key in ("image", "label"):
        assert torch.equal(got[key].as_tensor(), expected[key].as_tensor()), key
        assert torch.equal(got[key].affine, expected[key].affine), key
    calls.clear()
    spacing(_pair())  # outside the block: torch's own function for each key
    assert len(calls) == 2


def test_a_grid_changed_in_place_is_made_again() -> None:
    theta = torch.tensor([[[1.0, 0.1, 0.0, 0.0], [0.0, 0.9, 0.0, 0.1], [0.0, 0.0, 1.1, 0.0]]])
    size = [1, 1, 40, 40, 40]
    fresh = F.affine_grid(theta, size, align_corners=False)
    with shared_grids():
        first = F.affine_grid(theta, size, align_corners=False)
        assert F.affine_grid(theta.clone(), size, align_corners=False) is first  # equal values: shared
        assert F.affine_grid(theta, size, align_corners=True) is not first  # other arguments: its own
        again = F.affine_grid(theta, size, align_corners=False)
        again.mul_(2.0)
        after = F.affine_grid(theta, size, align_corners=False)
    assert after is not again
    assert torch.equal(after, fresh)


def test_other_threads_and_autograd_get_their_own_grids() -> None:
    theta = torch.eye(3, 4).unsqueeze(0)
    size = [1, 1, 40, 40, 40]
    seen: list[torch.Tensor] = []
    with shared_grids():
        first = F.affine_grid(theta, size, align_corners=False)
        thread = threading.Thread(target=lambda: seen.append(F.affine_grid(theta, size, align_corners=False)))
        thread.start()
        thread.join()
        graded = theta.clone().requires_grad_(True)
        assert F.affine_grid(graded, size, align_corners=False) is not first
        assert F.affine_grid(graded, size, align_corners=False).requires_grad
    assert seen[0] is not first and torch.equal(seen[0], first)
