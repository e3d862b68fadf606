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
import math
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
from loaders.backends import Backend, ReadRequest, get_backend
from loaders.backends.base import aligned_empty
from loaders.deps import require
from loaders.errors import ArgumentTypeError, BackendError, FormatError
from loaders.exact import nested_batch
from loaders.folds import Window, split_fold
from loaders.format import PreparedCache, TensorEntry, align_up, check, flat_again, nested
from loaders.order import epoch_order
from loaders.region import RegionRead, plan_read, read_regions


class _PerItemTail:
    """The tail through MONAI, item by item (items of unequal shapes, or no `loaders.tail.BatchedTail`)."""

    def __init__(self, transforms: Sequence[Any], device: Any = None, options: dict[str, Any] | None = None) -> None:
        from monai.transforms import Compose

        self.compose = Compose(list(transforms), **(options or {})) if transforms else None

    def run(self, batch: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """(the batch through the tail, the input item each output came from)."""
        import torch

        from loaders.tail.batched import ragged_error

        keys = [k for k in batch if not k.startswith("_")]
        n = len(batch[keys[0]])
        if self.compose is None:
            outs: list[dict[str, Any]] = [{k: batch[k][i] for k in keys} for i in range(n)]
            sources = list(range(n))
        else:
            outs, sources = [], []
            for i in range(n):
                # the head's nested outputs (ClassesToIndicesd's index list, cached as "key/0", "key/1", ...)
                # reach MONAI as it made them, and its outputs are flat again for the batch
                item, nested_keys = nested({k: batch[k][i] for k in keys})
                out = self.compose(item)
                out = out if isinstance(out, list) else [out]  # num_samples crops: MONAI's list layout
                outs.extend(flat_again(o, nested_keys) for o in out)
                sources.extend([i] * len(out))
        result = {k: _stack(torch, [_plain(o[k]) for o in outs]) for k in outs[0]}
        shapes = {tuple(t.shape) for v in result.values() if isinstance(v, list) for t in v if hasattr(t, "shape")}
        ragged = sorted(shapes)
        if ragged:  # MONAI's list_data_collate raises here too
            raise ragged_error(ragged)
        return result, sources


def _plain(t: Any) -> Any:
    return t.as_tensor() if hasattr(t, "as_tensor") else t


def batched_tail(transforms: Sequence[Any], device: Any, options: dict[str, Any] | None = None) -> Any:
    """`loaders.tail.BatchedTail` over `transforms` (with the user's Compose options) when installed, else
    MONAI per item."""
    try:
        from loaders.tail import BatchedTail  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return _PerItemTail(transforms, device, options)
    from monai.transforms import Compose

    if not transforms:
        return _PerItemTail([], device)
    return BatchedTail(Compose(list(transforms), **(options or {})), device=device)


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
        self.budget = self._auto_budget() if gpu_budget == "auto" else args.parse_bytes(gpu_budget, "gpu_budget")
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
        self._values: dict[int, dict[str, Any]] = {}  # item -> its non-tensor head outputs (class labels, ...)
        self._backend = backend if isinstance(backend, Backend) else None
        self._backend_spec, self._backend_options = backend, dict(backend_options or {})
        self.items = np.arange(len(self.cache), dtype=np.int64)
        self.rank, self.world = 0, 1
        self.epoch = 0
        self.tier: dict[int, dict[str, Any]] = {}  # item -> whole tensors on the device
        self.tier_bytes = 0
        self._reserved = 0  # bytes promised to the tier by reads in flight
        self._promised: set[int] = set()
        self._entries: dict[int, list[TensorEntry]] = {}
        self._region_backend: Backend | None = None
        self._stager: Any = None
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
        self.tail = batched_tail(rest, self.device, options)
        self._ragged_tail = _PerItemTail(rest, options=options)  # unequal shapes (no folded crop): MONAI per item
        self._keys_given = keys  # value keys are filtered by it too
        self.value_keys = self._value_keys(keys, tail)

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
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and chunks and len(chunks[-1]) < self.batch_size:
            chunks.pop()
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
            self._promised, self._reserved = set(self.tier), self.tier_bytes

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
            nbytes = self._nbytes(item)
            if self._reserved + nbytes <= self.budget and item not in self._promised:
                self._reserved += nbytes
                self._promised.add(item)
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
            plan.reads["regions"] = self._read_regions(regions, plan.slot + 1)
            if self.pass_keys:  # the keys the crop leaves alone, whole, for the items read as crops
                cropped = list(dict.fromkeys(item for _, item, _ in regions))
                plan.reads["pass"] = self._read_whole(cropped, plan.slot + 2, self.pass_keys)
        return plan

    def _finish(self, plan: _Plan) -> dict[str, Any]:
        """Upload, admit to the tier, crop, stack and run the rest of the tail, on the current stream."""
        torch = self.torch
        got: dict[Any, dict[str, Any]] = {}
        batch: dict[str, Any] | None = None
        for what, (backend, buf, nbytes, places) in plan.reads.items():
            flat = self._upload(backend, buf, plan.slot + _READS.index(what), nbytes)
            if what == "regions" and not plan.whole:
                batch = _packed(torch, flat, places, self.crop_keys, len(plan.rows))
                if batch is not None:  # every row's crop, packed by key: no per-row views, no stack
                    continue
            for tag, key, at, dtype, shape in places:  # tag: the item (whole reads) or ("row", r) (crops)
                nb = math.prod(shape) * np.dtype(dtype).itemsize
                view = flat[at : at + nb].view(_torch_dtype(torch, dtype)).reshape(shape)
                got.setdefault(("pass", tag) if what == "pass" else tag, {})[key] = view
        for item in plan.admit:
            self._admit(item, got[item])
        if batch is None:
            batch = self._assemble(plan, got)
        elif self.pass_keys:
            batch.update({k: _stack(torch, [got[("pass", item)][k] for item, _ in plan.rows]) for k in self.pass_keys})
        ragged = any(isinstance(v, list) for v in batch.values())
        if ragged:  # MONAI per item: it may write into its input, not the tier
            batch = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in batch.items()}
        if self._values_in_tail:  # a tail transform reads them: each row gets its item's, as MONAI gives them
            batch.update({k: [self._item_values(i)[k] for i, _ in plan.rows] for k in self.value_keys})
        # the user's transforms never see the loader's `_items`
        out, origin = (self._ragged_tail if ragged else self.tail).run(batch)
        out["_items"] = torch.as_tensor([plan.rows[i][0] for i in origin], dtype=torch.int64)  # crops repeat items
        return nested_batch(self._with_values(out))

    def _auto_budget(self) -> int:
        """gpu_budget="auto": the dataset when it fits in half the device's free memory, else that half."""
        if not self.gpu:
            return 0
        free, _ = self.torch.cuda.mem_get_info(self.device)
        return min(dataset_bytes(self.cache.root, self.keys), free // 2)

    # --- non-tensor outputs of the head (class labels, names): batched as MONAI's list_data_collate does ---
    def _value_keys(self, keys: Sequence[str] | None, tail: Sequence[Any]) -> list[str]:
        """The head's non-tensor output keys (from item 0's meta line); whether the tail sees them."""
        from loaders.exact import tail_sees_values
        from loaders.meta import line_values

        self._values_in_tail = False
        if not len(self.cache):
            return []
        names = [k for k in line_values(self.cache.meta(0)) if keys is None or k.split("/", 1)[0] in keys]
        self._values_in_tail = tail_sees_values(names, tail)
        return list(dict.fromkeys(k.split("/", 1)[0] for k in names))  # "tags/0", "tags/1": the list "tags"

    def _item_values(self, item: int) -> dict[str, Any]:
        from loaders.meta import line_values

        got = self._values.get(item)
        if got is None:
            values, _ = nested(line_values(self.cache.meta(item)))  # a list value ("tags/0", ...) as given
            names = {k for k in values if self._keys_given is None or k in self._keys_given}
            if names != set(self.value_keys):  # MONAI's collate would fail on a batch mixing such items
                raise FormatError(
                    f"{self.cache.root}: item {item}'s non-tensor outputs {sorted(names)} differ from item 0's "
                    f"{sorted(self.value_keys)}; give every item the same keys (the head's outputs, the datalist's "
                    "entries) and re-run `prep cache --force`"
                )
            got = self._values[item] = {k: values[k] for k in self.value_keys}
        return got

    def _with_values(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` with its non-tensor entries collated as MONAI's list_data_collate collates them: what the tail
        gave (a list with one entry per output row, or one object every row shares: "CT" stays ["CT", "CT"]),
        and the head's values (a multi-sample crop repeats its item's) unless the tail saw them."""
        from monai.data.utils import list_data_collate

        n = len(out["_items"])
        loose = [k for k, v in out.items() if k != "_items" and not isinstance(v, self.torch.Tensor)]
        rows = [{k: out[k][j] if isinstance(out[k], list) and len(out[k]) == n else out[k] for k in loose}
                for j in range(n)]  # fmt: skip
        if self.value_keys and not self._values_in_tail:
            for row, item in zip(rows, out["_items"].tolist()):
                row.update(self._item_values(item))
        if rows and rows[0]:
            out.update(list_data_collate(rows))
        return out

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
        return {key: _stack(self.torch, ts) for key, ts in per_key.items()}

    def _admit(self, item: int, tensors: dict[str, Any]) -> None:
        if item not in self.tier:
            self.tier[item] = {k: t.clone() for k, t in tensors.items()}  # not a view of the batch buffer
            self.tier_bytes += self._nbytes(item)

    # --- reads ---
    @property
    def backend(self) -> Backend:
        """The backend whole items are read through (built on first use). "auto" picks a host backend:
        its reads land in pinned staging and go up with one async copy, as region reads must anyway."""
        if self._backend is None:
            name = self._backend_spec if isinstance(self._backend_spec, str) else "auto"
            device = "cpu" if name == "auto" else str(self.device)
            self._backend = get_backend(name, device=device, **self._backend_options)
        return self._backend

    @property
    def region_backend(self) -> Backend:
        """The backend crops are read through: a host one (regions are assembled in host memory)."""
        if not self.backend.gpu:
            return self.backend
        if self._region_backend is None:
            self._region_backend = get_backend("auto", device="cpu")
        return self._region_backend

    def entries(self, item: int) -> list[TensorEntry]:
        """The loaded tensors of `item`, in key order."""
        got = self._entries.get(item)
        if got is None:
            got = [e for e in self.cache.entries(item) if e.key in self.keys]
            got.sort(key=lambda e: self.keys.index(e.key))
            self._entries[item] = got
        return got

    def _nbytes(self, item: int) -> int:
        return sum(e.nbytes for e in self.entries(item))

    def _host(self, backend: Backend, slot: int, nbytes: int) -> np.ndarray:
        """Memory to read into: a pinned staging slot for a GPU (host backends), else the backend's own."""
        if self.gpu and not backend.gpu:
            if self._stager is None:
                from loaders.gpu import PinnedStager

                self._stager = PinnedStager(str(self.device), slots=len(_READS) * (self.prefetch + 2))
            return self._stager.host(slot % self._stager.slots, nbytes)  # type: ignore[no-any-return]
        return backend.allocate(max(nbytes, 1))  # type: ignore[no-any-return]

    def _upload(self, backend: Backend, buf: Any, slot: int, nbytes: int) -> Any:
        """The bytes as one uint8 tensor on the device (one async copy when staged)."""
        torch = self.torch
        if self.gpu and not backend.gpu:
            return self._stager.upload(slot % self._stager.slots, nbytes)
        if backend.gpu:
            return torch.as_tensor(buf[:nbytes], device=self.device)
        return torch.from_numpy(np.asarray(buf[:nbytes]))

    def _read_whole(
        self, items: list[int], slot: int, keys: Sequence[str] | None = None
    ) -> tuple[Backend, Any, int, list[tuple]]:
        """Whole items (their `keys`, default all), every tensor in flight in one backend call, into one
        staging buffer."""
        places: list[tuple[int, str, int, np.dtype, tuple[int, ...]]] = []
        entries: list[TensorEntry] = []
        pos = 0
        for item in items:
            for e in self.entries(item):
                if keys is not None and e.key not in keys:
                    continue
                places.append((item, e.key, pos, e.dtype, tuple(e.shape)))
                entries.append(e)
                pos += align_up(e.nbytes)
        backend = self.backend
        buf = self._host(backend, slot, pos)
        requests = [ReadRequest(e.shard, e.offset, e.nbytes) for e in entries]
        targets = [buf[p[2] : p[2] + e.nbytes] for p, e in zip(places, entries)]
        try:
            backend.read_into(requests, targets)
        except BackendError as exc:
            raise BackendError(f"{self.cache.root}: {exc}; rebuild the cache with `prep cache --force`") from exc
        if self.verify:
            for e, data in zip(entries, targets):
                check(e, np.asarray(data.get() if hasattr(data, "get") else data))
        return backend, buf, pos, places

    def _read_regions(self, crops: list[tuple[int, int, Window]], slot: int) -> tuple[Backend, Any, int, list]:
        """The crops of a batch's rows: every region in one `read_regions` call, landing in one staging
        buffer (warm regions are copied straight into it)."""
        reads: list[tuple[Any, RegionRead]] = []
        for key in self.crop_keys:  # key-major: each key's crops land side by side (one batch view)
            for r, item, (start, shape) in crops:
                for e in self.entries(item):
                    if e.key != key:
                        continue
                    lead = len(e.shape) - len(start)
                    reads.append((("row", r), plan_read(e, [0] * lead + start, list(e.shape[:lead]) + shape)))
        sizes = [align_up(math.prod(r.shape) * r.entry.dtype.itemsize) for _, r in reads]
        total = sum(sizes)
        backend = self.region_backend
        buf = self._host(backend, slot, 2 * total)  # regions land in the first half; the second takes copies
        base = buf.ctypes.data
        cursor = [0]

        def allocate(nbytes: int) -> Any:
            at = cursor[0]
            if at + nbytes > total:  # scratch slabs of cold reads: ordinary memory
                return aligned_empty(nbytes)
            cursor[0] = at + align_up(nbytes)
            return buf[at : at + nbytes]

        arrays = read_regions(backend, [r for _, r in reads], allocate=allocate, groups=self.copy_threads)
        places, spare, end = [], total, 0
        for (tag, read), a, size in zip(reads, arrays, sizes):
            at = a.ctypes.data - base
            if not (0 <= at < total and a.flags.c_contiguous):  # not in the buffer: one copy into it
                at, spare = spare, spare + size
                np.asarray(buf[at : at + a.nbytes]).view(a.dtype).reshape(a.shape)[...] = a
            places.append((tag, read.entry.key, at, a.dtype, tuple(a.shape)))
            end = max(end, at + a.nbytes)
        return backend, buf, end, places

    def close(self) -> None:
        """Release the backend and the device tier."""
        for backend in {id(b): b for b in (self._backend, self._region_backend) if b is not None}.values():
            backend.close()
        self.tier.clear()
        self._promised.clear()
        self.tier_bytes = self._reserved = 0


_READS = ("whole", "regions", "pass")  # a batch's reads, each into its own staging slot
_TORCH_DTYPES: dict[np.dtype, Any] = {}


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    got = _TORCH_DTYPES.get(dtype)
    if got is None:
        got = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return got


def _packed(torch: Any, flat: Any, places: list[tuple], keys: list[str], n: int) -> dict[str, Any] | None:
    """Each key's `n` crops as one (n, ...) view of `flat` when they lie back to back in batch order with
    equal shapes (key-major region reads of one batch); None otherwise."""
    if len(places) != n * len(keys):
        return None
    out = {}
    for j, key in enumerate(keys):
        run = places[j * n : (j + 1) * n]
        _, _, at, dtype, shape = run[0]
        nb = math.prod(shape) * np.dtype(dtype).itemsize
        if at % np.dtype(dtype).itemsize or any(
            p[1] != key or p[2] != at + i * nb or p[3] != dtype or p[4] != shape for i, p in enumerate(run)
        ):
            return None
        out[key] = flat[at : at + n * nb].view(_torch_dtype(torch, dtype)).reshape(n, *shape)
    return out


def _stack(torch: Any, tensors: list[Any]) -> Any:
    same = all(isinstance(t, torch.Tensor) and t.shape == tensors[0].shape for t in tensors)
    return torch.stack(tensors) if same else tensors  # values the tail saw (names, labels) stay a list


PreparedLoader = _PreparedLoaderCore


def dataset_bytes(cache_dir: str | Path, keys: Sequence[str] | None = None) -> int:
    """Bytes of every tensor (of `keys`) in a cache: what holding it whole on a device costs."""
    cache = PreparedCache(cache_dir)
    if not len(cache.index):
        return 0
    wanted = [i for i, k in enumerate(cache.keys) if keys is None or k in keys]
    return int(np.asarray(cache.index["nbytes"])[np.isin(cache.index["key"], wanted)].sum())


__all__ = ["PreparedLoader", "dataset_bytes", "parse_bytes"]
