"""One batch of a `PreparedLoader`, from its items to what the model gets.

On the read thread: `plan` draws each item's folded crop windows in batch order (`loaders.fast.folds`, with the
transform's own random state: MONAI's per-item draws), `fetch` reads what the device tier (`loaders.fast.tier`)
does not hold through the `Reader` (`loaders.reading.reads`): whole items (those the tier takes, or all without a
folded crop), the crops of the others as one region read, into pinned staging slots on a GPU. Then `finish`
(on the read thread's side stream, or the training thread's): upload (`loaders.reading.staging`), admit to the tier,
crop, stack, and run the rest of the tail (`loaders.tail.tails`), the head's non-tensor outputs collated after it
(`loaders.fast.values`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loaders.cache.format import PreparedCache
from loaders.fast.exact import nested_batch
from loaders.fast.folds import Window, may_fold, split_fold
from loaders.fast.tier import DeviceTier
from loaders.fast.values import Values
from loaders.reading.reads import Fetched, Reader
from loaders.reading.staging import Slot, landed, stack, values_to
from loaders.tail.replay import DRAWN
from loaders.tail.tails import loader_tails

__all__ = ["BatchAssembly", "BatchPlan"]

_READS = ("whole", "regions", "pass")  # a batch's reads, each into its own staging slot


@dataclass
class BatchPlan:
    """One batch: its items, its output rows (item, folded window or None; a multi-sample crop gives an item
    several rows) and what the read thread left in host (or device) memory for the consumer to assemble."""

    items: list[int]
    rows: list[tuple[int, Window | None]]
    slot: int = 0
    early: dict[int, Any] = field(default_factory=dict)  # random states right after the fold drew its windows
    whole: list[int] = field(default_factory=list)  # items read whole
    admit: set[int] = field(default_factory=set)  # of them, those the tier takes
    reads: dict[str, Any] = field(default_factory=dict)  # "whole" / "regions" / "pass" -> what was fetched


class BatchAssembly:
    """Makes a loader's batches (see module doc): `transform`'s tail split into the crop folded into the
    reads and the rest; `keys` read through `reader`, whole items kept in `tier`. crop_read: False reads
    whole items and crops them on the device. prefetch: batches in flight (pinned slots for each)."""

    def __init__(
        self,
        transform: Any,
        cache: PreparedCache,
        keys: Sequence[str] | None,
        reader: Reader,
        tier: DeviceTier,
        crop_read: bool | str,
        prefetch: int,
    ) -> None:
        self.cache, self.reader, self.tier = cache, reader, tier
        self.keys = reader.keys
        self.crop_read, self.prefetch = crop_read, prefetch
        self.gpu = reader.gpu
        self._stager: Any = None  # pinned slots of the batches in flight (on a GPU)
        self._split(transform, keys)

    def _split(self, transform: Any, keys: Sequence[str] | None) -> None:
        """Check the head, refuse what cannot equal MONAI (`loaders.fast.exact`), split off the crop to fold."""
        import torch

        from loaders.cache import chain
        from loaders.fast import exact

        chain.check_fingerprint(transform, self.cache.manifest, str(self.cache.root / "manifest.json"))
        _, tail = chain.split(transform)
        exact.refuse_meta_readers(tail)
        exact.refuse_nested_samples(tail)
        options = chain.compose_options(transform)
        self.fold: Any = None
        rest = list(tail)
        if may_fold(tail, options):
            self.fold, rest = split_fold(tail, self.keys, self.cache)
        # keys the fold crops; the others (CropForegroundd's coordinates, ...) pass through whole, as MONAI's do
        cropped = set(self.fold.transform.keys) if self.fold is not None else set(self.keys)
        self.crop_keys = [k for k in self.keys if k in cropped]
        self.pass_keys = [k for k in self.keys if k not in cropped]
        self._spatial_key = self.fold.spatial_key(self.crop_keys) if self.fold is not None else None
        # batched, and for unequal shapes (no folded crop) MONAI per item: one Compose with the user's options
        self.tail, self._ragged_tail = loader_tails(rest, torch.device(self.reader.device), options)
        self.values = Values(self.cache, keys, tail)
        self._planned = 0  # batches planned so far, every epoch's: each its own staging slots in turn

    def plan(self, items: list[int]) -> BatchPlan:
        """Draw the folded crop's windows per item, in batch order (as MONAI's per-item tail draws them). Plans
        are made in the order their reads run; each takes the staging slots after the last plan's, across epochs
        too: a slot is read into again only after the upload of the batch before that filled it was queued (at
        most `prefetch` + 1 batches are read ahead of the one taken), where an epoch's own batch index would give
        the next epoch's first reads the slots of this epoch's last batches, still to be uploaded."""
        rows: list[tuple[int, Window | None]] = []
        for item in items:
            if self.fold is None:
                rows.append((item, None))
                continue
            spatial = next(e.shape[1:] for e in self.reader.entries(item) if e.key == self._spatial_key)
            rows.extend((item, w) for w in self.fold.draw(item, spatial))
        slot, self._planned = len(_READS) * self._planned, self._planned + 1
        return BatchPlan(items, rows, slot=slot)

    def fetch(self, plan: BatchPlan) -> BatchPlan:
        """Read what the tier does not hold: whole items (those the tier will take, or all without a folded
        crop or with crop_read=False) and the crops of the others, into staging memory."""
        regions: list[tuple[int, int, Window]] = []  # (row, item, window)
        for item in dict.fromkeys(plan.items):
            if item in self.tier:
                continue
            if self.tier.reserve(item, self.reader.nbytes(item)):
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

    def finish(self, plan: BatchPlan) -> dict[str, Any]:
        """Upload, admit to the tier, crop, stack and run the rest of the tail, on the current stream."""
        import torch

        got: dict[Any, dict[str, Any]] = {}
        batch: dict[str, Any] | None = None
        if plan.reads:  # uploads from staging slots the read thread fills again: never left in a capture
            self.abandon_ahead()
        for what, fetched in plan.reads.items():
            packed = self.crop_keys if what == "regions" and not plan.whole else ()
            rows, by_tag = landed(self.reader.upload(fetched), fetched.places, packed, len(plan.rows))
            if rows is not None:  # every row's crop, packed by key: no per-row views, no stack
                batch = rows
                continue
            for tag, tensors in by_tag.items():  # tag: the item (whole reads) or ("row", r) (crops)
                got.setdefault(("pass", tag) if what == "pass" else tag, {}).update(tensors)
        self.tier.admit_all({item: got[item] for item in plan.admit}, {i: self.reader.nbytes(i) for i in plan.admit})
        if batch is None:
            batch = self._assemble(plan, got)
            ahead = getattr(self.tail, "made_ahead", None)
            if ahead is not None and ahead(lambda: self._assemble(plan, got)) and _ragged(batch):
                self.abandon_ahead()  # the per-item tail runs it: what went into the capture made again outside it
                batch = self._assemble(plan, got)
        elif self.pass_keys:
            batch.update({k: stack([got[("pass", item)][k] for item, _ in plan.rows]) for k in self.pass_keys})
        ragged = _ragged(batch)
        if ragged:  # MONAI per item: it may write into its input, not the tier
            batch = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in batch.items()}
        self.values.into_tail(batch, [item for item, _ in plan.rows])
        # the user's transforms never see the loader's `_items`
        per = len(plan.rows) // max(len(plan.items), 1)  # a folded multi-sample crop's rows, item by item
        groups = [r // per for r in range(len(plan.rows))] if per * len(plan.items) == len(plan.rows) else None
        out, origin = (self._ragged_tail if ragged else self.tail).run(batch, groups)
        drawn = out.pop(DRAWN, None)  # the tail's draws alone (a host feeder's child): its work replayed where trained
        out["_items"] = torch.as_tensor([plan.rows[i][0] for i in origin], dtype=torch.int64)  # crops repeat items
        out = nested_batch(self.values.collate(out))
        if drawn is not None:
            out[DRAWN] = drawn
        return values_to(out, self.reader.device) if self.gpu else out

    def open_ahead(self) -> None:
        """The next batch's first capture opened now, where the tail captures (a feeder's child: `loaders.tail.graphs.
        Graphs.open_ahead`)."""
        opener = getattr(self.tail, "open_ahead", None)
        if opener is not None and self.gpu:
            opener(self.reader.device)

    def defer_checks(self) -> None:
        """The tail's checks read back without waiting, taken by `take_deferred` (a feeder's child)."""
        if hasattr(self.tail, "defer_checks"):
            self.tail.defer_checks = True

    def take_deferred(self) -> list[Any]:
        """The tail's deferred checks since the last call (`loaders.tail.checks.raise_checks` waits for them)."""
        taker = getattr(self.tail, "take_deferred", None)
        return taker() if taker is not None else []

    def abandon_ahead(self) -> None:
        """A capture opened ahead ended unlaunched, if any (on the thread that opened it)."""
        abandon = getattr(self.tail, "abandon_ahead", None)
        if abandon is not None:
            abandon()

    def _assemble(self, plan: BatchPlan, got: dict[Any, dict[str, Any]]) -> dict[str, Any]:
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

    # --- reads (loaders.reading.reads) and staging (loaders.reading.staging) ---
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


def _ragged(batch: dict[str, Any]) -> bool:
    return any(isinstance(v, list) for v in batch.values())
