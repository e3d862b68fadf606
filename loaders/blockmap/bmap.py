"""Block maps (bmap.json): the ONE definition of the document, and the arithmetic from file bytes to device bytes.

`prep bmap` writes the document through `encode_document`; loaders read it with `BlockMap.load`. Light:
stdlib + xxhash (imported when a map is encoded or loaded).

Document (JSON, UTF-8; all offsets and lengths in bytes)::

    {"checksum":"xxh3:<16 hex>", "format":"blockprep-bmap", "version":"1.0", "created":..., "root":...,
     "mountpoint":..., "device":"/dev/loop3", "disk":"/dev/loop3", "major":7, "minor":3,
     "partition_start":0, "logical_block_size":512, "fs_block_size":4096, "fstype":"ext4", "uuid":...,
     "loop":{"backing_file":..., "offset":...} | null,
     "extent_fields":["logical","physical","length","flags"], "flag_bits":{"LAST":1, ...},
     "files":{"<key relative to root>":{"size":..,"inode":..,"mtime_ns":..,"ctime_ns":..,"extents":[[l,p,n,f],...],
                                      "raw_readable":true,"reason":null}}}

`checksum` is xxh3-64 of the document without it, serialised canonically (sorted keys, no spaces); the
written file is exactly that serialisation with the checksum member first, so any edit is detected.

`BlockMap.load` also reads the flat map of the research loaders, `{"train/a/x.JPEG": {"startblock": S,
"endblock": E}}` (whole-disk LBAs, E inclusive; also what `prep bmap --format seed` writes), with a warning
printed once: such a map holds one run per file (first-extent-only maps read fragmented files wrong) and
no size, inode or time to tell a stale entry. Where the files are mounted (`root=`), each entry gets the
file's size and the readers' check of its current extents, which sends fragmented or moved files through
the filesystem.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from loaders.errors import ChecksumError, FormatError, SchemaVersionError, StaleError
from loaders.opener import read_in, split

BMAP_FORMAT = "blockprep-bmap"
BMAP_VERSION = "1.1"  # major.minor: readers reject an unknown major. 1.1: each file's ctime_ns
MAX_BMAP = 4 << 30  # bytes of a bmap.json: read whole into memory, bounded before it is read
NO_CTIME = "mapped without its ctime (a map older than version 1.1): re-run `prep bmap`"
EXTENT_FIELDS = ("logical", "physical", "length", "flags")
_HEADER = re.compile(rb'\{"checksum":"xxh3:([0-9a-f]{16})",')
FLAT_FORMAT = "flat-seed"  # `format` of a document built from a flat research map


class FlatMapWarning(UserWarning):
    """A flat research map was loaded: one run per file, no staleness data."""


def is_flat_map(doc: Any) -> bool:
    """Whether a parsed JSON document is the flat research form {key: {"startblock", "endblock"}}."""
    return (
        isinstance(doc, dict)
        and bool(doc)
        and all(isinstance(v, dict) and "startblock" in v and "endblock" in v for v in doc.values())
    )


def _lba_size(device: str | None) -> int:
    """The logical block size of a block device (sysfs), else 512 (what the research maps assume)."""
    if device:
        name = os.path.basename(os.path.realpath(device))
        for at in (f"/sys/class/block/{name}/queue", f"/sys/class/block/{name}/../queue"):
            try:
                with open(f"{at}/logical_block_size") as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
    return 512


def flat_document(
    flat: dict[str, dict[str, int]], root: str | None, device: str | None, block: int | None = None
) -> dict[str, Any]:
    """A bmap document for a flat research map: one extent per file at whole-disk byte S*block, partition
    start 0. With `root` (where the keys are mounted) each file present gets its size, inode and mtime now,
    and is filesystem-only when it is longer than its run (the map kept only its first extent)."""
    lbs = block or _lba_size(device)
    start = _partition_start(root) if root else 0  # whole-disk LBAs -> offsets on the filesystem's device
    files: dict[str, Any] = {}
    for key, v in flat.items():
        first, last = int(v["startblock"]), int(v["endblock"])
        run = (last - first + 1) * lbs
        rec: dict[str, Any] = {"size": run, "inode": -1, "mtime_ns": -1, "ctime_ns": -1, "raw_readable": run > 0,
                               "reason": None}  # fmt: skip
        rec["extents"] = [[0, first * lbs - start, run, 1]]
        try:
            st = os.lstat(os.path.join(root, key)) if root else None
        except OSError:
            st = None
        if st is not None:
            rec.update(size=st.st_size, inode=st.st_ino, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
            if st.st_size > run:
                rec.update(raw_readable=False, reason="fragmented: the flat map holds its first extent only")
        files[key] = rec
    dev = device or ""  # none named: BlockMap.source asks for one rather than name a device "?"
    return {"format": FLAT_FORMAT, "version": BMAP_VERSION, "root": root or "", "device": dev, "disk": dev,
            "partition_start": start, "logical_block_size": lbs, "files": files}  # fmt: skip


def _partition_start(root: str) -> int:
    """Bytes from the start of the disk to the filesystem holding `root` (sysfs; 0 when not a partition)."""
    try:
        dev = os.stat(root).st_dev
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/start") as f:
            return int(f.read()) * 512
    except (OSError, ValueError):
        return 0


def _xxh3_hex(data: bytes) -> str:
    import xxhash

    return str(xxhash.xxh3_64_hexdigest(data))


def encode_document(doc: dict[str, Any]) -> bytes:
    """Serialise a bmap document with its checksum member first (see the module docstring)."""
    body = json.dumps({k: v for k, v in doc.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    raw = body.encode()
    return b'{"checksum":"xxh3:' + _xxh3_hex(raw).encode() + b'",' + raw[1:] + b"\n"


def encode_document_with_files(doc: dict[str, Any], files_json: str) -> bytes:
    """`encode_document(doc | {"files": files})` where `files_json` is that object already serialised
    canonically (`json.dumps(files, sort_keys=True, separators=(",", ":"))`): the mapper formats records as
    it maps, so a million-file map is not built as objects and encoded again."""
    marker = "\x00files\x00"  # no path or header value holds NUL: the quoted marker occurs once
    body = json.dumps({**doc, "files": marker}, sort_keys=True, separators=(",", ":"))
    head, tail = body.split(json.dumps(marker))
    raw = (head + files_json + tail).encode()
    return b'{"checksum":"xxh3:' + _xxh3_hex(raw).encode() + b'",' + raw[1:] + b"\n"


def decode_document(data: bytes, path: str = "?") -> dict[str, Any]:
    """Parse and check a bmap document: FormatError (truncated/not a bmap), SchemaVersionError, ChecksumError."""
    data = data.rstrip()
    m = _HEADER.match(data)
    if not m:
        raise FormatError(f"{path}: not a blockprep block map (no checksum header); re-create it with `prep bmap`")
    body = b"{" + data[m.end() :]
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise FormatError(f"{path}: truncated or corrupt JSON ({exc}); re-create it with `prep bmap`") from None
    if not isinstance(doc, dict) or doc.get("format") != BMAP_FORMAT:
        raise FormatError(f"{path}: not a blockprep block map (format {doc.get('format')!r}); use `prep bmap`")
    version = str(doc.get("version", ""))
    if version.split(".")[0] != BMAP_VERSION.split(".")[0]:
        raise SchemaVersionError(
            f"{path}: block map version {version} is not readable by this blockprep (reads {BMAP_VERSION}); "
            "upgrade blockprep or re-create the map"
        )
    if _xxh3_hex(body) != m.group(1).decode():
        raise ChecksumError(f"{path}: checksum mismatch: the block map was edited or corrupted; re-run `prep bmap`")
    return doc


def _flat_or_none(data: bytes) -> dict[str, dict[str, int]] | None:
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if is_flat_map(doc) else None


class Segment(NamedTuple):
    """`nbytes` of a file at `file_offset`; at `device_offset` on the device, or a hole (None) that reads as zeros."""

    file_offset: int
    nbytes: int
    device_offset: int | None


class LbaRange(NamedTuple):
    """Read `nblocks` LBAs from `lba`; the wanted bytes are [skip, skip + nbytes) of that run, for file_offset."""

    file_offset: int
    nbytes: int
    lba: int
    nblocks: int
    skip: int


def map_range(extents: Sequence[Sequence[int]], size: int, offset: int = 0, nbytes: int | None = None) -> list[Segment]:
    """Split file bytes [offset, offset+nbytes) into device segments and holes. Extents are (logical, physical,
    length, ...) sorted by logical; the last is clamped to `size`. Raises ValueError outside the file."""
    if nbytes is None:
        nbytes = size - offset
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"range [{offset}, {offset + nbytes}) is outside the file (size {size})")
    out: list[Segment] = []
    pos, end = offset, offset + nbytes
    for ext in extents:
        logical, physical, length = ext[0], ext[1], ext[2]
        lo, hi = max(logical, pos), min(logical + length, end, size)
        if hi <= lo:
            if logical >= end:
                break
            continue
        if lo > pos:
            out.append(Segment(pos, lo - pos, None))
        out.append(Segment(lo, hi - lo, physical + (lo - logical)))
        pos = hi
    if pos < end:
        out.append(Segment(pos, end - pos, None))
    return out


def to_lba(device_offset: int, nbytes: int, block: int) -> tuple[int, int, int]:
    """The LBA run covering device bytes [device_offset, +nbytes): (first LBA, count, skip bytes into the run)."""
    first = device_offset // block
    last = -(-(device_offset + nbytes) // block)
    return first, last - first, device_offset - first * block


def from_lba(lba: int, count: int, block: int) -> tuple[int, int]:
    """Device byte range (offset, nbytes) of an LBA run."""
    return lba * block, count * block


@dataclass(frozen=True)
class FileEntry:
    """One mapped file."""

    key: str
    size: int
    inode: int
    mtime_ns: int
    extents: tuple[tuple[int, int, int, int], ...]
    raw_readable: bool
    reason: str | None
    xxh3: int | None = None
    ctime_ns: int | None = None  # None: a map older than version 1.1 (never raw-read: NO_CTIME)


class RawSource(NamedTuple):
    """Where raw reads go: file or device `path`, with `base` bytes added to filesystem-device offsets."""

    path: str
    base: int


_BAD_KEY = re.compile(r"(?:^|/)\.\.(?:/|$)|^/|\x00|^$", re.MULTILINE)


def check_keys(files: Any, path: str = "?") -> None:
    """FormatError unless every key names a file under the root: relative, no '..' component, no NUL (one
    regex over all keys joined: a million-file map is checked in milliseconds)."""
    if not isinstance(files, dict) or not all(isinstance(k, str) and "\n" not in k for k in files):
        raise FormatError(f"{path}: 'files' is not an object of relative paths; re-create it with `prep bmap`")
    bad = _BAD_KEY.search("\n".join(files)) if files else None
    if bad is not None:
        line = bad.string[bad.string.rfind("\n", 0, bad.start()) + 1 :].split("\n", 1)[0]
        raise FormatError(
            f"{path}: key {line[:80]!r} is not a path under the map's root (absolute, '..' or NUL); refused: "
            "re-create the map with `prep bmap`"
        )


class BlockMap:
    """A loaded, checked block map. `BlockMap.load(path)`; `root=` overrides where the files are now mounted."""

    def __init__(self, doc: dict[str, Any], path: str = "?", root: str | os.PathLike[str] | None = None) -> None:
        self.doc = doc
        self.path = path
        self.files: dict[str, dict[str, Any]] = doc["files"]
        check_keys(self.files, path)
        self._entries: dict[str, FileEntry] = {}  # parsed on first use: a loader asks for the same files often
        self.root = os.path.abspath(root if root is not None else doc["root"])
        self.device: str = doc["device"]
        self.disk: str = doc.get("disk", self.device)
        self.partition_start: int = int(doc.get("partition_start", 0))
        self.logical_block_size: int = int(doc.get("logical_block_size", 512))
        self.fstype: str = doc.get("fstype", "?")
        self.uuid: str | None = doc.get("uuid")
        loop = doc.get("loop") or {}
        self.loop_backing_file: str | None = loop.get("backing_file")
        self.loop_offset: int = int(loop.get("offset", 0))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        root: str | os.PathLike[str] | None = None,
        device: str | os.PathLike[str] | None = None,
    ) -> BlockMap:
        """Read and check a bmap.json (version, checksum), or read a flat research map (see `from_flat`;
        `device` gives its LBA size and is recorded as its device)."""
        folder, name = split(path)
        try:  # never through a link, never a FIFO, bounded before reading (loaders.opener)
            data = read_in(folder, name, "pass the map `prep bmap` wrote, not a link to it", MAX_BMAP)
        except OSError as exc:
            raise FormatError(f"{path}: cannot read the block map ({exc.strerror}); check the path") from None
        if not _HEADER.match(data):
            flat = _flat_or_none(data)
            if flat is not None:
                return cls.from_flat(flat, os.fspath(path), root, device)
        return cls(decode_document(data, os.fspath(path)), os.fspath(path), root)

    @classmethod
    def from_flat(
        cls,
        flat: dict[str, dict[str, int]],
        path: str = "?",
        root: str | os.PathLike[str] | None = None,
        device: str | os.PathLike[str] | None = None,
    ) -> BlockMap:
        """A BlockMap of a flat research map (see `flat_document`); warns once about what such maps lack."""
        warnings.warn(
            f"{path}: a flat startblock/endblock map: one run per file (first-extent-only maps read fragmented "
            "files wrong) and no size, inode or mtime to detect stale entries; pass the mounted folder (root) "
            "so files are checked, or use the full map of `prep bmap`",
            FlatMapWarning,
            stacklevel=3,
        )
        r = os.fspath(root) if root is not None else None
        doc = flat_document(flat, r, os.fspath(device) if device is not None else None)
        return cls(doc, path, r or os.getcwd())

    @property
    def flat(self) -> bool:
        """True for a map built from the flat research form (one run per file, whole-disk offsets)."""
        return self.doc.get("format") == FLAT_FORMAT

    def __len__(self) -> int:
        return len(self.files)

    def __contains__(self, key: object) -> bool:
        return key in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def keys(self) -> Iterator[str]:
        """Keys (paths relative to the root), in map order."""
        return iter(self.files)

    def key_for(self, path: str | os.PathLike[str]) -> str:
        """The key of `path`: a key itself, or an absolute path under the root."""
        p = os.fspath(path)
        if p in self.files:
            return p
        # not a key: a path (relative ones to the working directory) under the root
        rel = os.path.relpath(os.path.abspath(p), self.root)
        if rel in self.files:
            return rel
        raise FormatError(f"{p}: not in block map {self.path} (root {self.root}); re-run `prep bmap` to add it")

    def entry(self, key: str | os.PathLike[str]) -> FileEntry:
        """The FileEntry for a key or a path under the root."""
        k = self.key_for(key)
        cached = self._entries.get(k)
        if cached is not None:
            return cached
        r = self.files[k]
        ext = tuple((int(e[0]), int(e[1]), int(e[2]), int(e[3])) for e in r["extents"])
        reason, xxh3 = r.get("reason"), r.get("xxh3")
        e = self._entries[k] = FileEntry(
            k, r["size"], r["inode"], r["mtime_ns"], ext, r["raw_readable"], reason, xxh3, r.get("ctime_ns")
        )
        return e

    def file_path(self, key: str) -> str:
        """Where the file is now, through the filesystem."""
        return os.path.join(self.root, key)

    def stale_reason(self, key: str | os.PathLike[str]) -> str | None:
        """Why the file no longer matches its entry (size, inode, mtime or ctime changed, a link now; missing),
        or None. ctime: a file rewritten in place with its mtime put back (`cp -p`, `rsync -t`, `tar x`)
        keeps size, inode and mtime, and its new bytes may not have reached the mapped blocks yet."""
        e = self.entry(key)
        try:
            st = os.lstat(self.file_path(e.key))
        except OSError as exc:
            return f"cannot stat ({exc.strerror})"
        changed = [
            f"{what} {old} -> {new}"
            for what, old, new in (("size", e.size, st.st_size), ("inode", e.inode, st.st_ino))
            if old != new
        ]
        if e.mtime_ns != st.st_mtime_ns:
            changed.append("mtime changed")
        if e.ctime_ns is None:
            changed.append(NO_CTIME)
        elif e.ctime_ns != st.st_ctime_ns:
            changed.append("ctime changed (rewritten in place, its mtime put back?)")
        if os.path.islink(self.file_path(e.key)):
            changed.append("it is a symlink now")
        return ", ".join(changed) or None

    def check_fresh(self, key: str | os.PathLike[str]) -> FileEntry:
        """The entry, or StaleError when the file changed since it was mapped."""
        e = self.entry(key)
        why = self.stale_reason(e.key)
        if why:
            raise StaleError(f"{self.file_path(e.key)}: changed since it was mapped ({why}); re-run `prep bmap`")
        return e

    def segments(
        self, key: str | os.PathLike[str], offset: int = 0, nbytes: int | None = None, whole_disk: bool = False
    ) -> list[Segment]:
        """Device segments of file bytes [offset, +nbytes); offsets on the filesystem's device, or on the whole
        disk (partition start added) when `whole_disk`."""
        e = self.entry(key)
        segs = map_range(e.extents, e.size, offset, nbytes)
        add = self.partition_start if whole_disk else 0
        if not add:
            return segs
        return [s if s.device_offset is None else s._replace(device_offset=s.device_offset + add) for s in segs]

    def lba_ranges(
        self, key: str | os.PathLike[str], offset: int = 0, nbytes: int | None = None, whole_disk: bool = True
    ) -> list[LbaRange]:
        """LBA runs (logical block size units) for the data segments of a file range; holes are left out
        (they read as zeros). Whole-disk LBAs by default, as raw NVMe readers address the namespace."""
        out = []
        for s in self.segments(key, offset, nbytes, whole_disk):
            if s.device_offset is not None:
                lba, count, skip = to_lba(s.device_offset, s.nbytes, self.logical_block_size)
                out.append(LbaRange(s.file_offset, s.nbytes, lba, count, skip))
        return out

    def source(self, device_path: str | os.PathLike[str] | None = None) -> RawSource:
        """Where to read raw bytes: `device_path` (the filesystem's device, its whole disk, or the loop image
        file), else the filesystem's device when readable, else the loop image file."""
        if device_path is None:
            if not self.device:
                raise FormatError(
                    f"{self.path}: a flat map names no device (its startblocks count on a disk it does not name); "
                    "pass device_path= (that disk, or its loop image file)"
                )
            if os.access(self.device, os.R_OK) or not self.loop_backing_file:
                return RawSource(self.device, 0)
            return RawSource(self.loop_backing_file, self.loop_offset + self.partition_start)
        p = os.fspath(device_path)
        if not self.device:  # a flat map loaded without one: its LBAs count from the start of this disk
            return RawSource(p, self.partition_start)
        real = os.path.realpath(p)
        if real == os.path.realpath(self.device):
            return RawSource(p, 0)
        if real == os.path.realpath(self.disk):
            return RawSource(p, self.partition_start)
        if self.loop_backing_file and real == os.path.realpath(self.loop_backing_file):
            return RawSource(p, self.loop_offset + self.partition_start)
        raise FormatError(
            f"{p}: this block map was made on {self.device} (disk {self.disk}, uuid {self.uuid}), not on {p}; "
            "pass that device (or its loop image) or re-run `prep bmap` on this one"
        )
