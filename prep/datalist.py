"""The datalist `prep cache` prepares: a decathlon-style JSON read as MONAI reads it, checked, and its
repeated entries found (each is prepared once unless asked: a datalist of 10^6 copies of one entry is one
item, not 10^6)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.cache.meta import entry_key  # its home: the meta line it keys
from prep.errors import UsageError

__all__ = ["Repeats", "datalist_hash", "entry_key", "load_datalist", "unique_items"]


def load_datalist(path: str | Path, sections: Sequence[str] = ("training",)) -> list[tuple[str, dict[str, Any]]]:
    """(section, entry) pairs of a decathlon datalist; paths resolved against its folder exactly as MONAI does."""
    from monai.data import load_decathlon_datalist

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: datalist not found; pass a decathlon-style dataset.json")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from exc
    missing = [s for s in sections if s not in doc]
    if missing:
        have = ", ".join(k for k, v in doc.items() if isinstance(v, list)) if isinstance(doc, dict) else ""
        raise UsageError(f"{path}: no section {', '.join(missing)} (lists here: {have}); choose with --section")
    for section in sections:
        _check_section(path, section, doc[section])
    out = []
    for section in sections:
        seg = _segmentation(path.parent, doc[section])
        for entry in load_decathlon_datalist(str(path), is_segmentation=seg, data_list_key=section):
            out.append((section, dict(entry)))
    return out


def _segmentation(folder: Path, entries: list[Any]) -> bool:
    """Whether a section's "label" values are files, as a segmentation datalist's are: MONAI then joins every
    one to the datalist's folder (`is_segmentation=True`). A section whose string labels name no file there is
    a classification datalist (class names: "Hand", "CT"): read with `is_segmentation=False`, they stay as
    written, as the user's own MONAI loading gives them (a value naming a file is joined either way)."""
    import os

    named: list[str] = []
    for entry in entries:
        label = entry.get("label") if isinstance(entry, dict) else None
        values = label if isinstance(label, list) else [label]
        named += [v for v in values if isinstance(v, str)]
    return not named or any(os.path.exists(os.path.normpath(os.path.join(folder, v))) for v in named)


def _check_section(path: Path, section: str, value: Any) -> None:
    """A section is a non-empty list of {"image": ..., "label": ...} objects (MONAI turns a "test" list of
    path strings into such objects itself)."""
    example = '[{"image": "imagesTr/a.nii.gz", "label": "labelsTr/a.nii.gz"}, ...]'
    if not isinstance(value, list):
        raise UsageError(f"{path}: section '{section}' is a {type(value).__name__}, not a list; write it as {example}")
    if not value:
        raise UsageError(f"{path}: section '{section}' is empty: nothing to prepare; add entries like {example}")
    if section == "test" and all(isinstance(v, str) for v in value):
        return
    for n, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise UsageError(
                f"{path}: entry {n} of '{section}' is a {type(entry).__name__} ({str(entry)[:60]!r}), not an "
                f"object; write it as {example}"
            )


def datalist_hash(items: list[tuple[str, dict[str, Any]]]) -> str:
    """sha256 of the resolved entries (what is prepared), independent of formatting of the JSON file."""
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Repeats:
    """Entries of a datalist that repeat an earlier entry of their section."""

    count: int = 0
    first: tuple[str, dict[str, Any]] | None = None
    kept: bool = False

    def note(self) -> str:
        """One line for the summary ('' when nothing repeats)."""
        if not self.count or self.first is None:
            return ""
        section, entry = self.first
        shown = json.dumps(entry, sort_keys=True, default=str)
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        said = f"{self.count} datalist entries repeat an earlier entry of their section (first: '{section}' {shown})"
        if self.kept:
            return f"{said}; each copy prepared and read as listed (--keep-repeats)"
        return (f"{said}; each is prepared once and PreparedLoader/PreparedDataset read it once (the drop-in "
                "still gives every listed copy); pass --keep-repeats to prepare every copy")  # fmt: skip


def unique_items(
    items: list[tuple[str, dict[str, Any]]], keep_repeats: bool = False
) -> tuple[list[tuple[str, dict[str, Any]]], Repeats]:
    """The items to prepare: each (section, entry) once, in the order first listed (all of them with
    `keep_repeats`), and what repeated."""
    seen: set[str] = set()
    unique: list[tuple[str, dict[str, Any]]] = []
    count, first = 0, None
    for item in items:
        key = entry_key(*item)
        if key in seen:
            count += 1
            first = first or item
            if not keep_repeats:
                continue
        seen.add(key)
        unique.append(item)
    return unique, Repeats(count, first, keep_repeats)
