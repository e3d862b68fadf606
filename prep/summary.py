"""What a `prep cache` run did and what the cache holds: the summary it returns and prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaders.cache.spec import BMAP
from prep.cache_verify import BadItem


@dataclass
class CacheSummary:
    """What a `prep cache` run did and what the cache holds."""

    output: Path
    n_planned: int
    n_items: int
    n_new: int
    n_resumed: int
    quarantined: list[dict[str, Any]]
    seconds: float
    tensor_bytes: int
    bytes_on_disk: int
    up_to_date: bool = False
    bmap: Path | None = None
    bmap_note: str = ""
    bad: list[BadItem] = field(default_factory=list)
    head: list[str] = field(default_factory=list)
    head_reason: str = ""
    version_notes: list[str] = field(default_factory=list)
    verified: bool = False  # --verify ran
    mode: str = ""  # how the local workers ran: "2 threads", "8 processes (auto)"
    checked_files: list[str] = field(default_factory=list)
    n_tensors: int = 0
    sampling: str = ""  # the label-driven crop's sampling sets (prep.sampling), when the tail starts with one
    worker_cpu_s: float = 0.0  # CPU seconds of the local worker processes (not this process's children)
    item_cpu_s: float = 0.0  # CPU seconds of this run's items on their own threads (check, head, write, sets)
    worker_start_cpu_s: float = 0.0  # the local worker processes' CPU seconds once started and warm
    repeats: str = ""  # repeated datalist entries, said once (prep.datalist.Repeats.note)
    n_kept: int = 0  # items of a cache made from another datalist kept as they were (prep.cache_plan.regrow)
    n_dropped: int = 0  # and its items no longer listed
    n_taken: int = (
        0  # items the MONAI drop-in had computed and written (loaders.faces.monai_fill), committed as they were
    )

    @property
    def items_per_s(self) -> float:
        """Items prepared per second in this run."""
        return self.n_new / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        """Human summary, one fact per line."""
        counts = f"{self.n_planned} items: {self.n_items} cached"
        if self.quarantined:
            counts += f", {len(self.quarantined)} quarantined"
        if self.up_to_date:
            state = "already complete and up to date"
            if not self.verified:  # say what was and was not checked
                state += (" (manifest, index and meta match their checksums, shards present at their sizes; "
                          "tensor bytes not re-read: `prep verify` checks them)")  # fmt: skip
        else:
            state = f"{self.n_new} processed in this run ({self.items_per_s:.1f} items/s"
            state += f", {self.mode})" if self.mode else ")"
            if self.n_resumed:
                state += f", {self.n_resumed} resumed from the journal"
            if self.n_kept or self.n_dropped:
                state += (f", {self.n_kept} kept from the cache made from the earlier datalist "
                          f"({self.n_dropped} no longer listed, dropped)")  # fmt: skip
            if self.n_taken:
                state += f", {self.n_taken} taken as the MONAI drop-in wrote them"
        out = [
            f"{self.output}: {counts}; {state}",
            f"  head: {' -> '.join(self.head) or 'empty'}; {self.head_reason}" if self.head_reason else "",
            f"  tensors {self.tensor_bytes / 1e6:.1f} MB, shards on disk {self.bytes_on_disk / 1e6:.1f} MB",
            f"  block map: {self.bmap}" if self.bmap else f"  block map: not written ({self.bmap_note})",
            f"  {self.sampling}" if self.sampling else "",
            f"  warning: {self.repeats}" if self.repeats else "",
        ]
        out += [f"  note: made with {v} (does not change the tensors)" for v in self.version_notes]
        out += [f"  quarantined: {q['path'] or q['source']}: {q['reason']}" for q in self.quarantined]
        out += [f"  verify: {b}" for b in self.bad]
        if self.verified and not self.bad:
            out.append(
                f"  verify: ok: manifest, {', '.join(sorted(self.checked_files))} match their checksums; every "
                f"tensor re-read and matches its checksum ({self.n_tensors} tensors)"
            )
        return [line for line in out if line]


def summary_of(
    root: Path, manifest: dict[str, Any], n_planned: int, n_new: int, n_resumed: int, seconds: float,
    up_to_date: bool = False,
) -> CacheSummary:  # fmt: skip
    """The summary of a committed cache from its manifest."""
    disk = sum((root / s).stat().st_size for s in manifest["shards"])
    return CacheSummary(
        output=root, n_planned=n_planned, n_items=int(manifest["n_items"]), n_new=n_new, n_resumed=n_resumed,
        quarantined=list(manifest.get("quarantined", [])), seconds=seconds,
        tensor_bytes=int(manifest.get("tensor_bytes", 0)), bytes_on_disk=disk, up_to_date=up_to_date,
        bmap=root / BMAP if (root / BMAP).exists() else None, bmap_note="" if (root / BMAP).exists() else "absent",
    )  # fmt: skip
