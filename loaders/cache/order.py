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

An epoch's order is cut into batches by `epoch_batches` (every reader: `batch_size` positions each, the short
last one dropped with `drop_last`, the first `start` left out where a stopped run delivered them). DALI's
sources split their samples by `dali_shard` (contiguous blocks, as DALI's own readers split with
`shard_id`/`num_shards`) and order each block with `epoch_order`.

Epochs advance by one rule: a pass is the epoch last given to `set_epoch` (or `epoch=`), and a reader that
counts passes itself moves on by one after each (`PreparedLoader`: 0, 1, 2, ... or e, e + 1, ... after
`set_epoch(e)`; the DALI sources: one epoch per `iter()`). `PreparedBatches` and `PreparedDataset.shard`
change epoch only by `set_epoch`, as `DistributedSampler` does.
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


def epoch_batches(order: np.ndarray, batch_size: int, drop_last: bool, start: int = 0) -> list[np.ndarray]:
    """`order` cut into batches of `batch_size` positions (the last one shorter, or dropped with
    `drop_last`), without the first `start` batches (those a stopped run already delivered)."""
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if drop_last and chunks and len(chunks[-1]) < batch_size:
        chunks.pop()
    return chunks[start:]


def dali_shard(n: int, shard_id: int, num_shards: int) -> np.ndarray:
    """Positions of samples `0..n-1` that DALI shard `shard_id` of `num_shards` holds: one contiguous block,
    as DALI's readers split with `shard_id`/`num_shards` (each epoch then orders the block with
    `epoch_order`)."""
    return np.arange(n * shard_id // num_shards, n * (shard_id + 1) // num_shards, dtype=np.int64)
