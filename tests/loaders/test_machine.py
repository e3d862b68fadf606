"""The memory a process may still use is its memory cgroup's where that is less than the machine's: read from a
real cgroup (v1 or v2) made for the test, with processes placed in it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loaders.machine import available_memory, cgroup_headroom, memory_cgroup
from workflows.bench.memcg import MemoryCgroup, cgroup_reason

MiB = 1 << 20
LIMIT = 256 * MiB

# run inside the cgroup: where this process finds its cgroup, its headroom and what it may allocate, before and
# after holding 64 MiB of its own memory and after reading a 64 MiB file once (its page cache, charged here)
_PROBE = """
import json, os, sys
from loaders.machine import available_memory, cgroup_headroom, memory_cgroup
def now():
    found = memory_cgroup()
    return {"folder": str(found[0]), "version": found[1], "headroom": cgroup_headroom(found),
            "available": available_memory()}
out = {"start": now()}
held = bytearray(64 << 20)
held[:: 4096] = b"x" * len(held[:: 4096])
out["held"] = now()
del held
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 20):
        pass
out["read"] = now()
print(json.dumps(out))
"""


@pytest.fixture
def cgroup() -> MemoryCgroup:
    reason = cgroup_reason()
    if reason:
        pytest.skip(reason)
    with MemoryCgroup(LIMIT) as made:
        yield made


def _probe(cgroup: MemoryCgroup, tmp_path: Path) -> dict[str, dict[str, object]]:
    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * (64 * MiB))
    from workflows.bench.core import evict

    evict([str(data)], drop_caches=False)  # read inside the cgroup, its page cache charged there
    root = str(Path(__file__).resolve().parents[2])
    done = cgroup.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r})\n{_PROBE}", str(data)], 120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_process_in_a_memory_cgroup_is_given_its_limit_less_its_usage(cgroup: MemoryCgroup, tmp_path: Path) -> None:
    got = _probe(cgroup, tmp_path)
    start, held = got["start"], got["held"]
    assert start["folder"] == str(cgroup.folder) and start["version"] == cgroup.version
    assert 0 < start["headroom"] < LIMIT  # type: ignore[operator]  # the interpreter's own pages are used
    assert start["available"] <= LIMIT  # type: ignore[operator]  # not the machine's MemAvailable
    # the 64 MiB it holds are gone from its headroom (within what the interpreter allocated meanwhile)
    drop = start["headroom"] - held["headroom"]  # type: ignore[operator]
    assert 60 * MiB <= drop <= 80 * MiB


def test_the_page_cache_a_cgroup_filled_counts_as_free(cgroup: MemoryCgroup, tmp_path: Path) -> None:
    """A cgroup's usage counts the page cache its reads filled; the kernel reclaims it before killing anything, so
    the headroom after reading a 64 MiB file once is nearly what it was before."""
    got = _probe(cgroup, tmp_path)
    assert got["start"]["headroom"] - got["read"]["headroom"] < 16 * MiB  # type: ignore[operator]


def test_a_cgroup_without_a_limit_gives_no_headroom() -> None:
    reason = cgroup_reason()
    if reason:
        pytest.skip(reason)
    with MemoryCgroup(None) as unlimited:
        assert cgroup_headroom((unlimited.folder, unlimited.version)) is None
        with MemoryCgroup(LIMIT) as limited:  # a sibling with a limit: its own, not its neighbour's
            room = cgroup_headroom((limited.folder, limited.version))
            assert room is not None and 0 < room <= LIMIT


def test_this_process_and_a_process_without_a_cgroup() -> None:
    """Outside any limit the machine's MemAvailable; a process that is gone has no cgroup."""
    assert available_memory() > 0
    assert memory_cgroup(2**22 + 12345) is None
    assert cgroup_headroom(None) is None
