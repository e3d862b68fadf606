"""What this machine gives a process: the memory it could still allocate (the one reader of MemAvailable and of
a cgroup's limit, for `prep` and the readers alike)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory"]


def available_memory() -> int:
    """Bytes this process could still allocate: MemAvailable, or the cgroup's headroom when that is less."""
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not avail:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail
