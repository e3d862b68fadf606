"""What this machine gives a process: the memory it could still allocate (the one reader of MemAvailable and of
a memory cgroup's limit, for `prep` and the readers alike).

A process in a memory cgroup (a container, a SLURM job, a systemd slice) is killed when its cgroup's usage reaches
the limit, however much the machine has free: the memory it may still use is the least of MemAvailable and, for its
cgroup and every cgroup above it, the limit less what is used there. Both cgroup versions are read: v1's memory
controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`) and v2's unified tree (`memory.max`, `memory.current`),
found from `/proc/<pid>/cgroup` and the mounts in `/proc/self/mountinfo`. A cgroup's usage counts the page cache its
processes filled; the kernel reclaims the inactive part of it before it kills anything, so that part
(`inactive_file` of `memory.stat`) counts as free, as MemAvailable counts the machine's.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory", "cgroup_headroom", "memory_cgroup"]

UNLIMITED = 1 << 62  # v1 writes "no limit" as the largest page-aligned 64-bit count (9223372036854771712)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root inside the hierarchy, mountpoint, fstype, super options) of every cgroup mount."""
    out: list[tuple[str, str, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if after and after[0] in ("cgroup", "cgroup2"):
            options = set(after[2].split(",")) if len(after) > 2 else set()
            out.append((fields[3], fields[4].replace("\\040", " "), after[0], options))
    return out


def memory_cgroup(pid: int | str = "self") -> tuple[Path, int] | None:
    """(folder, version) of the memory cgroup process `pid` lives in: the v1 memory controller's where it is
    mounted, else the v2 tree's where it holds the memory controller; None where neither is (or cannot be read)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    for root, mountpoint, fstype, options in _mounts():
        version = 1 if fstype == "cgroup" and "memory" in options else 2 if fstype == "cgroup2" else 0
        path = paths.get(f"v{version}", "")
        if not path or not (path + "/").startswith(root.rstrip("/") + "/"):
            continue
        folder = Path(mountpoint, os.path.relpath(path, root))
        if (folder / ("memory.limit_in_bytes" if version == 1 else "memory.max")).is_file():
            return folder, version
    return None


def _stat(folder: Path, name: str) -> int:
    for line in (folder / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _level_headroom(folder: Path, version: int) -> int | None:
    """One cgroup's limit less its usage (its inactive page cache counted as free); None without a limit."""
    if version == 1:
        limit = int((folder / "memory.limit_in_bytes").read_text())
        if limit >= UNLIMITED:
            return None
        used = int((folder / "memory.usage_in_bytes").read_text()) - _stat(folder, "total_inactive_file")
    else:
        text = (folder / "memory.max").read_text().strip()
        if text == "max":
            return None
        limit = int(text)
        used = int((folder / "memory.current").read_text()) - _stat(folder, "inactive_file")
    return max(0, limit - max(0, used))


def cgroup_headroom(cgroup: tuple[Path, int] | None) -> int | None:
    """Bytes the processes of memory cgroup `cgroup` ((folder, version), as `memory_cgroup` gives it) may still
    use: the least, over it and the cgroups above it that have a limit, of that limit less their usage (inactive
    page cache counted as free); None where none has a limit or their files cannot be read."""
    if cgroup is None:
        return None
    folder, version = cgroup
    least: int | None = None
    try:
        while (folder / "memory.stat").is_file():
            room = _level_headroom(folder, version)
            if room is not None:
                least = room if least is None else min(least, room)
            if folder.parent == folder:
                break
            folder = folder.parent
    except (OSError, ValueError):
        return least
    return least


def available_memory() -> int:
    """Bytes this process could still allocate: the least of MemAvailable and its memory cgroup's headroom
    (`cgroup_headroom`): the one figure every memory-sized choice of `prep` and the loaders starts from."""
    avail = _mem_available()
    room = cgroup_headroom(memory_cgroup())
    return avail if room is None else min(avail, room)
