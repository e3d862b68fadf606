"""The training benchmark's `--ddp` row: the fast path on every rank of a `torchrun` job.

    torchrun --standalone --nproc-per-node 2 -m workflows.benchmark train --ddp --device cuda

Rank 0 first makes the data and measures the fast path on its GPU alone (the others wait); then every rank
trains a DistributedDataParallel UNet on its shard (`PreparedLoader.shard(rank, world)`, `set_epoch(e)`),
reading straight into its own GPU. Each of the two comes with its compute ceiling (the same training on one
batch kept on the GPU: one GPU alone, then every rank's DDP model), so what DDP itself costs a step (its gradient
exchange, its hooks on a step bound by launching kernels) is told apart from the loader. Printed and written by
rank 0: steps/s of one GPU, steps/s of the job (each step takes `world` batches), their ratio, the ceilings'
ratio, and whether every item was seen once per epoch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from workflows.bench.core import Rows
from workflows.bench.train_loop import TrainOptions, TrainRow, as_result, build_data, time_loop, transform_of
from workflows.bench.train_rows import ceiling
from workflows.bench.workloads import WORKLOADS


def _device(opts: TrainOptions, local_rank: int) -> str:
    return f"cuda:{local_rank}" if opts.gpu else "cpu"


def _loader(cache: Path, pipeline: Path, opts: TrainOptions, device: str) -> Any:
    from loaders.fast.loader import PreparedLoader

    loader = PreparedLoader(cache, transform_of(pipeline, opts.seed), opts.batch, device=device,
                            gpu_budget=opts.gpu_budget or 0, seed=opts.seed, drop_last=False)  # fmt: skip
    return loader


def main_ddp(opts: TrainOptions) -> Rows:
    """One rank of the DDP row (RANK, WORLD_SIZE, LOCAL_RANK from torchrun): rank 0 returns the rows; the
    other ranks exit 0 when done (only rank 0 prints and writes)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = _device(opts, local)
    if opts.gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if opts.gpu else "gloo")
    try:
        work = opts.out / "work"
        if rank == 0:
            build_data(opts, work)
        dist.barrier()
        _, pipeline, cache = build_data(opts, work)  # present now: only looked up
        rows: list[tuple[TrainRow, str]] = []  # (row, its data: the one-GPU pair or the DDP pair)
        if rank == 0:
            loader = _loader(cache, pipeline, opts, device)
            loader.set_random_state(opts.seed)
            rows.append((ceiling(opts, len(loader), device, name="compute only, 1 GPU"), "1 GPU"))
            rows.append((time_loop("blockprep PreparedLoader, 1 GPU", "ours", _epochs(loader, None), opts, device),
                         "1 GPU"))  # fmt: skip
            loader.close()
        dist.barrier()
        loader = _loader(cache, pipeline, opts, device).shard(rank, world)
        loader.set_random_state(opts.seed + rank)  # each rank its own draws
        top = ceiling(opts, len(loader), device, ddp=True, name=f"compute only, DDP x{world}")
        seen: list[list[int]] = []
        row = time_loop(f"blockprep PreparedLoader, DDP x{world}", "ours", _epochs(loader, seen), opts, device,
                        ddp=True)  # fmt: skip
        loader.close()
        once = _every_item_once(seen, world, len(loader.items), WORKLOADS[opts.workload].samples)
        dist.barrier()  # every rank done with the group before any tears it down (gloo aborted a late rank)
        if rank == 0:
            return _reported(opts, rows, top, row, world, once)
    finally:
        dist.destroy_process_group()
    # ranks > 0: rank 0 reports. They leave without the interpreter's teardown: one CI run in several saw a rank
    # whose work was done abort there ("terminate called without an active exception", a C++ thread still
    # joinable as torch's statics went), failing the whole torchrun
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _reported(opts: TrainOptions, rows: list[tuple[TrainRow, str]], top: TrainRow, row: TrainRow, world: int,
              once: bool) -> Rows:  # fmt: skip
    """Rank 0's table (the DDP rows' steps counted as single-GPU steps: a DDP step trains `world` batches) and
    ddp.json."""
    top.steps *= world
    row.steps *= world
    x_one = row.steps_per_s / rows[1][0].steps_per_s
    x_top = top.steps_per_s / rows[0][0].steps_per_s
    row.note = f"{world} ranks, every item once per epoch and a new split each epoch: {once}"
    row.extra.update(world=world, x_one_gpu=x_one, ceilings_x_one_gpu=x_top)
    rows += [(top, f"DDP x{world}"), (row, f"DDP x{world}")]
    (opts.out / "ddp.json").parent.mkdir(parents=True, exist_ok=True)
    (opts.out / "ddp.json").write_text(
        json.dumps({"every_item_once": once, "world": world, "x_one_gpu": x_one, "ceilings_x_one_gpu": x_top})
    )
    out = Rows(title=f"training, DDP over {world} ranks: items/s = single-GPU steps/s; each pair against its ceiling")
    for r, data in rows:
        out.add(r.name, lambda r=r, data=data: as_result(r, data))  # type: ignore[misc]
    return out


def _epochs(loader: Any, seen: list[list[int]] | None) -> Any:
    def epochs(epoch: int) -> Any:
        loader.set_epoch(epoch)
        items: list[int] = []
        if seen is not None:
            seen.append(items)
        for batch in loader:
            items.extend(int(i) for i in batch["_items"])
            yield batch

    return epochs


def _every_item_once(seen: list[list[int]], world: int, n: int, samples: int = 1) -> bool:
    """All ranks' items of each epoch together cover every item (padding repeats at most world - 1), each item
    `samples` times (a crop with num_samples outputs repeats its item's number)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, seen)
    splits = []
    for epoch in range(len(seen)):
        items = [i for rank_seen in gathered for i in rank_seen[epoch]]
        if set(items) != set(range(n)) or len(items) - n * samples >= world * samples:
            return False
        splits.append(sorted(gathered[0][epoch]))
    return len(splits) < 2 or any(s != splits[0] for s in splits[1:])  # a different split every epoch
