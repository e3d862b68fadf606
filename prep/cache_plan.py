"""`prep cache`'s plan and what its output folder already holds.

The plan of a run (pipeline fingerprint, library versions, datalist hash, sections) is compared with the plan
an existing cache was made with: the folder is then up to date, stale (refused, or wiped with --force),
resumed (journals of the same plan), a committed cache reopened for quarantined items worth preparing again, or
a pending cache the MONAI drop-in started taken up (`adopt`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from loaders.cache import chain, layout, sampling
from loaders.cache.format import PreparedCache
from loaders.cache.journals import JournalWriter
from loaders.cache.meta import SECTION, line_source
from loaders.cache.pending import read_pending
from loaders.cache.spec import (
    BMAP,
    INDEX,
    JOURNAL_DIR,
    MANIFEST,
    META,
    META_OFFSETS,
    PENDING,
    SCHEMA_VERSION,
    SHARD_DIR,
)
from loaders.errors import FormatError
from loaders.faces.monai_fill import fill_records
from prep.datalist import Repeats, datalist_hash, entry_key, load_datalist, unique_items
from prep.errors import StaleError, UsageError
from prep.journal import committed_records, read_plan, write_plan
from prep.outdirs import OutputDirs
from prep.pipeline import Pipeline, file_sha256
from prep.quarantine import to_retry
from prep.summary import CacheSummary, summary_of

_Items = list[tuple[str, dict[str, Any]]]  # the datalist entries to prepare: (section, entry)
_COMMITTED = "committed.jsonl"  # a committed cache's items as journal lines, while its quarantine is retried


def reopen(root: Path, manifest: dict[str, Any], plan: dict[str, Any], n_items: int, max_item_bytes: int) -> bool:
    """Turn a committed cache whose quarantine holds items worth preparing again (`prep.quarantine.to_retry`:
    a file restored or replaced, a larger --max-item-bytes) into a resumable one: its prepared items and the
    quarantined items not retried become journal lines (plan first, manifest last, so a kill leaves a
    resumable cache), and the run prepares the retried items and commits anew. False when none is retried."""
    quarantined = list(manifest.get("quarantined", []))
    retry = set(to_retry(quarantined, max_item_bytes))
    if not retry:
        return False
    held = {int(q["item"]) for q in quarantined}
    records = committed_records(root, [i for i in range(n_items) if i not in held])
    if records is None:
        return False
    kept = [{"item": q["item"], "quarantined": q["reason"], "path": q.get("path", ""),
             **{k: q[k] for k in ("inputs", "max_item_bytes") if k in q}}
            for q in quarantined if int(q["item"]) not in retry]  # fmt: skip
    _journaled(root, plan, records + kept)
    return True


def regrow(
    root: Path, manifest: dict[str, Any], plan: dict[str, Any], items: _Items, max_item_bytes: int
) -> tuple[int, int]:
    """Turn a committed cache made from another datalist (same head) into a resumable run of this one: each
    item whose entry (`prep.datalist.entry_key`) is still listed becomes a journal line at its new position, a
    new entry the MONAI drop-in computed and wrote (`loaders.faces.monai_fill`) too, a quarantined entry still
    listed keeps its quarantine unless it is worth retrying; the run then prepares the other new and changed
    entries and commits anew (the left-out items' bytes go with the shards trimmed or dropped, the drop-in's
    journals with the journal folder). Returns how many prepared items were kept and how many of the drop-in's
    taken; a kill anywhere leaves a cache this run resumes."""
    cache = PreparedCache(root)
    free = _free(items)
    positions: list[int | None] = []
    for n in range(cache.n_items):
        line = cache.meta(n)
        slots = free.get(entry_key(line.get(SECTION), line_source(line)))
        positions.append(slots.pop(0) if slots else None)
    records = committed_records(root, positions)
    if records is None:
        raise StaleError(f"{root}: datalist changed and this cache was not written by `prep cache` (an item's "
                         "tensors span shards); re-run with --force to rebuild")  # fmt: skip
    taken = _taken(root, plan, free)
    by_entry = {json.dumps(items[p][1], sort_keys=True, default=str): p for p in sorted(_left(free), reverse=True)}
    retry = set(to_retry(list(manifest.get("quarantined", [])), max_item_bytes))
    kept = []
    for q in manifest.get("quarantined", []):
        position = by_entry.pop(json.dumps(q.get("source"), sort_keys=True, default=str), -1)
        if position >= 0 and int(q["item"]) not in retry:
            kept.append({"item": position, "quarantined": q["reason"], "path": q.get("path", ""),
                         **{k: q[k] for k in ("inputs", "max_item_bytes") if k in q}})  # fmt: skip
    _journaled(root, plan, records + taken + kept)
    return len(records), len(taken)


def adopt(root: Path, plan: dict[str, Any], items: _Items) -> int:
    """Turn a pending cache the MONAI drop-in started (`loaders.cache.pending`; `reconcile` checked its head
    against this plan's) into a run of this plan to resume: each entry with a drop-in record of this head becomes
    a journal line at its position; the run prepares the rest and commits (which removes the drop-in's journals
    and the marker). Returns how many were taken; 0 where `root` holds no pending cache, or one whose run
    already started (its plan journaled: resumed as any run)."""
    if not (root / PENDING).is_file() or read_plan(root) is not None:
        return 0
    taken = _taken(root, plan, _free(items))
    _journaled(root, plan, taken)
    return len(taken)


def _free(items: _Items) -> dict[str, list[int]]:
    """The datalist's positions by entry (`prep.datalist.entry_key`), in order: what records are matched to."""
    free: dict[str, list[int]] = {}
    for position, (section, entry) in enumerate(items):
        free.setdefault(entry_key(section, entry), []).append(position)
    return free


def _taken(root: Path, plan: dict[str, Any], free: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Journal records, at their positions, of the entries still free that the MONAI drop-in wrote with this
    plan's head (their positions taken from `free`); their shard bytes are checked as every journal's are
    (`prep.journal.read_journals`) before the run counts them finished."""
    records = []
    for key, record in fill_records(root, plan["fingerprint"]).items():
        slots = free.get(key)
        if slots:
            records.append({"item": slots.pop(0), **{k: record[k] for k in ("shard", "tensors", "meta")}})
    return records


def _left(free: dict[str, list[int]]) -> list[int]:
    """The positions no committed item was found for."""
    return [p for slots in free.values() for p in slots]


def _journaled(root: Path, plan: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A committed (or pending) cache's kept items as the journal of a run of `plan`: plan first, manifest
    removed last, so a kill at any point leaves either the committed cache or a run that resumes."""
    with OutputDirs(root) as dirs:  # held: a folder swapped for a link redirects nothing (prep.outdirs)
        journal_fd = dirs.fd(JOURNAL_DIR)
        write_plan(root, plan, journal_fd)
        with suppress(FileNotFoundError):
            os.unlink(_COMMITTED, dir_fd=journal_fd)
        with JournalWriter(root / JOURNAL_DIR / _COMMITTED, journal_fd) as journal:
            journal.append_many(records)
        with suppress(FileNotFoundError):  # a pending cache has none
            os.unlink(MANIFEST, dir_fd=dirs.fd())
        os.fsync(dirs.fd())


def check_head(pipe: Pipeline, allow_empty_head: bool) -> None:
    """Refuse a chain whose head is empty: the cache would hold no tensors, only the datalist's entries."""
    if pipe.head or allow_empty_head:
        return
    raise UsageError(
        f"{pipe.path}: nothing to prepare: the head is empty ({pipe.head_reason}); put the deterministic "
        "transforms (LoadImaged, ...) first, or pass --allow-empty-head to cache the entries as they are"
    )


def _open_checked(root: Path) -> PreparedCache:
    """Open a committed cache (layout files against their checksums, extents inside the shards present: see
    loaders.cache.layout) and check that no shard is missing, so a damaged cache is refused in one line, never
    reported up to date."""
    cache = PreparedCache(root)
    for shard in cache.shards:
        if layout.file_size(shard) < 0:
            raise StaleError(
                f"{root}: shard {shard.name} is missing (the cache is damaged); re-run with --force to rebuild"
            )
    return cache


def up_to_date(root: Path, plan: dict[str, Any], pipe: Pipeline, n_planned: int, t0: float) -> CacheSummary | None:
    """The summary of a committed cache made with this plan whose files pass their checksums, else None."""
    manifest = load_json(root / MANIFEST)
    if manifest is None or differences(manifest, plan):
        return None
    _open_checked(root)  # damaged files: refused here, never reported as up to date
    summary = summary_of(root, manifest, n_planned, 0, 0, time.perf_counter() - t0, up_to_date=True)
    summary.version_notes = chain.compare_versions(manifest.get("versions", {}), plan["versions"])[1]
    summary.head, summary.head_reason = pipe.head_description, pipe.head_reason
    return summary


def load_plan(
    pipe: Pipeline, datalist: Path, sections: Sequence[str], keep_repeats: bool
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any], Repeats]:
    """The items to prepare (repeats once unless kept), the run's plan, and what repeated."""
    listed = load_datalist(datalist, sections)
    items, repeats = unique_items(listed, keep_repeats)
    plan = _plan(pipe, datalist, listed, sections)
    if repeats.count:
        plan["repeats"] = "kept" if keep_repeats else "once"
    return items, plan, repeats


def _plan(pipe: Pipeline, datalist: Path, items: list[tuple[str, dict[str, Any]]], sections: Sequence[str]) -> dict:
    """The run's plan: what a cache made with it must match to be resumed or reported up to date."""
    return {
        "fingerprint": pipe.fingerprint,
        "head": pipe.head_description,
        "head_end": pipe.head_reason,
        "versions": chain.versions(),
        "datalist": str(datalist.resolve()),
        "datalist_hash": datalist_hash(items),
        "n_datalist": len(items),
        "sections": list(sections),
        "pipeline": str(pipe.path),
        "pipeline_sha256": file_sha256(pipe.path),  # what it was: a cache never picks the code a trainer runs
        "bundle_key": pipe.bundle_key,
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between the plan an existing cache was made with and this run's plan."""
    return head_differences(old, new) + datalist_differences(old, new)


def head_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed in how items are prepared (format, head, library versions): every item is stale."""
    version = str(old.get("schema_version", SCHEMA_VERSION))  # plans carry none: they are this run's kind
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        return [f"blockprep's cache format changed (schema {version} -> {SCHEMA_VERSION})"]
    diffs = []
    if old.get("fingerprint") != new["fingerprint"]:
        if old.get("head") != new["head"]:
            diffs.append(f"pipeline head changed ({old.get('head')} -> {new['head']})")
        else:
            diffs.append("pipeline head settings changed (same transforms, different configuration)")
    refuse, _ = chain.compare_versions(old.get("versions", {}), new["versions"])
    if refuse:
        diffs.append(f"library versions changed ({'; '.join(refuse)})")
    return diffs


def datalist_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed in which items are prepared (entries, sections, repeats): the items still listed are not."""
    diffs = []
    if old.get("datalist_hash") != new["datalist_hash"]:
        diffs.append(f"datalist changed ({old.get('n_datalist')} -> {new['n_datalist']} items, {new['datalist']})")
    if old.get("repeats", "kept") != new.get("repeats", "kept"):  # older caches prepared every copy
        diffs.append(f"repeated datalist entries: {old.get('repeats', 'kept')} -> {new.get('repeats', 'kept')}")
    if old.get("sections") != new["sections"]:
        diffs.append(f"sections changed ({old.get('sections')} -> {new['sections']})")
    return diffs


def reconcile(root: Path, plan: dict[str, Any], force: bool) -> dict[str, Any] | None:
    """The existing manifest if the cache is complete and made with this head (its datalist may differ: see
    `regrow`); else wipe (fresh/force) or keep (resume)."""
    manifest = load_json(root / MANIFEST)
    previous = manifest if manifest is not None else read_plan(root)
    if previous is None:
        if not force and _pending_of(root, plan):
            return None  # a pending cache of this head: the caller takes its records (`adopt`)
        if force or any((root / name).exists() for name in (JOURNAL_DIR, SHARD_DIR, PENDING)):
            _wipe(root)  # leftovers without a plan: the run died before any item could be journaled
        return None
    diffs = differences(previous, plan)
    if manifest is not None and diffs and not force and not head_differences(manifest, plan):
        _open_checked(root)  # only the datalist changed: the caller keeps what is still listed (`regrow`)
        return manifest
    if diffs and not force:
        state = "cache" if manifest is not None else "partial cache (interrupted run)"
        raise StaleError(f"{root}: {'; '.join(diffs)} since this {state} was made; re-run with --force to rebuild")
    if force or diffs:
        _wipe(root)
        return None
    if manifest is not None:
        _open_checked(root)  # a complete cache is reported up to date only while its files pass their checksums
    return manifest


def _pending_of(root: Path, plan: dict[str, Any]) -> bool:
    """True where `root` holds a pending cache (`loaders.cache.pending`) of this plan's head and libraries;
    StaleError for one of another head or a marker that is not one; False where there is none."""
    try:
        marker = read_pending(root)
    except FormatError as exc:
        raise StaleError(f"{str(exc).split('; ')[0]}; re-run with --force to rebuild") from None
    if marker is None:
        return False
    diffs = head_differences(marker, plan)
    if diffs:
        raise StaleError(f"{root}: {'; '.join(diffs)} since the MONAI drop-in started this pending cache; re-run "
                         "with --force to rebuild")  # fmt: skip
    return True


def load_json(path: Path) -> dict[str, Any] | None:
    """A cache's JSON document (manifest), None where there is none; StaleError where it cannot be read."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StaleError(f"{path}: unreadable ({exc}); re-run with --force to rebuild the cache") from exc
    return doc if isinstance(doc, dict) else None


def _wipe(root: Path) -> None:
    """Remove every cache file; the manifest first, so a crash mid-wipe leaves nothing trusted."""
    for name in (MANIFEST, INDEX, META, META_OFFSETS, BMAP, PENDING):
        (root / name).unlink(missing_ok=True)
    for name in (SHARD_DIR, JOURNAL_DIR, sampling.DIR):
        shutil.rmtree(root / name, ignore_errors=True)
