"""Batched random intensity transforms: per-item factors/offsets/noise gathered into one tensor op.

The arithmetic matches MONAI's per-item one (a python float applied to a float32 tensor is rounded to
float32 first, as torch does), so the results are equal bit for bit on the same device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable
from typing import Any

from loaders.tail.ahead import ahead
from loaders.tail.device import to_device
from loaders.tail.tailbatch import TailBatch, gather, keys_of


def _ready(t: Any, batch: TailBatch) -> list[Hashable] | None:
    keys = keys_of(t, batch)
    return keys if all(batch.is_batched(k) for k in keys) else None


def _per_channel(values: list[Any], x: Any, neutral: float) -> Any:
    """Per-item scalars (or per-channel lists; None = not drawn) as an (n, C|1, 1, ...) tensor for `x`."""
    import torch

    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    rows = [[neutral] if v is None else (list(v) if isinstance(v, (list, tuple)) else [v]) for v in values]
    width = max(len(r) for r in rows)
    table = torch.tensor([r * width if len(r) == 1 else r for r in rows], dtype=dtype)
    return to_device(table, x.device).view(len(rows), width, *([1] * (x.ndim - 2)))


def _apply(op: Any, x: Any, values: list[Any], neutral: float) -> Any:
    """op(x, per-item scalars) over the batch. Half types go item by item with python scalars, as MONAI
    computes them: how torch rounds a scalar for a half tensor depends on the op and the device (add rounds
    it to half on the CPU, mul keeps it in float32), and a tensor operand is rounded otherwise."""
    import torch

    if x.dtype in (torch.float16, torch.bfloat16):  # per-channel values: channel by channel, as MONAI's loop
        return torch.stack([x[i] if v is None else _scalar_op(op, x[i], v) for i, v in enumerate(values)])
    return op(x, _per_channel(values, x, neutral))


def _scalar_op(op: Any, item: Any, value: Any) -> Any:
    """op(item, value) with python scalars: one for the item, or one per channel."""
    import torch

    if isinstance(value, (list, tuple)):
        return torch.stack([op(channel, v) for channel, v in zip(item, value)])
    return op(item, value)


def draws(t: Any, inner: Any, attr: str, images: list[Any]) -> list[Any]:
    """Each item's draw of the dict transform (prob) and then of its inner array transform, as MONAI does (an
    item with no image to act on draws the prob only)."""
    drawn: list[Any] = []
    for img in images:
        t.randomize(None)
        if not t._do_transform or img is None:
            drawn.append(None)
            continue
        inner.randomize(img)
        drawn.append(getattr(inner, attr))
    return drawn


def _draw(t: Any, batch: TailBatch, keys: list[Hashable], inner: Any, attr: str) -> list[Any]:
    first = keys[0] if keys else None
    return draws(t, inner, attr, [None if first is None else batch.data[first][i] for i in range(batch.n)])


def _noise_draws(t: Any, inner: Any, n: int, like: Any) -> list[Any]:
    return draws(t, inner, "noise", [like] * n)


def _noise_bytes(t: Any) -> Any:
    """A batch's expected noise bytes: float64 numbers for an item's every element, on the items it fires on
    (the transform's prob taken now: the draw-ahead holds no reference to the transform, its registry's key)."""
    prob = min(1.0, max(float(t.prob), 0.0))

    def expected(key: tuple[int, tuple[int, ...]]) -> float:
        n, shape = key
        return float(n * 8 * math.prod(shape) * prob)

    return expected


def _out_dtype(x: Any, dtype: Any) -> Any:
    """The dtype MONAI gives a transformed item."""
    import torch
    from monai.utils import get_equivalent_dtype

    return x.dtype if dtype is None else get_equivalent_dtype(dtype, torch.Tensor)


def _mixes_dtypes(t: Any, batch: TailBatch, keys: list[Hashable], dtype: Any) -> bool:
    """Whether items could leave in two dtypes (prob < 1 and a dtype change): MONAI keeps a skipped item's
    dtype and the next transform computes in it, which one batch tensor cannot hold, so it runs per item."""
    return t.prob < 1 and any(_out_dtype(batch.data[k], dtype) != batch.data[k].dtype for k in keys)


def rand_scale_intensity(t: Any, batch: TailBatch) -> bool:
    """RandScaleIntensityd: v * (1 + factor), one multiply for the batch."""
    import torch

    keys = _ready(t, batch)
    if keys is None or _mixes_dtypes(t, batch, keys, t.scaler.dtype):
        return False
    drawn = _draw(t, batch, keys, t.scaler, "factor")
    if all(d is None for d in drawn):
        return True
    one_plus = [None if d is None else [1 + f for f in d] if isinstance(d, list) else 1 + d for d in drawn]
    for k in keys:
        x = batch.data[k]
        out = _apply(operator.mul, x, one_plus, 1.0).to(torch.result_type(x, 1.0))  # as x * a python float
        batch.data[k] = out.to(_out_dtype(x, t.scaler.dtype))
    return True


def rand_shift_intensity(t: Any, batch: TailBatch) -> bool:
    """RandShiftIntensityd: v + offset, one add for the batch (offsets scaled by a meta factor run per item)."""
    keys = _ready(t, batch)
    if keys is None or any(_meta_key(t, k) in batch.data for k in keys):
        return False
    if t.shifter._shifter.safe and any(not batch.data[k].is_floating_point() for k in keys):
        return False
    drawn = _draw(t, batch, keys, t.shifter, "_offset")
    if all(d is None for d in drawn):
        return True
    for k in keys:
        x = batch.data[k]
        batch.data[k] = _apply(operator.add, x, drawn, 0.0).to(x.dtype)
    return True


def _meta_key(t: Any, key: Hashable) -> Any:
    i = list(t.keys).index(key)
    meta_key = t.meta_keys[i] if t.meta_keys is not None else None
    return meta_key or f"{key}_{t.meta_key_postfix[i]}"


def rand_gaussian_noise(t: Any, batch: TailBatch) -> bool:
    """RandGaussianNoised: MONAI's own numpy noise per item (the draws must match), added in one op."""
    import numpy as np
    import torch

    keys = _ready(t, batch)
    if keys is None or _mixes_dtypes(t, batch, keys, t.rand_gaussian_noise.dtype):
        return False
    inner = t.rand_gaussian_noise
    early = ahead(t, inner, "noise", _noise_draws, _noise_bytes(t)) if keys else None
    if early is None:
        drawn = _draw(t, batch, keys, inner, "noise")
    else:  # the noise is drawn on a thread while the batch before this one is still in the tail
        drawn = early.take(batch.n, tuple(batch.data[keys[0]].shape[1:]))
    chosen = [i for i, d in enumerate(drawn) if d is not None]
    if not chosen:
        return True
    noise = torch.from_numpy(np.stack([np.asarray(drawn[i]) for i in chosen]))
    for k in keys:
        x = batch.data[k]
        dtype = _out_dtype(x, t.rand_gaussian_noise.dtype)
        add = to_device(noise, x.device).to(dtype)
        if len(chosen) == batch.n:
            batch.data[k] = x.to(dtype) + add
            continue
        where = {i: j for j, i in enumerate(chosen)}
        noisy = gather(x, [x[i] for i in chosen]).to(dtype) + add
        batch.data[k] = gather(x, [noisy[where[i]] if i in where else x[i].to(dtype) for i in range(batch.n)])
    return True


def normalize_intensity(t: Any, batch: TailBatch) -> bool:
    """NormalizeIntensityd (deterministic; in the BraTS tutorial's tail): per-item (per-channel) mean and
    std over all or the nonzero voxels, in float32 as MONAI computes them, one subtract/divide for the batch.
    Equal to MONAI's within float rounding (the sums run in another order); given subtrahend/divisor run per item.
    """
    import torch
    from monai.utils import get_equivalent_dtype

    keys = _ready(t, batch)
    norm = t.normalizer
    if keys is None or norm.subtrahend is not None or norm.divisor is not None:
        return False
    for k in keys:
        x = batch.data[k]
        n, c = int(x.shape[0]), int(x.shape[1])
        flat = x.to(torch.float32).reshape(n, c if norm.channel_wise else 1, -1)
        if norm.nonzero:
            mask = flat != 0
            count = mask.sum(-1, keepdim=True).clamp(min=1)
            mean = flat.sum(-1, keepdim=True) / count  # zeros add nothing to the sum
            var = torch.where(mask, (flat - mean) ** 2, 0.0).sum(-1, keepdim=True) / count
        else:
            mean = flat.mean(-1, keepdim=True)
            var = flat.var(-1, keepdim=True, correction=0)
        std = var.sqrt()
        std = torch.where(std == 0, torch.ones_like(std), std)
        out = (flat - mean) / std
        if norm.nonzero:  # MONAI writes only the nonzero voxels; the others stay 0
            out = torch.where(mask, out, flat)
        dtype = get_equivalent_dtype(norm.dtype, torch.Tensor) if norm.dtype is not None else x.dtype
        batch.data[k] = out.reshape(x.shape).to(dtype)
    return True


def scale_intensity(t: Any, batch: TailBatch) -> bool:
    """ScaleIntensityd (deterministic): each item (or each of its channels, `channel_wise`) rescaled by its own min
    and max into [minv, maxv], the same operations as MONAI's `rescale_array` with each item's min and max
    broadcast, so the numbers are MONAI's; with `factor` (minv and maxv None) one multiply for the batch."""
    import torch
    from monai.utils import convert_data_type, convert_to_dst_type

    keys = _ready(t, batch)
    s = t.scaler
    if keys is None:
        return False
    for k in keys:
        x = batch.data[k]
        if s.minv is None and s.maxv is None:
            out = x * (1 + s.factor) if s.factor is not None else x
        else:
            arr = convert_data_type(x, dtype=s.dtype)[0] if s.dtype is not None else x
            dims = tuple(range(2 if s.channel_wise else 1, arr.ndim))
            mina, maxa = arr.amin(dim=dims, keepdim=True), arr.amax(dim=dims, keepdim=True)
            norm = (arr - mina) / (maxa - mina)
            if s.minv is not None and s.maxv is not None:
                norm = (norm * (s.maxv - s.minv)) + s.minv
            flat = arr * s.minv if s.minv is not None else arr  # an item whose min is its max
            out = torch.where(mina == maxa, flat, norm)
        batch.data[k] = convert_to_dst_type(out, dst=x, dtype=s.dtype or x.dtype)[0]
    return True
