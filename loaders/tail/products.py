"""RandAffined's grids before they are normalised: each item's matrix times MONAI's identity grid, as its
`AffineGrid` makes them on the host (`affine @ grid_.view(...)`, an item at a time, float32).

Made on the host, one product of a 96^3 crop is 14 MB written and about 12 ms of a core: a `seg-aug` batch's were a
quarter of a feeder's main thread. A draw therefore carries them described (`Products`: the matrices alone), and
where the work runs they are made: on a CUDA device at once where a product of that many matrices there was found
to give the host's numbers bit for bit (`same_products`, checked once a process for each size, device and count;
on an H200 two or more did and one did not, 7.6e-6 off), else on the host as MONAI makes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_IDENTITY: dict[tuple[tuple[int, ...], str], Any] = {}  # MONAI's identity grid by size and device, made once
_SAME_ON_DEVICE: dict[tuple[tuple[int, ...], str, int], bool] = {}


def identity(sp_size: tuple[int, ...], where: Any, keep: bool = False) -> Any:
    """MONAI's identity grid (`create_grid`) made at `where`: kept on the host; on a device made anew (there it may
    be made inside a capture, from the graph's own memory) unless `keep` (asked outside any capture)."""
    import torch
    from monai.transforms.utils import create_grid

    key = (tuple(sp_size), str(where))
    if torch.device(where).type != "cpu" and not keep:
        return create_grid(sp_size, device=where, backend="torch")
    if key not in _IDENTITY:
        if len(_IDENTITY) > 4:
            _IDENTITY.clear()
        _IDENTITY[key] = create_grid(sp_size, device=where, backend="torch")
    return _IDENTITY[key]


def flat(grid: Any) -> Any:
    """An identity grid as MONAI multiplies it: float32, (nd + 1, V)."""
    import torch

    g = torch.as_tensor(grid).to(dtype=torch.float32)
    return g.view((g.shape[0], -1))


def shown(sp_size: tuple[int, ...], device: Any, m: int) -> bool | None:
    """`same_products`' answer where it has been checked in this process, else None."""
    import torch

    return _SAME_ON_DEVICE.get((tuple(sp_size), str(torch.device(device)), m))


def same_products(host_grid: Any, sp_size: tuple[int, ...], device: Any, m: int) -> bool:
    """Whether m matrices (turns, scales and shifts as RandAffined draws them) times the identity grid, at once on
    `device`, equal each one's product with `host_grid` on the host bit for bit (checked once for each size, device
    and count)."""
    import torch

    key = (tuple(sp_size), str(torch.device(device)), m)
    if key not in _SAME_ON_DEVICE:
        nd = len(sp_size)
        g = torch.Generator().manual_seed(m)
        mats = torch.eye(nd + 1).repeat(m, 1, 1)
        mats[:, :nd, :nd] += 0.2 * (torch.rand((m, nd, nd), generator=g) - 0.5)
        mats[:, :nd, nd] = 10 * (torch.rand((m, nd), generator=g) - 0.5)
        host = torch.stack([a @ flat(host_grid) for a in mats])
        there = flat(identity(sp_size, torch.device(device)))
        _SAME_ON_DEVICE[key] = torch.equal(torch.matmul(mats.to(device), there).cpu(), host)
    return _SAME_ON_DEVICE[key]


def at_once(mats: Any, grid: Any) -> Any:
    """(m, nd + 1, V): the matrices times the flat identity grid by one product on its device (two or more at once:
    a lone matrix is padded with the identity, as the product of one was not the host's)."""
    import torch

    n, side = mats.shape[0], mats.shape[-1]
    padded = mats if n > 1 else torch.cat([mats, torch.eye(side, dtype=mats.dtype, device=mats.device)[None]])
    return torch.matmul(padded, grid)[:n]


@dataclass(eq=False)
class Products:
    """The first nd rows of each matrix times MONAI's identity grid of `size` (m, nd, V), float32, not yet made: a
    zero matrix (an item the transform did not fire on) gives a row of zeros. Read as an array, the host's
    (`np.asarray`); made on a device by `on(device)`."""

    mats: np.ndarray  # (m, nd + 1, nd + 1) float32
    size: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.mats.shape[0]), len(self.size), math.prod(self.size))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        import torch

        nd = len(self.size)
        grid = flat(identity(self.size, torch.device("cpu")))
        out = np.zeros(self.shape, dtype=np.float32)
        for i, m in enumerate(self.mats):
            if m.any():
                out[i] = (torch.from_numpy(np.ascontiguousarray(m)) @ grid)[:nd].numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def on(self, device: Any) -> Any:
        """The products on `device`: made there at once where shown equal to the host's, else the host's copied up
        (from page-locked memory, without the host waiting)."""
        import torch

        from loaders.tail.device import to_device

        device = torch.device(device)
        host_grid = identity(self.size, torch.device("cpu"))
        if device.type == "cuda" and same_products(host_grid, self.size, device, max(len(self.mats), 2)):
            mats = to_device(torch.from_numpy(np.ascontiguousarray(self.mats)), device)
            return at_once(mats, flat(identity(self.size, device, keep=True)))[:, : len(self.size)]
        return to_device(torch.from_numpy(np.asarray(self)), device)
