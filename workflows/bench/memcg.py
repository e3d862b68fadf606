"""Memory cgroups for the benchmarks and tests that run a reader with less memory than its data: made as root under
the memory hierarchy's root (cgroup v1's memory controller, or v2's tree with the memory controller enabled), a
limit and swap off, processes run inside, always removed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from loaders.machine import memory_cgroup

_READ_ROOT = 64 << 20  # a probe's limit while checking that limits can be written


def _hierarchy() -> tuple[Path, int] | None:
    """(root folder, version) of the memory hierarchy this process's cgroup belongs to."""
    found = memory_cgroup()
    if found is None:
        return None
    folder, version = found
    while (folder.parent / ("memory.limit_in_bytes" if version == 1 else "cgroup.procs")).is_file():
        folder = folder.parent
    return folder, version


def cgroup_reason() -> str | None:
    """Why a memory cgroup cannot be made here (naming what is missing); None where it can."""
    if os.geteuid() != 0:
        return "memory cgroups need root"
    found = _hierarchy()
    if found is None:
        return "no memory cgroup controller mounted (neither cgroup v1's memory controller nor cgroup v2's)"
    root, version = found
    if version == 2 and "memory" not in (root / "cgroup.subtree_control").read_text().split():
        try:
            (root / "cgroup.subtree_control").write_text("+memory")
        except OSError as exc:
            return f"cgroup v2: the memory controller cannot be enabled at {root} ({exc.strerror})"
    try:
        with MemoryCgroup(_READ_ROOT):
            pass
    except OSError as exc:
        return f"cannot make a memory cgroup under {root} ({exc.strerror})"
    return None


__all__ = ["MemoryCgroup", "cgroup_reason"]


class MemoryCgroup:
    """A fresh memory cgroup of `limit` bytes (swap off for it where the kernel counts swap), a context manager:
    on exit its processes are killed by PID and it is removed."""

    def __init__(self, limit: int | None) -> None:
        found = _hierarchy()
        if found is None:
            raise OSError(f"no memory cgroup here: {cgroup_reason()}")
        root, self.version = found
        self.root = root
        self.folder = root / f"blockprep-test-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir()
        try:
            if limit is not None:
                self._limit(limit)
        except OSError:
            self.folder.rmdir()
            raise

    def _limit(self, limit: int) -> None:
        if self.version == 1:
            (self.folder / "memory.limit_in_bytes").write_text(str(limit))
            if (self.folder / "memory.memsw.limit_in_bytes").is_file():  # memory + swap: no swap beyond the limit
                (self.folder / "memory.memsw.limit_in_bytes").write_text(str(limit))
        else:
            (self.folder / "memory.max").write_text(str(limit))
            if (self.folder / "memory.swap.max").is_file():
                (self.folder / "memory.swap.max").write_text("0")

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(self, args: list[str], **kwargs: object) -> subprocess.Popen[str]:
        """`args` started inside the cgroup (a shell puts itself in, then execs them)."""
        procs = self.folder / "cgroup.procs"
        command = f'echo $$ > "{procs}" && exec "$@"'
        return subprocess.Popen(["sh", "-c", command, "sh", *args], text=True, **kwargs)  # type: ignore[call-overload]

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """`args` run to the end inside the cgroup, stdout and stderr captured."""
        with self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
            try:
                out, err = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
            return subprocess.CompletedProcess(args, child.returncode, out, err)

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup (v1 `memory.oom_control`, v2 `memory.events`)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.folder / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        """Kill what still runs inside (by PID), then remove the cgroup."""
        if not self.folder.is_dir():
            return
        for _ in range(100):
            pids = [int(p) for p in (self.folder / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        self.folder.rmdir()
