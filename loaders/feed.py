"""PreparedLoader: batches ready for the model, from a prepared cache and the user's full MONAI transform.

    >>> loader = PreparedLoader("cache/", transform, batch_size=4, device="cuda:0", gpu_budget="8GiB")  # doctest: +SKIP
    >>> for epoch in range(epochs):                                                                    # doctest: +SKIP
    ...     for batch in loader:
    ...         loss = loss_fn(model(batch["image"]), batch["label"])

The cache holds the head's output (`prep cache`); the loader runs the random tail. What it does so the GPU
never waits:
- a `RandSpatialCropd` at the start of the tail is folded into the read: its crop is drawn with the
  transform's own random state (MONAI's per-item draws) and only the crop's bytes are read, every region of
  a batch in one backend call (`read_regions`);
- the rest of the tail runs over the whole batch on the device (`loaders.tail.BatchedTail` where present,
  else MONAI per item);
- batch k+1 is read, uploaded (pinned staging), assembled and transformed by a background thread on a side
  CUDA stream while the model computes on batch k; the training thread's `next()` is a queue get and a
  stream wait on the batch's CUDA event (`tail_thread=False`: the thread only reads, the rest is launched
  by the training thread between steps);
- items are kept on the device, whole, up to `gpu_budget` bytes, filled lazily during the first epoch
  (a crop of a resident item is a slice, a fresh crop every epoch); items beyond the budget stream from
  the page cache or the disk;
- DDP: `shard(rank, world)` and `set_epoch(epoch)`, as `DistributedSampler`: a different split every
  epoch, every item once per epoch across ranks.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args, state
from loaders.args import parse_bytes  # re-exported: loaders.feed.parse_bytes
from loaders.backends import Backend
from loaders.deps import require
from loaders.errors import ArgumentTypeError
from loaders.folds import Window, split_fold
from loaders.format import PreparedCache, TensorEntry
from loaders.order import epoch_batches, epoch_order
from loaders.reads import Fetched, Place, Reader
from loaders.staging import Slot, packed_view, stack, view
from loaders.tails import loader_tails
from loaders.tier import DeviceTier, auto_budget, dataset_bytes  # dataset_bytes: re-exported
from loaders.values import Values


@dataclass
class _Plan:
    """One batch: its items, its output rows (item, folded window or None; a multi-sample crop gives an item
    several rows) and what the read thread left in host (or device) memory for the consumer to assemble."""

    items: list[int]
    rows: list[tuple[int, Window | None]]
    slot: int = 0
    early: dict[int, Any] = field(default_factory=dict)  # random states right after the fold drew its windows
    whole: list[int] = field(default_factory=list)  # items read whole
    admit: set[int] = field(default_factory=set)  # of them, those the tier takes
    reads: dict[str, Any] = field(default_factory=dict)  # "whole" / "regions" -> (backend, buf, nbytes, places)


class _PreparedLoaderCore:
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
    an event); False: the training thread does it between steps. switch_interval: seconds for
    `sys.setswitchinterval` while an epoch is iterated (restored after; None leaves it): how long a thread
    waiting for the GIL waits before the holder is made to drop it. copy_threads: threads copying a warm
    crop out of the page cache (None: `read_regions`' default, min(backend threads, cores)).
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
        tail_thread: bool = True,
        switch_interval: float | None = None,
        copy_threads: int | None = None,
    ) -> None:
        from loaders import exact
        from loaders.monai import keep_random_states

        self.torch = require("torch", "PreparedLoader")
        self.cache = PreparedCache(cache_dir)
        args.check_loader(locals())  # every argument, one line each (loaders/args.py)
        self.keys = list(keys) if keys is not None else list(self.cache.keys)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        if device is None:  # the default follows the machine: the first GPU, or the CPU on a box without one
            device = "cuda:0" if self.torch.cuda.is_available() else "cpu"
        elif str(device).startswith("cuda") and not self.torch.cuda.is_available():
            raise ValueError(f"PreparedLoader: device={device!r} but this torch sees no CUDA GPU; pass device='cpu'")
        self.device = self.torch.device(device)
        self.gpu = self.device.type == "cuda"
        self.budget = (
            auto_budget(self.device, self.cache.root, self.keys)
            if gpu_budget == "auto"
            else args.parse_bytes(gpu_budget, "gpu_budget")
        )
        self.crop_read = crop_read
        self.prefetch = max(1, prefetch)
        self.verify = verify
        self.tail_thread, self.switch_interval, self.copy_threads = tail_thread, switch_interval, copy_threads
        with keep_random_states(transform):  # the chain's split and the Composes built here would re-seed it
            self._init_tail(transform, keys)
        self._seeder = exact.Seeder(transform)
        self._draws = state.Draws(self._seeder.compose, self.fold.transform if self.fold is not None else None)
        self._resume = 0  # batches of self.epoch already delivered before a load_state_dict
        self._live: list[Any] | None = None  # [epoch, batches delivered, their draws] while an epoch runs
        self.reader = Reader(self.cache, self.keys, backend, str(self.device), verify=verify,
                             backend_options=backend_options, pooled=False, host_auto=True,
                             copy_threads=copy_threads)  # fmt: skip
        self.items = np.arange(len(self.cache), dtype=np.int64)
        self.rank, self.world = 0, 1
        self.epoch = 0
        self.tier = DeviceTier(self.budget)  # whole items on the device (loaders.tier)
        self._stager: Any = None  # pinned slots of the batches in flight (on a GPU)
        self._side: Any = None  # the read thread's CUDA stream (tail_thread)

    def _init_tail(self, transform: Any, keys: Sequence[str] | None) -> None:
        """Check the head, refuse what cannot equal MONAI (`loaders.exact`), split off the crop to fold."""
        from loaders import chain, exact

        chain.check_fingerprint(transform, self.cache.manifest, str(self.cache.root / "manifest.json"))
        _, tail = chain.split(transform)
        exact.refuse_meta_readers(tail)
        options = chain.compose_options(transform)
        self.fold: Any = None
        rest = list(tail)
        if exact.folds(tail, options):
            self.fold, rest = split_fold(tail, self.keys, self.cache)
        # keys the fold crops; the others (CropForegroundd's coordinates, ...) pass through whole, as MONAI's do
        cropped = set(self.fold.transform.keys) if self.fold is not None else set(self.keys)
        self.crop_keys = [k for k in self.keys if k in cropped]
        self.pass_keys = [k for k in self.keys if k not in cropped]
        self._spatial_key = self.fold.spatial_key(self.crop_keys) if self.fold is not None else None
        # batched, and for unequal shapes (no folded crop) MONAI per item: one Compose with the user's options
        self.tail, self._ragged_tail = loader_tails(rest, self.device, options)
        self.values = Values(self.cache, keys, tail)

    def __reduce__(self) -> Any:
        raise ArgumentTypeError(
            "a PreparedLoader cannot be pickled (it owns read threads, staging buffers and device memory); build "
            "one in each process from the cache path (after DDP spawn, in each rank)"
        )

    # --- order ---
    def shard(self, rank: int, world: int) -> _PreparedLoaderCore:
        """This loader as DDP rank `rank` of `world`: each epoch's shuffled order split across ranks."""
        args.shard(rank, world)
        self.rank, self.world = rank, world
        return self

    def set_epoch(self, epoch: int) -> None:
        """Order the next pass as epoch `epoch` (`loaders.order.epoch_order`: DistributedSampler's rule, seed +
        epoch). Each pass then moves on by one: without set_epoch the passes are epochs 0, 1, 2, ...; after
        set_epoch(5) they are 5, 6, 7, ... (calling set_epoch(e) before every pass, as with a
        DistributedSampler, gives exactly epoch e each time). After `load_state_dict`, set_epoch with the
        saved epoch keeps the saved place in it."""
        epoch = args.count("epoch", epoch, 0)
        if epoch != self.epoch:
            self._resume = 0
        self.epoch = epoch

    def set_random_state(self, seed: int) -> _PreparedLoaderCore:
        """Seed the tail's random transforms as `transform.set_random_state(seed)` seeds them (the head draws
        nothing; a nested Compose seeds its members from its own draw, as in MONAI)."""
        self._seeder.set_random_state(None if seed is None else args.seed(seed))
        return self

    # --- state (loaders.state) ---
    def _order(self) -> dict[str, Any]:
        return {"fingerprint": state.fingerprint(self.cache.manifest, self._draws.names()), "seed": self.seed,
                "shuffle": self.shuffle, "rank": self.rank, "world": self.world, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "n_items": len(self.items)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where training stands, as of the last batch delivered: the epoch, the batches of it delivered and
        the random state of every random transform (the folded crop's and the tail's), small JSON. A run
        resumed from it with `load_state_dict` gives exactly the batches the uninterrupted run gives next."""
        if self._live is not None:
            epoch, batch, snap = self._live
        else:
            epoch, batch, snap = self.epoch, self._resume, self._draws.take()
        if batch and batch >= len(self):  # the epoch was delivered whole: the next starts at its first batch
            epoch, batch = epoch + 1, 0
        return {"format": "blockprep-loader-state", "version": state.VERSION, **self._order(), "epoch": epoch,
                "batch": batch, "transforms": self._draws.names(), "random": self._draws.encode(snap)}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on from a `state_dict()`: the next pass is the saved epoch from the batch after the last one
        delivered, with the random draws it had. Refused in one line (LoaderStateError) when the state
        belongs to another cache, transform, order or rank/world size, or while an epoch is being iterated."""
        if self._live is not None:
            raise state.LoaderStateError("load_state_dict: an epoch of this loader is being iterated; load first")
        state.check(saved, self._order())
        if saved["batch"] > len(self):
            raise state.LoaderStateError(f"load_state_dict: batch {saved['batch']} is past the epoch's {len(self)}")
        snap = self._draws.decode(saved.get("random"), "load_state_dict")
        self._draws.put(snap)
        self.epoch, self._resume = saved["epoch"], saved["batch"]

    def epoch_items(self, epoch: int) -> np.ndarray:
        """Items this rank reads in `epoch` (`loaders.order.epoch_order`): all ranks' lists together hold every
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
        skip, self._resume = self._resume, 0
        return self._run(chunks, epoch, skip)

    def _run(self, chunks: list[np.ndarray], epoch: int, skip: int) -> Iterator[dict[str, Any]]:
        out: queue.Queue[Any] = queue.Queue(self.prefetch)
        stop = threading.Event()
        work = (chunks[skip:], skip, out, stop)
        worker = threading.Thread(target=self._produce, args=work, daemon=True, name="blockprep-feed")
        interval = sys.getswitchinterval()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        self._live = [epoch, skip, self._draws.take()]
        worker.start()
        try:
            for k in range(skip, len(chunks)):
                got = out.get()
                if isinstance(got, BaseException):
                    raise got
                if self.tail_thread:
                    batch, event, snap = got
                    batch = self._handover(batch, event)
                else:
                    batch = self._finish(got)
                    snap = self._draws.after(got.early)
                self._live = [epoch, k + 1, snap]
                yield batch
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                with contextlib.suppress(queue.Empty):
                    out.get(timeout=0.05)
            worker.join()
            sys.setswitchinterval(interval)
            # draws made for batches read ahead and never delivered are undone: a later epoch (or a saved
            # state) goes on from the last batch the user received, as MONAI's per-item chain would
            self._draws.put(self._live[2])
            self._live = None
            self.tier.settle()

    def _handover(self, batch: dict[str, Any], event: Any) -> dict[str, Any]:
        """A batch finished on the read thread's stream, made safe to use on the caller's stream."""
        if event is not None:
            torch = self.torch
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(current)  # its memory is reused only after the caller's stream is done
        return batch

    def _produce(self, chunks: list[np.ndarray], base: int, out: queue.Queue[Any], stop: threading.Event) -> None:
        torch = self.torch
        try:
            if self.tail_thread and self.gpu and self._side is None:
                self._side = torch.cuda.Stream(device=self.device)
            for k, chunk in enumerate(chunks, start=base):
                if stop.is_set():
                    return
                plan = self._plan([int(i) for i in chunk], k)
                plan.early = self._draws.take(self._draws.early)
                plan = self._fetch(plan)
                if not self.tail_thread:
                    out.put(plan)
                    continue
                event = None
                if self.gpu:
                    with torch.cuda.device(self.device), torch.cuda.stream(self._side):
                        batch = self._finish(plan)
                        event = torch.cuda.Event()
                        event.record(self._side)
                else:
                    batch = self._finish(plan)
                out.put((batch, event, self._draws.after(plan.early)))
        except BaseException as exc:  # noqa: BLE001  (handed to the consumer, raised there)
            out.put(exc)

    def _plan(self, items: list[int], k: int) -> _Plan:
        """Draw the folded crop's windows per item, in batch order (as MONAI's per-item tail draws them)."""
        rows: list[tuple[int, Window | None]] = []
        for item in items:
            if self.fold is None:
                rows.append((item, None))
                continue
            spatial = next(e.shape[1:] for e in self.entries(item) if e.key == self._spatial_key)
            rows.extend((item, w) for w in self.fold.draw(item, spatial))
        return _Plan(items, rows, slot=len(_READS) * k)

    def _fetch(self, plan: _Plan) -> _Plan:
        """Read what the tier does not hold: whole items (those the tier will take, or all without a folded
        crop or with crop_read=False) and the crops of the others, into staging memory."""
        regions: list[tuple[int, int, Window]] = []  # (row, item, window)
        for item in dict.fromkeys(plan.items):
            if item in self.tier:
                continue
            if self.tier.reserve(item, self._nbytes(item)):
                plan.admit.add(item)
                plan.whole.append(item)
            elif self.fold is None or self.crop_read is False:
                plan.whole.append(item)
        whole = set(plan.whole)
        for r, (item, window) in enumerate(plan.rows):
            if window is not None and item not in whole and item not in self.tier:
                regions.append((r, item, window))
        if plan.whole:
            plan.reads["whole"] = self._read_whole(plan.whole, plan.slot)
        if regions:
            rows, items, windows = zip(*regions)
            crops = self.reader.plan(items, windows, keys=self.crop_keys, tags=[("row", r) for r in rows], packed=True)
            plan.reads["regions"] = self.reader.fetch(crops, self._slot(plan.slot + 1))
            if self.pass_keys:  # the keys the crop leaves alone, whole, for the items read as crops
                cropped = list(dict.fromkeys(item for _, item, _ in regions))
                plan.reads["pass"] = self._read_whole(cropped, plan.slot + 2, self.pass_keys)
        return plan

    def _finish(self, plan: _Plan) -> dict[str, Any]:
        """Upload, admit to the tier, crop, stack and run the rest of the tail, on the current stream."""
        torch = self.torch
        got: dict[Any, dict[str, Any]] = {}
        batch: dict[str, Any] | None = None
        for what, fetched in plan.reads.items():
            flat = self.reader.upload(fetched)
            places = fetched.places
            if what == "regions" and not plan.whole:
                batch = _packed(flat, places, self.crop_keys, len(plan.rows))
                if batch is not None:  # every row's crop, packed by key: no per-row views, no stack
                    continue
            for tag, key, at, dtype, shape in places:  # tag: the item (whole reads) or ("row", r) (crops)
                got.setdefault(("pass", tag) if what == "pass" else tag, {})[key] = view(flat, at, dtype, shape)
        for item in plan.admit:
            self.tier.admit(item, got[item], self._nbytes(item))
        if batch is None:
            batch = self._assemble(plan, got)
        elif self.pass_keys:
            batch.update({k: stack([got[("pass", item)][k] for item, _ in plan.rows]) for k in self.pass_keys})
        if any(isinstance(v, list) for v in batch.values()):  # MONAI per item: it may write into its input,
            batch = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in batch.items()}  # not the tier
            out, origin = self._ragged_tail.run(batch)
        else:
            out, origin = self.tail.run(batch)  # the user's transforms never see the loader's `_items`
        out["_items"] = torch.as_tensor([plan.rows[i][0] for i in origin], dtype=torch.int64)  # crops repeat items
        return self.values.collate(out)

    def _assemble(self, plan: _Plan, got: dict[Any, dict[str, Any]]) -> dict[str, Any]:
        """Per key, the batch's rows (resident, whole or crop reads) cropped and stacked (a list if ragged)."""
        per_key: dict[str, list[Any]] = {key: [] for key in self.keys}
        for r, (item, window) in enumerate(plan.rows):
            resident = item in self.tier
            whole = resident or item in plan.whole
            tensors = (
                self.tier[item]
                if resident
                else got[item]
                if whole
                else {**got[("row", r)], **got.get(("pass", item), {})}
            )
            for key in self.keys:
                t = tensors[key]
                if window is not None and whole and key not in self.pass_keys:
                    t = t[(slice(None), *(slice(a, a + n) for a, n in zip(*window)))]
                per_key[key].append(t)
        return {key: stack(ts) for key, ts in per_key.items()}

    @property
    def tier_bytes(self) -> int:
        """Bytes the device tier holds."""
        return self.tier.nbytes

    # --- reads (loaders.reads) ---
    @property
    def backend(self) -> Backend:
        """The backend whole items are read through (built on first use). "auto" picks a host backend:
        its reads land in pinned staging and go up with one async copy, as region reads must anyway."""
        return self.reader.backend

    def entries(self, item: int) -> list[TensorEntry]:
        """The loaded tensors of `item`, in key order."""
        return self.reader.entries(item)

    def _nbytes(self, item: int) -> int:
        return self.reader.nbytes(item)

    def _slot(self, slot: int) -> Slot | None:
        """Pinned staging slot `slot` (modulo the count) for reads that go to the GPU; None on the CPU."""
        if not self.gpu:
            return None
        if self._stager is None:
            self._stager = self.reader.stager(len(_READS) * (self.prefetch + 2))
        return Slot(self._stager, slot)

    def _read_whole(self, items: list[int], slot: int, keys: Sequence[str] | None = None) -> Fetched:
        """Whole items (their `keys`, default all), item-major, every tensor in flight in one backend call."""
        return self.reader.fetch(self.reader.plan(items, keys=keys, key_major=False), self._slot(slot))

    def close(self) -> None:
        """Release the backend and the device tier."""
        self.reader.close()
        self.tier.clear()


_READS = ("whole", "regions", "pass")  # a batch's reads, each into its own staging slot


def _packed(flat: Any, places: list[Place], keys: list[str], n: int) -> dict[str, Any] | None:
    """Each key's `n` crops as one (n, ...) view of `flat` when they lie back to back in batch order with
    equal shapes (key-major region reads of one batch); None otherwise."""
    if len(places) != n * len(keys):
        return None
    out = {}
    for j, key in enumerate(keys):
        run = places[j * n : (j + 1) * n]
        got = packed_view(flat, run) if run[0][1] == key else None
        if got is None:
            return None
        out[key] = got
    return out


PreparedLoader = _PreparedLoaderCore


__all__ = ["PreparedLoader", "dataset_bytes", "parse_bytes"]
