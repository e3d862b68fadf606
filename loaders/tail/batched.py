"""The driver: walk the tail's transforms, run each one batched where a batched version exists, else per item.

A batched version (a "handler") is a function `handler(transform, batch) -> bool`. It first checks that it
can batch this input (returning False without drawing anything if not), then draws every item's parameters
through the MONAI transform's own `randomize()`, item by item in batch order, and finally applies the
operation to the whole batch with torch ops. Because each MONAI transform owns its random state, drawing
transform by transform gives exactly the draws of MONAI's item-by-item chain.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from loaders.tail.checks import raise_failed
from loaders.tail.graphs import Graphs, Segments
from loaders.tail.tailbatch import TailBatch, item_rows

_log = logging.getLogger("loaders.tail")

# MONAI class name -> (module, function) of its batched version. Matched on the exact MONAI class (a user's
# subclass may change the behaviour, so it runs per item through MONAI).
_HANDLERS: dict[str, tuple[str, str]] = {
    "Affined": ("loaders.tail.shape", "channels_folded"),
    "AsDiscreted": ("loaders.tail.shape", "as_discrete"),
    "BorderPadd": ("loaders.tail.shape", "channels_folded"),
    "CastToTyped": ("loaders.tail.shape", "whole_batch"),
    "CenterScaleCropd": ("loaders.tail.shape", "channels_folded"),
    "CenterSpatialCropd": ("loaders.tail.shape", "channels_folded"),
    "ConcatItemsd": ("loaders.tail.shape", "concat_items"),
    "CopyItemsd": ("loaders.tail.shape", "whole_batch"),
    "DeleteItemsd": ("loaders.tail.shape", "whole_batch"),
    "DivisiblePadd": ("loaders.tail.shape", "channels_folded"),
    "EnsureTyped": ("loaders.tail.shape", "whole_batch"),
    "Flipd": ("loaders.tail.shape", "channels_folded"),
    "MapLabelValued": ("loaders.tail.shape", "whole_batch"),
    "NormalizeIntensityd": ("loaders.tail.intensity", "normalize_intensity"),
    "OneOf": ("loaders.tail.choice", "one_of"),
    "Rand2DElasticd": ("loaders.tail.elastic", "rand_2d_elastic"),
    "Rand3DElasticd": ("loaders.tail.elastic", "rand_3d_elastic"),
    "RandAdjustContrastd": ("loaders.tail.fired", "rand_adjust_contrast"),
    "RandAffined": ("loaders.tail.affine", "rand_affine"),
    "RandAxisFlipd": ("loaders.tail.flips", "rand_axis_flip"),
    "RandBiasFieldd": ("loaders.tail.fired", "rand_bias_field"),
    "RandCoarseDropoutd": ("loaders.tail.fired", "rand_coarse_dropout"),
    "RandCoarseShuffled": ("loaders.tail.fired", "fired_whole"),
    "RandCropByLabelClassesd": ("loaders.tail.crops", "rand_crop_by_label_classes"),
    "RandCropByPosNegLabeld": ("loaders.tail.crops", "rand_crop_by_pos_neg_label"),
    "RandFlipd": ("loaders.tail.flips", "rand_flip"),
    "RandGaussianNoised": ("loaders.tail.intensity", "rand_gaussian_noise"),
    "RandGaussianSharpend": ("loaders.tail.fired", "rand_gaussian_sharpen"),
    "RandGaussianSmoothd": ("loaders.tail.sparse", "rand_gaussian_smooth"),
    "RandGibbsNoised": ("loaders.tail.fired", "fired_whole"),
    "RandHistogramShiftd": ("loaders.tail.fired", "rand_histogram_shift"),
    "RandKSpaceSpikeNoised": ("loaders.tail.fired", "fired_whole"),
    "RandLambdad": ("loaders.tail.fired", "fired_whole"),
    "RandRicianNoised": ("loaders.tail.fired", "fired_whole"),
    "RandRotate90d": ("loaders.tail.flips", "rand_rotate90"),
    "RandRotated": ("loaders.tail.sparse", "rand_rotate"),
    "RandScaleCropd": ("loaders.tail.crops", "rand_spatial_crop"),
    "RandScaleIntensityd": ("loaders.tail.intensity", "rand_scale_intensity"),
    "RandShiftIntensityd": ("loaders.tail.intensity", "rand_shift_intensity"),
    "RandSimulateLowResolutiond": ("loaders.tail.fired", "fired_whole"),
    "RandSpatialCropSamplesd": ("loaders.tail.crops", "rand_spatial_crop_samples"),
    "RandSpatialCropd": ("loaders.tail.crops", "rand_spatial_crop"),
    "RandStdShiftIntensityd": ("loaders.tail.fired", "rand_std_shift_intensity"),
    "RandWeightedCropd": ("loaders.tail.crops", "rand_weighted_crop"),
    "RandZoomd": ("loaders.tail.sparse", "rand_zoom"),
    "ResizeWithPadOrCropd": ("loaders.tail.shape", "channels_folded"),
    "Resized": ("loaders.tail.shape", "channels_folded"),
    "Rotate90d": ("loaders.tail.shape", "channels_folded"),
    "Rotated": ("loaders.tail.shape", "channels_folded"),
    "ScaleIntensityRanged": ("loaders.tail.shape", "whole_batch"),
    "ScaleIntensityd": ("loaders.tail.intensity", "scale_intensity"),
    "SpatialCropd": ("loaders.tail.shape", "channels_folded"),
    "SpatialPadd": ("loaders.tail.shape", "channels_folded"),
    "SqueezeDimd": ("loaders.tail.shape", "squeeze_dim"),
    "ThresholdIntensityd": ("loaders.tail.shape", "whole_batch"),
    "ToTensord": ("loaders.tail.shape", "whole_batch"),
    "Zoomd": ("loaders.tail.shape", "channels_folded"),
}

Handler = Callable[[Any, "TailBatch"], bool]


def batched_names() -> list[str]:
    """Names of the MONAI transforms that run batched (every other transform runs per item through MONAI)."""
    return sorted(_HANDLERS)


def _handler(transform: Any) -> Handler | None:
    cls = type(transform)
    if not cls.__module__.startswith("monai.transforms.") or cls.__name__ not in _HANDLERS:
        return None
    module, name = _HANDLERS[cls.__name__]
    handler: Handler = getattr(importlib.import_module(module), name)
    return handler


def _per_item(transform: Any, batch: TailBatch) -> None:
    """Run a MONAI transform item by item (a list output, e.g. num_samples crops, becomes consecutive items).
    The head's nested outputs (ClassesToIndicesd's list, cached as "key/0", "key/1", ...) reach MONAI as it
    made them; what comes back is flat again."""
    from loaders.cache.nesting import flat_again, nested

    outs: list[dict[Hashable, Any]] = []
    sources: list[int] = []
    for rows in _monai_items(transform, batch):
        given = [nested(batch.item(i)) for i in rows]
        out = transform([item for item, _ in given] if len(rows) > 1 else given[0][0])
        out = out if isinstance(out, list) else [out]
        keys = given[0][1]
        outs.extend(flat_again(o, keys) for o in out)
        sources.extend(rows if len(out) == len(rows) else [rows[0]] * len(out))
    batch.set_items(outs, sources)


def _monai_items(transform: Any, batch: TailBatch) -> list[list[int]]:
    """The rows each call of `transform` gets: one row at a time, except where MONAI hands a Compose (`OneOf`,
    `SomeOf`, `RandomOrder`, ...) an item's whole list of samples (MONAI 1.5 on: one choice per item, for all
    of its samples), which is then the rows of one item."""
    from monai.transforms import Compose

    if not isinstance(transform, Compose) or not _compose_takes_lists():
        return item_rows(None, batch.n)
    return item_rows(batch.groups, batch.n)


def _compose_takes_lists() -> bool:
    """Whether this MONAI's `apply_transform` hands a list to a Compose whole (1.5 on) rather than item by item."""
    import monai

    major, minor = (int(x) for x in monai.__version__.split(".")[:2])
    return (major, minor) >= (1, 5)


def _walk(transforms: Sequence[Any], map_items: Any) -> list[Any]:
    """The transforms in order, nested Composes inlined by `Compose.flatten`'s rule. Not `flatten()` itself:
    it builds a new Compose, and building one reseeds every transform in it (the caller's seeding is lost)."""
    from monai.transforms import Compose

    out: list[Any] = []
    for t in transforms:
        if type(t) is Compose and t.map_items == map_items:
            out += _walk(t.transforms, map_items)
        else:
            out.append(t)
    return out


def _eager(compose: Any, flat: list[Any]) -> bool:
    """Whether `compose` applies its transforms one after the other, eagerly, mapping list outputs."""
    lazy = compose.lazy
    if lazy is None:  # each transform's own flag decides
        lazy = any(getattr(t, "lazy", False) is True for t in flat)
    return lazy is False and compose.map_items in (True, 1) and not compose.unpack_items


def _repeats(transforms: Sequence[Any]) -> bool:
    """Whether one transform object appears twice: MONAI draws its numbers item by item through the chain
    (item 0's both uses, then item 1's), so the chain must run per item to draw them in that order."""
    return len({id(t) for t in transforms}) < len(transforms)


class _Sequence:
    """Transforms applied one after the other to one item, list outputs mapped as Compose maps them (a
    Compose is not built here: building one would re-seed the transforms)."""

    def __init__(self, transforms: Sequence[Any]) -> None:
        self.transforms = list(transforms)

    def __call__(self, data: Any) -> Any:
        from monai.transforms import apply_transform

        for t in self.transforms:
            data = apply_transform(t, data, map_items=True)
        return data


class BatchedTail:
    """The random tail of a MONAI chain run over whole batches, on the batch's device.

    `transform` is a MONAI Compose, a list of transforms or one dictionary transform. `device`, if given,
    is where batch tensors are moved first; otherwise the tail runs where the batch already is.
    """

    def __init__(self, transform: Any, device: Any = None) -> None:
        from monai.transforms import Compose

        if isinstance(transform, Compose):
            self._compose: Any = transform
            flat = _walk(transform.transforms, transform.map_items)
            # OneOf / SomeOf / RandomOrder (one random choice per item), lazy resampling (MONAI fuses the
            # spatial transforms into one resample) or other item mapping: the whole chain runs per item
            whole = type(transform) is not Compose or not _eager(transform, flat) or _repeats(flat)
            self.transforms = [transform] if whole else flat
        else:
            self._compose = None  # a list is seeded as Compose(list) would seed it, built only when seeding
            self._items = list(transform) if isinstance(transform, (list, tuple)) else [transform]
            self.transforms = _walk(self._items, True)
            if _repeats(self.transforms):
                self.transforms = [_Sequence(self.transforms)]
        self.device = device
        self._graphs = Graphs()
        # the batch's checks read back without waiting, taken by `take_deferred` and waited for by `raise_checks`
        # (a feeder's child: where the batch is sent, so that waiting for the flags does not split its work in two)
        self.defer_checks = False
        self._pending: list[Any] = []  # `loaders.tail.checks.Deferred`
        self._rows: Any = None  # their host rows (`loaders.tail.checks.FlagRows`), made at the first deferred check
        self._handlers = [_handler(t) for t in self.transforms]
        self._replay: Any = None  # `loaders.tail.replay.ReplayedTail`, made at the first batch on a CUDA device
        # a host feeder's child (`loaders.fast.hostfeed`): a batch every transform of which has a plan gets its draws
        # alone, as its `DRAWN` entry; the process that trains replays the work from them (`replay_drawn`)
        self.draw_only = False
        self.replay_done: Any = None
        self._first: Any = None  # the first batch's entries as meta tensors (`drawable`)
        self._fallbacks = [type(t).__name__ for t, h in zip(self.transforms, self._handlers) if h is None]
        if self._fallbacks:
            _log.warning("BatchedTail: per item through MONAI (no batched version): %s", ", ".join(self._fallbacks))

    @property
    def fallbacks(self) -> list[str]:
        """Names of the transforms that ran (or will run) per item through MONAI."""
        return list(self._fallbacks)

    def set_random_state(self, seed: int | None = None, state: Any = None) -> BatchedTail:
        """Seed the underlying MONAI transforms exactly as `Compose.set_random_state` does."""
        from monai.transforms import Compose

        compose = self._compose if self._compose is not None else Compose(self._items)
        compose.set_random_state(seed=seed, state=state)
        return self

    def __call__(self, batch: Mapping[Any, Any]) -> dict[Hashable, Any]:
        return self.run(batch)[0]

    def take_deferred(self) -> list[Any]:
        """The checks of the batches run since (`defer_checks`), to give `raise_checks` once their work is queued."""
        pending, self._pending = self._pending, []
        return pending

    def _defer(self, checks: list[tuple[Any, BaseException]]) -> Any:
        """The checks copied back without waiting (`defer_checks`), or None where they are raised here."""
        if not self.defer_checks or not checks:
            return None
        if self._rows is None:
            from loaders.tail.checks import FlagRows

            self._rows = FlagRows()
        return self._rows.read(checks)

    def open_ahead(self, device: Any) -> None:
        """The next batch's first capture opened now (`loaders.tail.graphs.Graphs.open_ahead`)."""
        self._graphs.open_ahead(device)

    def made_ahead(self, redo: Any) -> bool:
        """Whether the batch's assembly just made went into a capture opened ahead (`redo` makes it again)."""
        return self._graphs.made_ahead(redo)

    def abandon_ahead(self) -> None:
        """A capture opened ahead ended unlaunched (a batch this tail will not run, or one read from the host)."""
        self._graphs.abandon_ahead()

    def run(
        self, batch: Mapping[Any, Any], groups: Sequence[int] | None = None
    ) -> tuple[dict[Hashable, Any], list[int]]:
        """(the tail's batch, the input item each output item came from: num_samples crops repeat it).
        `groups`: the MONAI item each input row is a sample of, where a multi-sample crop was made before."""
        from loaders.tail.graphs import Rewind

        tb = TailBatch.from_batch(batch, self.device, groups)
        if self._first is None:
            self._first = _meta(tb.data)
        if self.draw_only and self._drawn_only(tb):
            return tb.result(), tb.origin
        if self._replayed(tb):
            self._checked(tb.checks)
            return tb.result(), tb.origin
        segments = self._graphs.begin(tb)
        index = 0
        while True:
            try:
                while index < len(self.transforms):
                    self._step(index, tb, segments)
                    index += 1
                if segments is not None:
                    segments.close(tb)
                self._checked(tb.checks)
                return tb.result(), tb.origin
            except Rewind as back:  # a capture failed: its segment undone, to run again uncaptured
                index = back.index

    def _checked(self, checks: list[tuple[Any, BaseException]]) -> None:
        """The batch's checks raised here, or deferred (`defer_checks`)."""
        deferred = self._defer(checks)
        if deferred is None:
            raise_failed(checks)
        else:
            self._pending.append(deferred)

    def _replayer(self) -> Any:
        if self._replay is None:
            from loaders.tail.replay import ReplayedTail

            self._replay = ReplayedTail(self.transforms)
        return self._replay

    def drawable(self) -> bool | None:
        """Whether batches like the first this tail ran could get their draws alone here and their work replayed
        in another process (a host feeder's: `ReplayedTail.drawable`); None before a first batch."""
        if self._first is None:
            return None
        return bool(self._first) and self._replayer().drawable(self._first)

    def _drawn_only(self, tb: TailBatch) -> bool:
        """Whether the batch got its draws alone (`draw_only`), its work left to `replay_drawn` elsewhere."""
        from loaders.tail.replay import DRAWN, Drawings

        if not self._replayer().drawable(tb.data):
            return False
        tb.data[DRAWN] = Drawings(self._replay.draw(tb.data))
        return True

    def replay_drawn(self, batch: dict[Hashable, Any], device: Any) -> dict[Hashable, Any]:
        """A batch made with `draw_only` (its tensors on the host, its `DRAWN` entry) through the tail's work on
        `device`; a batch without that entry (its tail run where it was made) as it is. After it, `replay_done` is
        the CUDA event once its host tensors are read (None where nothing read them asynchronously)."""
        from loaders.tail.replay import DRAWN

        self.replay_done = None
        if DRAWN not in batch:
            return batch
        drawn = batch.pop(DRAWN).drawn
        items = batch.pop("_items", None)  # the loader's, kept on the host
        out = self._replayer().replay(batch, drawn, device)
        self.replay_done = self._replay.done
        if items is not None:
            out["_items"] = items
        return out

    def _replayed(self, tb: TailBatch) -> bool:
        """Whether the batch went through the tail replayed from its plans (`loaders.tail.replay`: on a CUDA device,
        every transform planned for its shapes and dtypes)."""
        import torch

        from loaders import tunables
        from loaders.tail import graphs

        wanted = tunables.TAIL_REPLAY
        if wanted is False or (wanted == "here" and graphs.in_feeder):
            return False
        cuda = [v for v in tb.data.values() if isinstance(v, torch.Tensor) and v.is_cuda]
        if not cuda or torch._C._autograd._profiler_enabled():
            return False  # under the profiler, each transform's kernels as launched (`_marked`)
        if not self._replayer().covers(tb.data):
            return False
        self._graphs.abandon_ahead(tb)  # a capture opened ahead holds the batch's assembly: made again outside it
        tb.data = self._replay.run(tb.data)
        tb.checks.extend(self._replay.checks)
        return True

    def _step(self, index: int, tb: TailBatch, segments: Segments | None) -> None:
        """Transform `index` on the batch: batched (captured into the open CUDA graph where `segments` takes
        it), else per item through MONAI."""
        t, handler = self.transforms[index], self._handlers[index]
        with _marked(t):
            tb.try_stack()
            capture = segments is not None and handler is not None and segments.takes(index, t)
            if segments is not None and not capture:
                segments.close(tb)
            if handler is not None and tb.items is None:
                done = segments.captured(index, t, handler, tb) if capture and segments else handler(t, tb)
                if done:
                    return
            if segments is not None:
                segments.close(tb)
            if handler is not None:
                self._note_fallback(t)
            _per_item(t, tb)

    def _note_fallback(self, transform: Any) -> None:
        name = type(transform).__name__
        if name not in self._fallbacks:
            self._fallbacks.append(name)
            _log.warning("BatchedTail: %s runs per item through MONAI for this input", name)


def _marked(transform: Any) -> Any:
    """Where torch's profiler is on, a range named `tail:` and the transform's class around its work (what it
    launches, by transform: `python -m workflows.bench.profile_train --loader-only --ops`); else nothing."""
    import torch

    if not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"tail:{type(transform).__name__}")


def _meta(data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
    """A batch's tensors as meta tensors of their shapes and dtypes (the rest as it is); {} without a tensor."""
    import torch

    if not any(isinstance(v, torch.Tensor) for v in data.values()):
        return {}
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
            for k, v in data.items()}  # fmt: skip
