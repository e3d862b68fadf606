"""PreparedLoader: batches ready for the model, from a prepared cache and the user's full MONAI transform.

    >>> loader = PreparedLoader("cache/", transform, batch_size=4, device="cuda:0", gpu_budget="8GiB")  # doctest: +SKIP
    >>> for epoch in range(epochs):                                                                    # doctest: +SKIP
    ...     for batch in loader:
    ...         loss = loss_fn(model(batch["image"]), batch["label"])

The cache holds the head's output (`prep cache`); the loader runs the random tail. What it does so the GPU
never waits:
- a crop at the start of the tail (`loaders.fast.folds`) is folded into the read: its crop is drawn with the
  transform's own random state (MONAI's per-item draws) and only the crop's bytes are read, every region of
  a batch in one backend call (`read_regions`);
- the rest of the tail runs over the whole batch on the device (`loaders.tail.BatchedTail` where present,
  else MONAI per item);
- batch k+1 is read by a background thread, then uploaded (pinned staging), assembled and transformed by a
  second one on a side CUDA stream (while the first reads batch k+2) as the model computes on batch k; the
  training thread's `next()` is a queue get and a stream wait on the batch's CUDA event (`tail_thread=False`:
  the threads only read, the rest is launched by the training thread between steps);
- items are kept on the device, whole, up to `gpu_budget` bytes, filled lazily during the first epoch
  (a crop of a resident item is a slice, a fresh crop every epoch); items beyond the budget stream from
  the page cache or the disk;
- DDP: `shard(rank, world)` and `set_epoch(epoch)`, as `DistributedSampler`: a different split every
  epoch, every item once per epoch across ranks.

A batch goes order (`loaders.cache.order`) -> folds (`loaders.fast.folds`) -> Reader (`loaders.reading.reads`) ->
staging (`loaders.reading.staging`) -> tier (`loaders.fast.tier`) -> tail (`loaders.tail.tails`), one batch's
steps held by `loaders.fast.assembly.BatchAssembly`. This module holds the loader itself: its order, the read
thread and the hand-over of its batches, and the loader state (`state_dict`, `loaders.state`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args, state
from loaders.args import parse_bytes  # re-exported: loaders.fast.loader.parse_bytes
from loaders.backends import Backend, check_backend
from loaders.cache.format import PreparedCache
from loaders.cache.order import epoch_batches, epoch_order
from loaders.deps import require
from loaders.errors import ArgumentTypeError, ArgumentValueError
from loaders.fast.assembly import BatchAssembly
from loaders.fast.carry import NextEpoch
from loaders.fast.feeding import FeederSide
from loaders.fast.tier import DeviceTier, auto_budget, dataset_bytes  # dataset_bytes: re-exported
from loaders.fast.trial import FeederTrial
from loaders.reading.ahead import InOrder
from loaders.reading.reads import Reader
from loaders.tail.checks import raise_checks
from loaders.tail.device import tail_stream


class PreparedLoader(FeederSide):
    """Batches ready for the model from a prepared cache + the full MONAI transform (see module doc).

    cache_dir: a `prep cache` output made with this transform's head. transform: the full pipeline.
    batch_size, shuffle, seed, drop_last: as for a DataLoader (seed + epoch orders each epoch).
    device: "cuda:N" or "cpu" (default: "cuda:0" when torch sees a GPU, else "cpu").
    gpu_budget: bytes (or "8GiB") of whole items kept on the device; "auto" (the default): on a GPU, the
    whole dataset when it fits in half the device's free memory, else that half; on the CPU none.
    crop_read: read only a folded crop's bytes ("auto"/True) or whole items cropped on the device (False).
    prefetch: batches prepared ahead. backend, backend_options, keys, verify: as for PreparedDataset
    (verify checks whole reads only: checksums cover whole tensors).
    tail_thread: upload, assemble and run the tail in the read thread (side CUDA stream, handed over with
    an event); False: the training thread does it between steps; None (default): True, and False in a
    feeder's child process (its main thread has no training loop to share the GIL with). switch_interval: seconds for
    `sys.setswitchinterval` while an epoch is iterated (restored after; None leaves it): how long a thread
    waiting for the GIL waits before the holder is made to drop it. copy_threads: threads copying a warm
    crop out of the page cache (None: `read_regions`' default, min(backend threads, cores)). feeder: make
    the batches in a process of its own (`loaders.fast.feeder`: the loader's Python off the training process's
    interpreter lock; CUDA tensors handed over by IPC; needs a picklable transform and a backend by name);
    "auto" (the default): on a CUDA device when both hold, else in this process. torch_threads: on the CPU, a
    number of torch threads for the training thread while an epoch is iterated (restored after), the read
    thread's transforms then on one (torch's count is per thread); None (the default): torch's threads as they
    are, which trained fastest where measured (docs/loaders.md, "On the CPU"). workers: make the batches in this
    many forked worker processes on the CPU (`loaders.fast.workers`: reads, crop and the whole tail off the
    training process's interpreter, for a tail MONAI runs item by item; no tier, no feeder), each seeded as MONAI's
    `DataLoader(num_workers=workers, persistent_workers=True)` seeds its workers; 0 (the default): none.
    """

    def __init__(
        self,
        cache_dir: str | Path,
        transform: Any,
        batch_size: int,
        device: str | None = None,
        gpu_budget: int | str | None = "auto",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        crop_read: bool | str = "auto",
        prefetch: int = 2,
        backend: str | Backend = "auto",
        backend_options: dict[str, Any] | None = None,
        keys: Sequence[str] | None = None,
        verify: bool = False,
        tail_thread: bool | None = None,
        switch_interval: float | None = None,
        copy_threads: int | None = None,
        feeder: bool | str = "auto",
        torch_threads: int | None = None,
        workers: int = 0,
    ) -> None:
        self.torch = require("torch", "PreparedLoader")
        self.cache = PreparedCache(cache_dir)
        args.check_loader(locals())  # every argument, one line each (loaders/args.py)
        check_backend(backend)
        self.keys = list(keys) if keys is not None else list(self.cache.keys)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.device = self._choose_device(device)
        self.gpu = self.device.type == "cuda"
        self.budget = (
            auto_budget(self.device, self.cache.root, self.keys)
            if gpu_budget == "auto" and not workers
            else args.parse_bytes(gpu_budget if not workers else 0, "gpu_budget")
        )
        self.crop_read = crop_read
        self.prefetch = max(1, prefetch)
        self.verify = verify
        payload = self._feeder_payload(locals())  # the child's arguments, or None: batches made in this process
        self._feeder_auto, self._tail_default = isinstance(feeder, str), tail_thread is None
        if self._switches_track_meta(transform, tail_thread):  # the tail on the caller's thread, or the child's
            self._tail_default, tail_thread = False, False
        if tail_thread is None:  # the feeder's child has no training loop beside it: the tail on its main thread
            tail_thread = payload is None
        self.tail_thread, self.switch_interval, self.copy_threads = tail_thread, switch_interval, copy_threads
        self._one_thread, self._training_threads = self._threads(torch_threads)
        self._build(transform, keys, backend, backend_options)
        self.items = np.arange(len(self.cache), dtype=np.int64)
        self.rank, self.world = 0, 1
        self.epoch = 0
        self._side: Any = None  # the read thread's CUDA stream (tail_thread)
        # a feeder's child: each batch handed to this (on the tail thread, its work just queued), what it returns
        # is what the iteration gives (`loaders.fast.child.Ring.pack_ahead`)
        self.pack_ahead: Callable[[dict[str, Any], list[Any]], Any] | None = None
        self.capture_ahead = False  # a feeder's child: the next batch's capture opened as each batch is queued
        self._threads_kept: dict[str, Any] = {}  # "read", "feed": one thread each, kept from epoch to epoch
        self._feeder: Any = None
        self._carry: NextEpoch | None = None  # the next epoch begun ahead (loaders.fast.carry)
        self.made_here = 0  # batches this process made for a loader with a feeder (while its child started)
        self._trial: FeederTrial | None = None
        if payload is not None and self._feeder_auto:
            self._trial = FeederTrial(host=self._host_candidate())
        self._verdict: str | None = None
        if payload is not None:
            self._start_feeder(payload)
        self._workers = self._worker_pool(locals()) if workers else None

    def _choose_device(self, device: str | None) -> Any:
        """The torch device: the one asked for, or by default the first GPU (the CPU on a box without one)."""
        if device is None:
            device = "cuda:0" if self.torch.cuda.is_available() else "cpu"
        elif str(device).startswith("cuda") and not self.torch.cuda.is_available():
            raise ValueError(f"PreparedLoader: device={device!r} but this torch sees no CUDA GPU; pass device='cpu'")
        return self.torch.device(device)

    def _threads(self, given: int | None) -> tuple[bool, int | None]:
        """On the CPU: (whether the read thread keeps to one torch thread, the training thread's count during
        an epoch); (False, None) leaves torch's threads alone."""
        return (False, None) if self.gpu or given is None else (True, int(given))

    def _build(self, transform: Any, keys: Sequence[str] | None, backend: Any, backend_options: Any) -> None:
        """The batch's rooms: the reader, the device tier, the assembly (the chain split, the crop folded),
        the seeder and the delivered-batch cursor."""
        from loaders.fast import exact
        from loaders.state import keep_random_states

        self.reader = Reader(self.cache, self.keys, backend, str(self.device), verify=self.verify,
                             backend_options=backend_options, pooled=False, host_auto=True,
                             copy_threads=self.copy_threads)  # fmt: skip
        self.tier = DeviceTier(self.budget)  # whole items on the device (loaders.fast.tier)
        with keep_random_states(transform):  # the chain's split and the Composes built here would re-seed it
            assembly = BatchAssembly(transform, self.cache, keys, self.reader, self.tier, self.crop_read, self.prefetch)
        self.assembly = assembly
        self._seeder = exact.Seeder(transform)
        early = self.fold.transform if self.fold is not None else None
        self.cursor = state.Cursor(state.Draws(self._seeder.compose, early))  # as of the last batch delivered

    @staticmethod
    def _switches_track_meta(transform: Any, tail_thread: bool | None) -> bool:
        """Whether a transform of the chain sets MONAI's process-wide track_meta (MONAI before 1.6: see
        `chain.track_meta_switch`): its tail then runs on no thread beside the training loop's, whose own MONAI
        calls would give plain tensors meanwhile; tail_thread=True with it is refused, in one line."""
        from loaders.cache.chain import track_meta_switch
        from loaders.state import keep_random_states

        with keep_random_states(transform):  # flattening the chain builds a Compose, which re-seeds it
            name = track_meta_switch(transform)
        if name is not None and tail_thread:
            raise ArgumentValueError(
                f"PreparedLoader(tail_thread=True): {name} sets MONAI's process-wide track_meta while it runs, "
                "so on the loader's thread it would change what MONAI gives the training loop meanwhile; leave "
                "tail_thread unset (the tail then runs on the training loop's thread) or use MONAI 1.6 or later"
            )
        return name is not None

    def _worker_pool(self, given: dict[str, Any]) -> Any:
        """The worker processes that make the batches (`loaders.fast.workers`), started at the first epoch."""
        import weakref

        from loaders.fast.workers import WorkerPool, worker_spec

        pool = WorkerPool(worker_spec(given, str(self.cache.root)), given["workers"], self.prefetch, self.device)
        weakref.finalize(self, pool.close)
        return pool

    def __reduce__(self) -> Any:
        raise ArgumentTypeError(
            "a PreparedLoader cannot be pickled (it owns read threads, staging buffers and device memory); build "
            "one in each process from the cache path (after DDP spawn, in each rank)"
        )

    # --- order ---
    def shard(self, rank: int, world: int) -> PreparedLoader:
        """This loader as DDP rank `rank` of `world`: each epoch's shuffled order split across ranks."""
        args.shard(rank, world)
        self.drop_ahead()
        self.rank, self.world = rank, world
        return self

    def set_epoch(self, epoch: int) -> None:
        """Order the next pass as epoch `epoch` (`loaders.cache.order.epoch_order`: DistributedSampler's rule, seed +
        epoch). Each pass then moves on by one: without set_epoch the passes are epochs 0, 1, 2, ...; after
        set_epoch(5) they are 5, 6, 7, ... (calling set_epoch(e) before every pass, as with a
        DistributedSampler, gives exactly epoch e each time). After `load_state_dict`, set_epoch with the
        saved epoch keeps the saved place in it."""
        epoch = args.count("epoch", epoch, 0)
        if epoch != self.epoch:
            self.drop_ahead()
            self.cursor.resume = 0
        self.epoch = epoch

    def set_random_state(self, seed: int) -> PreparedLoader:
        """Seed the tail's random transforms as `transform.set_random_state(seed)` seeds them (the head draws
        nothing; a nested Compose seeds its members from its own draw, as in MONAI)."""
        self.drop_ahead()
        self._seeder.set_random_state(None if seed is None else args.seed(seed))
        if self._workers is not None:
            self._workers.set_random_state(args.seed(seed))
        return self

    # --- state (loaders.state) ---
    def _order(self) -> dict[str, Any]:
        return {"fingerprint": state.fingerprint(self.cache.manifest, self.cursor.draws.names()), "seed": self.seed,
                "shuffle": self.shuffle, "rank": self.rank, "world": self.world, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "n_items": len(self.items)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where training stands, as of the last batch delivered: the epoch, the batches of it delivered and
        the random state of every random transform (the folded crop's and the tail's), small JSON. A run
        resumed from it with `load_state_dict` gives exactly the batches the uninterrupted run gives next."""
        self._no_workers("state_dict")
        now = self.cursor.now(self.epoch)
        epoch, batch, snap = now.epoch, now.batch, now.snap
        if batch and batch >= len(self):  # the epoch was delivered whole: the next starts at its first batch
            epoch, batch = epoch + 1, 0
        draws = self.cursor.draws
        return {"format": "blockprep-loader-state", "version": state.VERSION, **self._order(), "epoch": epoch,
                "batch": batch, "transforms": draws.names(), "random": draws.encode(snap)}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on from a `state_dict()`: the next pass is the saved epoch from the batch after the last one
        delivered, with the random draws it had. Refused in one line (LoaderStateError) when the state
        belongs to another cache, transform, order or rank/world size, or while an epoch is being iterated."""
        self._no_workers("load_state_dict")
        if self.cursor.live is not None:
            raise state.LoaderStateError("load_state_dict: an epoch of this loader is being iterated; load first")
        state.check(saved, self._order())
        if saved["batch"] > len(self):
            raise state.LoaderStateError(f"load_state_dict: batch {saved['batch']} is past the epoch's {len(self)}")
        snap = self.cursor.draws.decode(saved.get("random"), "load_state_dict")
        self.drop_ahead()
        self.epoch = saved["epoch"]
        self.cursor.start_at(saved["batch"], snap)

    def _no_workers(self, what: str) -> None:
        if self._workers is not None:
            raise state.LoaderStateError(
                f"{what}: a PreparedLoader with workers does not save or resume a place within its workers' random "
                "streams (as MONAI's DataLoader workers do not); resume at an epoch with set_epoch, or use workers=0"
            )

    def epoch_items(self, epoch: int) -> np.ndarray:
        """Items this rank reads in `epoch` (`loaders.cache.order.epoch_order`): all ranks' lists together hold every
        item once, padded by wrapping so every rank steps equally, as DistributedSampler does."""
        at = epoch_order(len(self.items), self.seed, epoch, self.rank, self.world, self.shuffle)
        return self.items[at]

    def __len__(self) -> int:
        n = len(self.epoch_items(0))
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # --- iteration ---
    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.cache.check_current()  # per epoch: a rebuilt cache is refused, even where the tier holds it all
        epoch = self.epoch
        self.epoch = epoch + 1
        order = self.epoch_items(epoch)
        chunks = epoch_batches(order, self.batch_size, self.drop_last)
        skip, self.cursor.resume = self.cursor.resume, 0
        if self._workers is not None:
            return self._workers.run(chunks, skip)
        if self._feeder is None:
            return self._run(chunks, epoch, skip, self.tail_thread)
        if self._feeder_ready():
            self.drop_ahead()  # begun here while the child started: the child makes this epoch from its start
            self._tier_to_feeder()
            batches = self._feeder.run(self, epoch, skip, len(chunks))
        else:
            batches = self._until_fed(chunks, epoch, skip)
        return batches if self._trial is None else self._on_trial(batches, self._trial)

    def _run(
        self, chunks: list[np.ndarray], epoch: int, skip: int, tail_thread: bool
    ) -> Generator[dict[str, Any], None, None]:
        # one thread a stage, so the batches' draws stay in batch order: the reads, then (tail_thread) the tail,
        # which runs batch k's tail while batch k+1 is read (a cold epoch keeps its reads in flight meanwhile)
        # the next epoch's first batches follow this one's last on the same stages (`loaders.fast.carry`)
        carried = self._take_carry(epoch, skip, chunks, tail_thread)
        if carried is not None:
            reads, tails = carried.reads, carried.tails
        else:
            reads = InOrder(executor=self._thread("read"))
            tails = InOrder(executor=self._thread("feed")) if tail_thread else None
        ahead = tails if tails is not None else reads
        submitted = carried.submitted if carried is not None else skip
        nxt: NextEpoch | None = None

        def submit(of: list[np.ndarray], k: int) -> None:
            reads.submit(self._fetch, of[k], k)
            if tails is not None:
                tails.submit(self._finish_next, reads)

        interval, threads = sys.getswitchinterval(), self.torch.get_num_threads()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        if self._training_threads is not None:
            self.torch.set_num_threads(self._training_threads)
        self.cursor.begin(epoch, skip)
        whole = False
        try:
            for k in range(skip, len(chunks)):
                while submitted <= min(k + self.prefetch, len(chunks) - 1):
                    submit(chunks, submitted)
                    submitted += 1
                if k + self.prefetch >= len(chunks) and self._workers is None:
                    if nxt is None:
                        later = epoch_batches(self.epoch_items(epoch + 1), self.batch_size, self.drop_last)
                        nxt = NextEpoch(epoch + 1, later, reads, tails)
                    nxt.fill(k + self.prefetch - len(chunks), submit)
                got = ahead.take()
                if tail_thread:
                    batch, event, snap = got
                    batch = self._handover(batch, event)
                else:
                    with self._on_device():
                        batch = self.assembly.finish(got)
                    snap = self.cursor.draws.after(got.early)
                self.cursor.delivered(epoch, k + 1, snap)
                whole = k + 1 == len(chunks)
                yield batch
        finally:
            sys.setswitchinterval(interval)
            if self._training_threads is not None:
                self.torch.set_num_threads(threads)
            self._leave(reads, tails, nxt if whole else None)

    def _leave(self, reads: InOrder, tails: InOrder | None, nxt: NextEpoch | None) -> None:
        """An epoch left: its stages go on making `nxt` (the next epoch begun ahead, the states left where its
        draws are), or are stopped."""
        if nxt is not None:
            self._carry = nxt
            self.cursor.end(ahead=True)
            return
        if tails is not None:
            tails.close()  # before the reads: a tail waiting for its batch's read gets it, or its cancellation
            self._abandon_ahead()
        reads.close()
        # draws made for batches read ahead and never delivered are undone: a later epoch (or a saved state) goes
        # on from the last batch the user received, as MONAI's per-item chain would
        self.cursor.end()
        self.tier.settle()

    def _take_carry(self, epoch: int, skip: int, chunks: list[np.ndarray], tail_thread: bool) -> NextEpoch | None:
        """The epoch begun ahead if this pass is that epoch, else None (it dropped)."""
        carried = self._carry
        if carried is not None and carried.fits(epoch, skip, chunks, tail_thread):
            self._carry = None
            return carried
        self.drop_ahead()
        return None

    def drop_ahead(self) -> None:
        """Drop the next epoch begun ahead, if any: its jobs waited for or cancelled, every random state back to
        the last batch delivered (before anything reads or sets them)."""
        carried, self._carry = self._carry, None
        if carried is not None:
            carried.clear()
            self._abandon_ahead()
            self.cursor.drop_ahead()
            self.tier.settle()

    def _abandon_ahead(self) -> None:
        """A capture the tail thread opened ahead for a batch it will not make, ended there (where it was opened)."""
        if self.capture_ahead and "feed" in self._threads_kept:
            self._threads_kept["feed"].submit(self.assembly.abandon_ahead).result()

    def _thread(self, stage: str) -> Any:
        """The stage's one thread, started at the first epoch and kept for the next ones (a thread started and
        joined every epoch cost 38-62 ms an epoch on the GPU box, more than a `slices` batch), stopped by
        `close` or when the loader is collected."""
        import weakref
        from concurrent.futures import ThreadPoolExecutor

        pool = self._threads_kept.get(stage)
        if pool is None:
            pool = self._threads_kept[stage] = ThreadPoolExecutor(1, thread_name_prefix=f"blockprep-{stage}")
            weakref.finalize(self, pool.shutdown, wait=False)
        return pool

    def _on_device(self) -> Any:
        """The loader's device made current (a loader on cuda:1 in a process whose current device is cuda:0)."""
        return self.torch.cuda.device(self.device) if self.gpu else contextlib.nullcontext()

    def _handover(self, batch: dict[str, Any], event: Any) -> dict[str, Any]:
        """A batch finished on the read thread's stream, made safe to use on the caller's stream."""
        if event is not None and isinstance(batch, dict):  # not a batch packed by `pack_ahead`
            torch = self.torch
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(current)  # its memory is reused only after the caller's stream is done
        return batch

    def _fetch(self, chunk: np.ndarray, k: int) -> Any:
        """Batch `k`'s plan on the read thread: its crops drawn and its reads done (finished by the tail thread,
        `_finish_next`, or by the training thread)."""
        self._thread_threads()
        plan = self.assembly.plan([int(i) for i in chunk])
        plan.early = self.cursor.draws.take(self.cursor.draws.early)
        return self.assembly.fetch(plan)

    def _finish_next(self, reads: InOrder) -> Any:
        """The next batch read, uploaded, assembled and run through the tail on the tail thread (on its side
        CUDA stream): (batch, its event, the draws as of it)."""
        torch = self.torch
        self._thread_threads()
        plan = reads.take()
        event = None
        if self.gpu:
            if self._side is None:
                self._side = tail_stream(self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(self._side):
                try:
                    batch = self.assembly.finish(plan)
                except BaseException:
                    self.assembly.abandon_ahead()  # a capture opened ahead and not reached
                    raise
                checks = self.assembly.take_deferred()
                if self.pack_ahead is not None:  # a feeder's child: handed over from here, with its work
                    batch = self.pack_ahead(batch, checks)  # the checks waited for where it is sent
                else:
                    raise_checks(checks)
                event = torch.cuda.Event()
                event.record(self._side)
                if self.capture_ahead:  # ... and the next batch's capture begun with it
                    self.assembly.open_ahead()
        else:
            batch = self.assembly.finish(plan)
        return batch, event, self.cursor.draws.after(plan.early)

    def _thread_threads(self) -> None:
        """torch's threads on a loader thread: one where the training loop keeps the rest (OpenMP's count is
        per thread)."""
        if self._one_thread and self.torch.get_num_threads() != 1:
            self.torch.set_num_threads(1)

    @property
    def tier_bytes(self) -> int:
        """Bytes the device tier holds."""
        return self.tier.nbytes

    @property
    def backend(self) -> Backend:
        """The backend whole items are read through (built on first use). "auto" picks a host backend:
        its reads land in pinned staging and go up with one async copy, as region reads must anyway."""
        return self.reader.backend

    @property
    def fold(self) -> Any:
        """The crop at the start of the tail folded into the reads (`loaders.fast.folds`), or None."""
        return self.assembly.fold

    def close(self) -> None:
        """Release the backend and the device tier (and stop the feeder process)."""
        self.drop_ahead()
        if self._feeder is not None:
            self._feeder.close()
        if self._workers is not None:
            self._workers.close()
        for pool in self._threads_kept.values():
            pool.shutdown(wait=False)  # idle between epochs: they leave at once
        self._threads_kept = {}
        self.reader.close()
        self.tier.clear()


__all__ = ["PreparedLoader", "dataset_bytes", "parse_bytes"]
