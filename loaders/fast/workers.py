"""A `PreparedLoader`'s batches made whole by worker processes (`PreparedLoader(..., workers=W)`).

Where the training process's interpreter is what the steps wait for (a tail MONAI runs item by item, or a tail of
many small launches on small crops: docs/benchmarks.md), W worker processes make the batches on the CPU. Each
reads its batch's crops from the prepared cache (the page cache, or the disk where cold), runs the tail over the
batch (batched where a batched version exists, else MONAI item by item) and hands the batch back in shared memory;
torch's pin-memory thread pins it and the training process only copies it to the device. The workers are torch
`DataLoader` workers, forked once and kept for every epoch; they never touch CUDA.

Their results are MONAI's under `DataLoader(dataset, num_workers=W, persistent_workers=True)` over the same
batches: as MONAI's `worker_init_fn` seeds a dataset's chain in each worker (`set_rnd`: the chain's
`set_random_state(base_seed + worker_id)`), each worker seeds its copy of the chain, and batch k of an epoch is
made by the worker torch's `DataLoader` hands it to (k mod W from each epoch's first batch). The base seed is
drawn as torch's `DataLoader` draws it: from torch's global generator when the workers start (after
`torch.manual_seed(s)`, the same as a `DataLoader` built there), or from `torch.Generator().manual_seed(s)` after
`loader.set_random_state(s)`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from loaders.errors import ArgumentValueError
from loaders.reading.staging import values_to


class BatchKeys:
    """The pool's sampler: one key per batch of the epoch being iterated, (k, its items)."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, tuple[int, ...]]] = []

    def __iter__(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


class BatchMaker:
    """The workers' dataset: key (k, items) -> batch k, made by a CPU `PreparedLoader` built in the worker from
    the parent's arguments (no tier, no feeder, the tail on the worker's one thread)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._loader: Any = None

    def _built(self) -> Any:
        if self._loader is None:
            from loaders.fast.loader import PreparedLoader

            self._loader = PreparedLoader(**self.spec)
        return self._loader

    def seed(self, seed: int) -> None:
        """The chain seeded as MONAI's `set_rnd` seeds a dataset's transform in a `DataLoader` worker."""
        self._built().set_random_state(seed)

    def __getitem__(self, key: tuple[int, tuple[int, ...]]) -> dict[str, Any]:
        k, items = key
        assembly = self._built().assembly
        return assembly.finish(assembly.fetch(assembly.plan(list(items))))  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._built().cache)


def _seed_worker(worker_id: int) -> None:
    from monai.utils import MAX_SEED
    from torch.utils.data import get_worker_info

    info: Any = get_worker_info()
    info.dataset.seed(int(info.seed) % MAX_SEED)  # as monai.data.utils.worker_init_fn -> set_rnd


def _as_is(batch: Any) -> Any:
    return batch


class WorkerPool:
    """W forked workers making a loader's batches (module doc); `run(chunks, skip)` yields one epoch's batches on
    `device`."""

    def __init__(self, spec: dict[str, Any], workers: int, prefetch: int, device: Any) -> None:
        self.spec, self.workers, self.prefetch, self.device = spec, workers, max(1, prefetch), device
        self.keys = BatchKeys()
        self.seed: int | None = None  # set_random_state(s): the base seed from torch.Generator().manual_seed(s)
        self._pool: Any = None

    def _started(self) -> Any:
        if self._pool is None:
            import torch
            from torch.utils.data import DataLoader

            generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
            context = "fork" if sys.platform.startswith("linux") else None
            maker: Any = BatchMaker(self.spec)
            self._pool = DataLoader(maker, batch_size=None, sampler=self.keys, num_workers=self.workers,
                                    collate_fn=_as_is, pin_memory=self.device.type == "cuda", persistent_workers=True,
                                    prefetch_factor=self.prefetch, worker_init_fn=_seed_worker, generator=generator,
                                    multiprocessing_context=context)  # fmt: skip
        return self._pool

    def set_random_state(self, seed: int) -> None:
        if self._pool is not None:
            raise ArgumentValueError(
                "PreparedLoader(workers=...).set_random_state: the workers are seeded once, when they start (as "
                "MONAI's DataLoader workers are); call it before the first epoch"
            )
        self.seed = seed

    def run(self, chunks: list[Any], skip: int) -> Iterator[dict[str, Any]]:
        self.keys.keys = [(k, tuple(int(i) for i in chunks[k])) for k in range(skip, len(chunks))]
        pool = self._started()
        gpu = self.device.type == "cuda"
        for batch in pool:  # pinned by torch's pin-memory thread: the copies below are asynchronous
            yield values_to(batch, self.device) if gpu else batch

    def close(self) -> None:
        pool, self._pool = self._pool, None
        iterator = getattr(pool, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def worker_spec(given: dict[str, Any], cache_root: str) -> dict[str, Any]:
    """The workers' `PreparedLoader` arguments: the parent's, on the CPU, without a tier, a feeder or threads."""
    names = ("transform", "batch_size", "shuffle", "seed", "drop_last", "crop_read", "backend",
             "backend_options", "keys", "verify", "copy_threads")  # fmt: skip
    spec = {name: given[name] for name in names}
    spec.update(cache_dir=cache_root, device="cpu", gpu_budget=0, feeder=False, tail_thread=False, prefetch=1,
                workers=0, torch_threads=None)  # fmt: skip
    return spec
