"""MONAI face: a drop-in for `PersistentDataset` that reads the deterministic head's output from a prepared
cache and applies the random tail at training time, exactly as MONAI's pipeline would.

A training script changes one line::

    ds = PersistentDataset(data, transform, cache_dir="pt_cache")          # before
    ds = PreparedPersistentDataset(data, transform, cache_dir="prepared")   # after (`prep cache` made it)

The cache must have been prepared with the same head: `loaders.cache.chain.fingerprint` of this transform's head
must equal the manifest's "fingerprint", else StaleError says so.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from loaders import args
from loaders.backends import Backend
from loaders.cache import chain
from loaders.cache.chain import tail_compose
from loaders.cache.meta import entry_key, line_source
from loaders.cache.nesting import to_jsonable
from loaders.cache.spec import MANIFEST, PENDING
from loaders.errors import StaleError
from loaders.faces.monai_crop import ask_batch_pages, cropping, leading_crop
from loaders.faces.monai_fill import Fill
from loaders.faces.monai_pending import is_pending, pending_fill, record_reader
from loaders.fast.folds import Fold
from loaders.reading.mappings import own_storage
from loaders.state import keep_random_states

__all__ = ["PersistentCore", "dropin_device"]

# PersistentDataset options with no meaning over a prepared cache (accepted, so the one-line change works)
_PERSISTENT_ONLY = ("hash_func", "pickle_module", "pickle_protocol", "hash_transform", "reset_ops_id", "weights_only")
# PreparedDataset options the drop-in passes on (the others it sets itself)
_DATASET_OPTIONS = ("keys", "roi", "backend_options")
# Compose options that change how transforms are applied; the tail keeps the user's settings.


def _key(entry: Any) -> str:
    return json.dumps(to_jsonable(entry), sort_keys=True)


def _resolved(value: Any, bases: Sequence[Path]) -> Any:
    """A datalist entry with every string that names an existing file (absolute, or relative to one of
    `bases`, first match wins) replaced by its real path: entries match whatever folder they were loaded
    from (a datalist read through a relative path gives relative paths)."""
    if isinstance(value, Mapping):
        return {k: _resolved(v, bases) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_resolved(v, bases) for v in value]
    if isinstance(value, str) and value:
        for base in [Path()] if os.path.isabs(value) else bases:
            path = base / value
            if path.exists():
                return os.path.realpath(path)
    return value


def _strings(value: Any) -> Iterator[str]:
    """Every string of a datalist entry (nested in dicts and lists)."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _source_bases(manifest: Mapping[str, Any]) -> list[Path]:
    """Where a cache's relative source paths may be relative to: the current folder, then the prepared
    datalist's folder and its parents (prep ran in one of them when it was given a relative datalist)."""
    bases = [Path.cwd()]
    datalist = manifest.get("datalist")
    if isinstance(datalist, str) and os.path.isabs(datalist):
        bases += [Path(datalist).parent, *Path(datalist).parent.parents]
    return bases


def _leaves(t: Any) -> int:
    """How many transforms `t` is in the flattened chain (`chain.split` flattens plain Composes only)."""
    from monai.transforms import Compose

    return sum(_leaves(c) for c in t.transforms) if type(t) is Compose else 1


def run_from(
    node: Any, data: Any, start: int, first: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
) -> Any:
    """Apply the transforms of Compose `node` from flattened index `start` on, in the user's nesting, as
    PersistentDataset applies them (each Compose maps its members over a list of samples member by member:
    flattening the tail changes which sample sees another's in-place writes through shared crops).
    `first()`: a context the transform at `start` runs in (a label-driven crop under its sets)."""
    from monai.transforms import Compose

    pos = 0
    for i, child in enumerate(node.transforms):
        n = _leaves(child)
        if pos + n <= start:
            pos += n
            continue
        if type(child) is Compose and (pos < start or first is not None):
            data = run_from(child, data, start - pos, first)
        elif first is not None:  # pos == start: the transform `first` wraps
            with first():
                data = node(data, start=i, end=i + 1)
        else:
            return node(data, start=i)
        return node(data, start=i + 1) if i + 1 < len(node.transforms) else data
    return data


def dropin_device(transform: Any, device: str | None = None) -> str:
    """Where the drop-in puts each output tensor: `device` when given, else where the head put it (its last
    device-setting transform, `loaders.cache.chain.head_device`: seed 000's `EnsureTypeD(device="cuda:0")` gives
    "cuda:0", as MONAI's PersistentDataset gives its tensors back there), else "cpu"."""
    if device is not None:
        return str(device)
    with keep_random_states(transform):  # splitting the chain re-seeds it
        head, _ = chain.split(transform)
    return chain.head_device(head) or "cpu"


def _persistent_keeps_types() -> bool:
    """True where MONAI's PersistentDataset saves the head's output as it is (MONAI 1.4: numpy arrays stay
    numpy); from MONAI 1.5 it converts every array to a (Meta)Tensor before saving."""
    import inspect

    from monai.data.dataset import PersistentDataset  # its module: a swapped monai.data name is not MONAI's class

    return "track_meta" not in inspect.signature(PersistentDataset).parameters


def _persistent_track_meta() -> bool:
    """MONAI's PersistentDataset default for track_meta: its argument's default (False) from MONAI 1.5; MONAI
    1.4 (HPC containers with torch 2.3) has no such argument and gives the head's MetaTensors back."""
    import inspect

    from monai.data.dataset import PersistentDataset  # its module: a swapped monai.data name is not MONAI's class

    param = inspect.signature(PersistentDataset).parameters.get("track_meta")
    return True if param is None else bool(param.default)


def _persistent_runs_whole(transform: Any) -> bool:
    """True where MONAI's PersistentDataset caches nothing of this chain: its rule looks at the top-level
    transforms only, and the first is random by it (any Compose is Randomizable, even one of deterministic
    transforms; a plain function), so every item runs the whole chain and keeps the head's types and
    MetaTensors whatever track_meta says. The drop-in reads the head from its cache and gives it so."""
    from monai.transforms import RandomizableTrait, Transform

    first = list(transform.transforms[:1])
    return bool(first) and (isinstance(first[0], RandomizableTrait) or not isinstance(first[0], Transform))


def _persistent_arguments(
    data: Any, transform: Any, cache_dir: Any, positional: Sequence[Any], options: dict[str, Any]
) -> tuple[dict[str, Any], bool | None]:
    """PersistentDataset's arguments, bound as the installed MONAI binds them (its positional order, its
    names and defaults; a wrong one is its TypeError), taken out of `options`; and track_meta as given (None:
    not given), which MONAI 1.4 does not take and the drop-in does."""
    import inspect

    from monai.data.dataset import PersistentDataset  # its module: a swapped monai.data name is not MONAI's class

    signature = inspect.signature(PersistentDataset.__init__)
    names = list(signature.parameters)[4:]  # after self, data, transform, cache_dir
    track_meta = None if "track_meta" in names else options.pop("track_meta", None)
    given = {name: options.pop(name) for name in names if name in options}
    arguments = dict(signature.bind(None, data, transform, cache_dir, *positional, **given).arguments)
    del arguments["self"]
    if "track_meta" in names:
        track_meta = arguments.get("track_meta")
        if track_meta is None:
            arguments.pop("track_meta", None)  # MONAI's default
    return arguments, track_meta


def _persistent_head_len(transform: Any) -> int:
    """How many transforms MONAI's PersistentDataset runs before its tail (its rule: the top-level transforms up
    to the first random one, or anything that is no Transform; a Compose counts as random)."""
    from monai.transforms import RandomizableTrait, Transform

    first = transform.get_index_of_first(lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform))
    return len(transform.transforms) if first is None else int(first)


def _compose(head: list[Any], transform: Any) -> Any:
    """The head as a Compose with the user's Compose options (its transforms keep their random states)."""
    from monai.transforms import Compose

    with keep_random_states(transform):
        return Compose(head, **chain.compose_options(transform))


def _section(manifest: Mapping[str, Any]) -> str:
    """The datalist section the drop-in's own records name: the cache's first ("training" by default)."""
    sections = manifest.get("sections")
    return str(sections[0]) if isinstance(sections, list) and sections else "training"


def _file_based(data: Sequence[Any]) -> bool:
    """True where every entry is a datalist entry the prepared layout keys by (a dict or a path); numpy
    arrays, tensors, lists and numbers are data in memory, which PersistentDataset hashes as they are."""
    return all(isinstance(e, (Mapping, str, os.PathLike)) for e in data)


def _serves(cache_dir: Any, transform: Any, data: Sequence[Any], pending: bool = False) -> bool:
    """True where the prepared layout serves: a prepared cache at `cache_dir` (with `pending`: a pending one, or
    a new or empty folder, `loaders.faces.monai_pending.is_pending`), a transform and file-based data; else
    PersistentDataset's own code runs (its `<hash>.pt` files, or no cache for cache_dir=None)."""
    if cache_dir is None or transform is None or not _file_based(data):
        return False
    return is_pending(cache_dir) if pending else (Path(cache_dir) / MANIFEST).is_file()


class PersistentCore:
    """`PersistentDataset(data, transform, cache_dir)` over a prepared cache: head read, tail applied.

    data: the datalist entries (as for MONAI; matched to cache items by their source entry). transform:
    the full pipeline (Compose or list). cache_dir: the `prep cache` output (or a new or empty folder: a pending
    cache). track_meta: as MONAI's
    PersistentDataset (default: the installed MONAI's, False; MONAI 1.4 has no such option and keeps meta):
    False gives the head's output as plain tensors, as
    PersistentDataset reads them back from its cache (the tail then makes MetaTensors, as it does there);
    True restores the head's MetaTensors with all their meta (PersistentDataset(track_meta=True)); its
    numpy arrays come back as numpy arrays under MONAI 1.4 and as MetaTensors from 1.5, as there.
    device: where the output tensors go; None: where the head put them (`dropin_device`). backend, verify and
    other options (keyword-only): as for PreparedDataset. PersistentDataset's own arguments come in its order
    and are kept as its attributes. A `monai.data.PersistentDataset` (the class in `loaders.faces.monai_data`):
    where no prepared cache serves (cache_dir=None, a folder that holds files of its own or of anything but
    blockprep, transform=None, data in memory) its own code runs, unchanged. A new or empty folder becomes a
    pending prepared cache (`loaders.faces.monai_pending`), filled with the items as they are computed, which
    `prep cache` then commits.
    """

    transform: Any  # a Compose, set by monai.data.Dataset.__init__
    data: Sequence[Any]
    dataset: Any  # the committed cache's PreparedDataset; None over a pending cache
    _crop: Fold | None  # the tail's leading crop (`loaders.faces.monai_crop`)

    def __init__(
        self,
        data: Sequence[Any],
        transform: Any,
        cache_dir: str | os.PathLike[str] | None = None,
        *persistent: Any,
        backend: str | Backend = "auto",
        device: str | None = None,
        verify: bool = False,
        **options: Any,
    ) -> None:
        arguments, track_meta = _persistent_arguments(data, transform, cache_dir, persistent, options)
        args.check_dropin(data, transform, cache_dir, track_meta, [n for n in options if n not in _DATASET_OPTIONS])
        super().__init__(**arguments)  # type: ignore[call-arg]  # PersistentDataset's: a list becomes a Compose
        self._prepared = _serves(cache_dir, transform, data)
        pending = not self._prepared and _serves(cache_dir, transform, data, pending=True)
        if not (self._prepared or pending):
            return  # PersistentDataset's own behaviour throughout (docs/loaders.md says when and why)
        self._prepared, mine = True, set(self.__dict__)
        self._reset_ops_id = bool(arguments.get("reset_ops_id", True))  # what an item computed here keeps
        self.track_meta = _persistent_track_meta() if track_meta is None else track_meta
        whole = _persistent_runs_whole(self.transform)
        assert cache_dir is not None
        reading: dict[str, Any] = {"device": dropin_device(self.transform, device), "meta": self.track_meta or whole}
        reading["leaf_types"] = _persistent_keeps_types() or whole
        with keep_random_states(self.transform):  # splitting the chain re-seeds it
            head = chain.split(self.transform)[0]
            self.tail = tail_compose(self.transform)
            self._head_len = len(head)
            # the head the cache holds, where it is not the part PersistentDataset runs before its tail
            self._head = None if _persistent_head_len(self.transform) == len(head) else _compose(head, self.transform)
            try:
                if pending:  # no prepared cache yet: items are records or computed (monai_pending)
                    self.dataset, self._crop = None, None
                    self._fill = pending_fill(Path(cache_dir), self.transform, head)
                    self._record = record_reader(**reading, keys=options.get("keys"))
                else:
                    self._open(cache_dir, backend, verify, reading, options)
            except StaleError:
                if arguments.get("hash_transform") is None:
                    raise
                # MONAI keys its files by the transform's hash here, so one folder serves several transforms:
                # a cache of another head is left alone and this transform's items are MONAI's own files (the
                # attributes set meanwhile go: MONAI's seeding walks them)
                for name in set(self.__dict__) - mine:
                    del self.__dict__[name]
                self._prepared = False
                return
        self._crop_lock = threading.Lock()
        self._built_in = os.getpid()  # a copy in another process (a DataLoader worker's) shares no transform
        self._items: dict[str, int] | None = None
        # position -> a copy of the entry found at the same position in the cache: an entry still equal to it
        # needs no meta line read and no JSON key (a third of an item's Python on 64x64 MedNIST items)
        self._in_place: dict[int, Any] = {}
        self._check_quarantine()

    def _open(
        self, cache_dir: Any, backend: str | Backend, verify: bool, reading: dict[str, Any], options: dict[str, Any]
    ) -> None:
        """The committed cache at `cache_dir` read as PreparedDataset reads it, its head checked against this
        transform's; its drop-in records (`loaders.faces.monai_fill`) keyed by its fingerprint."""
        from loaders.faces.torch_data import PreparedDataset

        self.dataset = PreparedDataset(cache_dir, backend=backend, verify=verify, **reading, **options)
        chain.check_fingerprint(self.transform, self.dataset.cache.manifest, str(self.dataset.root / MANIFEST))
        self._crop = leading_crop(self.tail, self.dataset.cache)
        manifest = self.dataset.cache.manifest
        self._fill = Fill(self.dataset.root, str(manifest.get("fingerprint")), _section(manifest))
        self._record = self.dataset.read_record

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its lock (DataLoader workers started by spawn or forkserver get a new one)."""
        return {k: v for k, v in self.__dict__.items() if k != "_crop_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._crop_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.data)

    def set_data(self, data: Sequence[Any]) -> None:
        """Replace the datalist (scripts swap folds with it), as PersistentDataset.set_data does. The prepared
        cache is kept; entries not in it are computed when first read and written into it (`_computed`). Without
        a prepared cache, PersistentDataset's: its cache files are deleted (never a prepared cache's)."""
        if self._prepared and not _file_based(data):
            self._prepared = False  # in-memory data: PersistentDataset's own files from now on
        if not self._prepared:
            self._set_persistent_data(data)
            return
        self.data = data
        self._in_place = {}
        self._check_quarantine()

    def _check_quarantine(self) -> None:
        """Refuse, when built, a datalist naming an entry `prep cache` quarantined (rather than at the first
        batch that reaches it): its file is bad, and re-running `prep cache` once it is fixed prepares it."""
        if self.dataset is None:
            return  # a pending cache: nothing quarantined yet
        quarantined = self.dataset.cache.manifest.get("quarantined") or []
        if not quarantined:
            return
        bases = _source_bases(self.dataset.cache.manifest)
        mine = [_resolved(e, [Path.cwd()]) for e in self.data]
        # only quarantined entries that name a file this datalist names (by base name, of the path as listed or
        # as resolved) are resolved: a stat each, where a crafted manifest may list hundreds of thousands
        names = {os.path.basename(v) for e in (*self.data, *mine) for v in _strings(e)}
        near = (
            q
            for q in quarantined
            if isinstance(q, Mapping) and names & {os.path.basename(v) for v in _strings(q.get("source"))}
        )
        why = {_key(_resolved(q.get("source"), bases)): q for q in near}
        hits = [(i, why[k]) for i, k in enumerate(_key(e) for e in mine) if k in why]
        if hits:
            i, q = hits[0]
            raise StaleError(
                f"{self.dataset.root}: data[{i}] ({q.get('path') or q.get('source')}) was quarantined by `prep "
                f"cache` ({str(q.get('reason'))[:120]}){f' with {len(hits) - 1} more' if len(hits) > 1 else ''}; "
                "fix or restore the file and re-run `prep cache` (it prepares such items again), or leave the "
                "entry out of data"
            )

    def _lookup(self, index: int) -> int | None:
        """The cache item holding data[index]: same position when the sources agree, else by source entry
        (file paths compared as real paths); None when the cache has none (a new or changed entry)."""
        if self.dataset is None:
            return None  # a pending cache: no committed item
        cache = self.dataset.cache
        if self._items is None:
            entry = self.data[index]
            if index in self._in_place and self._in_place[index] == entry:  # a rebuilt cache: the read refuses
                return index
            line = cache.meta(index) if index < len(cache) else None
            if line is not None and _key(line_source(line)) == _key(entry):
                self._in_place[index] = copy.deepcopy(entry)
                self.dataset.hand_meta(index, line)  # the item's first read needs it too
                return index
            bases = _source_bases(cache.manifest)
            self._items = {_key(_resolved(line_source(cache.meta(i)), bases)): i for i in range(len(cache))}
        return self._items.get(_key(_resolved(self.data[index], [Path.cwd()])))

    def _computed(self, index: int) -> Any:
        """data[index], which the prepared cache lacks, as PersistentDataset gives an item it has no file for:
        MONAI's own PersistentDataset (no cache folder) runs the head on a copy of the entry in this process,
        then the rest of the chain with the same transform objects, so the random draws follow the user's
        seeding. In between, the head's output is written into the prepared cache as a drop-in record
        (`loaders.faces.monai_fill`: this process's own files), which later reads use (`_journaled`) and the
        next `prep cache` run takes (docs/loaders.md)."""
        from monai.data.dataset import PersistentDataset  # its module: a swapped monai.data name is not MONAI's class

        entry = self.data[index]
        once = PersistentDataset([entry], self.transform, cache_dir=None, reset_ops_id=self._reset_ops_id)
        pre = once._cachecheck(entry)  # as its _transform: the head on a copy of the entry
        source = to_jsonable(entry)
        head = self._head
        self._fill.write(
            entry_key(self._fill.section, source),
            source,
            (lambda: pre) if head is None else (lambda: head(copy.deepcopy(entry))),
        )
        return once._post_transform(pre)

    def _journaled(self, index: int) -> Any:
        """The head's output of data[index] from a drop-in record (written by this or another process), read
        as a committed item is read (`PreparedDataset.read_record`); None where there is none to trust."""
        found = self._fill.find(entry_key(self._fill.section, to_jsonable(self.data[index])))
        return None if found is None else self._record(*found)

    def _set_persistent_data(self, data: Sequence[Any]) -> None:
        """PersistentDataset.set_data, except in a folder that also holds a prepared cache (or a pending one):
        there only PersistentDataset's own files (`<hash>.pt`) go."""
        cache_dir = getattr(self, "cache_dir", None)
        if cache_dir is None or not any((Path(cache_dir) / name).is_file() for name in (MANIFEST, PENDING)):
            super().set_data(data)  # type: ignore[misc]
            return
        self.data = data
        for stale in Path(cache_dir).glob("*.pt"):
            stale.unlink(missing_ok=True)

    def _transform(self, index: int) -> Any:
        # monai.data.Dataset.__getitem__ handles slices and index lists, then calls this per item
        if not self._prepared:
            return super()._transform(index)  # type: ignore[misc]
        item = self._lookup(int(index))
        if item is None:
            head = self._journaled(int(index))
            if head is None:
                return self._computed(int(index))
            return head if self.tail is None else own_storage(run_from(self.transform, head, self._head_len))
        if self.tail is None:
            return self.dataset.read(item)
        return self._tail_of(item, self.dataset.read(item, mapped=True))

    def _tail_of(self, item: int, head: Any, asked: bool = False) -> Any:
        """The tail over cache item `item`'s head, read mapped (its output leaves through own_storage). MONAI crops;
        the crop's pages are asked for first (unless `asked`), and a label-driven crop draws from the cache's sets."""
        if self._crop is None:
            return own_storage(run_from(self.transform, head, self._head_len))
        crop, lock = self._crop, self._crop_lock
        first = lambda: cropping(crop, item, head, lock, ask=not asked)  # noqa: E731
        return own_storage(run_from(self.transform, head, self._head_len, first))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """`[self[i] for i in indices]`, what torch's DataLoader fetches for a batch, with the pages of every
        item's leading crop asked for at once first: a batch's reads in flight together, not item by item. Where
        an index is not a committed item (computed, or a drop-in record), or threads share the transform (thread
        workers: another thread's draws would come between), item by item."""
        # a batch's windows are drawn ahead only where no other thread draws from the same transform meanwhile:
        # in another process (a DataLoader worker's copy), or on this process's main thread (no thread workers)
        prepared = self._prepared and self.tail is not None
        alone = prepared and (os.getpid() != self._built_in or threading.current_thread() is threading.main_thread())
        crop = self._crop if alone else None
        items = [self._lookup(int(i)) for i in indices] if crop is not None else [None]
        if crop is None or any(item is None for item in items):
            return [self[i] for i in indices]  # type: ignore[index]  # MONAI's Dataset.__getitem__
        heads = [(item, self.dataset.read(item, mapped=True)) for item in items if item is not None]
        ask_batch_pages(crop, heads, self._crop_lock)
        return [self._tail_of(item, head, asked=True) for item, head in heads]

    def set_random_state(self, seed: int | None = None) -> Any:
        """Seed `transform` (its Compose), whose random transforms the tail runs: the seed each one draws is
        then the one it draws under PersistentDataset, where MONAI's DataLoader (num_workers=0) seeds the
        dataset's `transform` (seeding a Compose of the tail alone gave its members other seeds)."""
        if (
            not self._prepared and seed is not None
        ):  # as MONAI's set_rnd seeds a PersistentDataset: its attributes in name order
            from monai.data.utils import set_rnd

            for key in sorted(self.__dict__):
                seed = set_rnd(self.__dict__[key], seed=seed)
            return self
        self.transform.set_random_state(seed=seed)
        return self
