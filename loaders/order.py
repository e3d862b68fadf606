"""The one epoch order: which items a rank reads in an epoch, and in what order.

Every reader of a prepared cache (`PreparedDataset.shard`, `iter_batches`/`PreparedBatches`, `PreparedLoader`,
the DALI `CacheSource`) orders its epochs with `epoch_order`, so the same `(seed, epoch, rank, world)` gives the
same items everywhere. The rule is torch's `DistributedSampler`, so a run that swaps a `DataLoader` +
`DistributedSampler` for a blockprep loader sees the same split of items across ranks:

- shuffled: `torch.randperm(n)` from a `torch.Generator` seeded with `seed + epoch` (identical on every rank);
- `drop_last=False`: padded by repeating from the start until every rank has `ceil(n / world)` items;
  `drop_last=True`: cut to `floor(n / world)` items per rank;
- rank `r` takes positions `r, r + world, r + 2 * world, ...`.

`pad=False` (PreparedDataset.shard(even=False)) neither pads nor cuts: ranks may get one item fewer.
"""

from __future__ import annotations

import numpy as np


def epoch_order(
    n: int,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
    *,
    pad: bool = True,
    contiguous: bool = False,
) -> np.ndarray:
    """Positions `0..n-1` that rank `rank` of `world` reads in `epoch`, as `DistributedSampler` gives them.

    contiguous=True hands each rank one block of the (shuffled, padded) order instead of every world-th
    position. Returns an int64 array."""
    for name, value in (("n", n), ("seed", seed), ("epoch", epoch), ("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"epoch_order: {name} must be an integer, not {value!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world} (0 <= rank < world)")
    if n < 0:
        raise ValueError(f"epoch_order: n must be >= 0, not {n}")
    order = _permutation(int(n), int(seed) + int(epoch)) if shuffle else np.arange(n, dtype=np.int64)
    if drop_last and n % world:
        per = (n - world) // world + 1 if n >= world else 0  # math.ceil((n - world) / world), as the sampler
        order = order[: per * world]
    elif pad and n:
        per = -(-n // world)
        order = np.resize(order, per * world)  # np.resize repeats from the start, as the sampler pads
    if contiguous:
        per = -(-len(order) // world)
        return np.ascontiguousarray(order[rank * per : (rank + 1) * per], dtype=np.int64)
    return np.ascontiguousarray(order[rank::world], dtype=np.int64)


def _permutation(n: int, seed: int) -> np.ndarray:
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator).numpy().astype(np.int64, copy=False)
