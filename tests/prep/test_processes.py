"""prep cache's worker processes (prep.processes): started by a forkserver at any worker count, never forked
from `prep cache`'s own multi-threaded process, and preparing the cache that threads prepare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cacheutil import SPHERES
from clusterutil import assert_same_cache, subprocess_env

from prep.cache import prepare_cache
from prep.cache_verify import verify_cache

# Python 3.12's filelock raised "os.fork is unsafe while filelock is changing descriptor ownership" from an
# audit hook when distributed's start threads forked at once; this hook refuses every fork of this process.
NO_FORK = """
import sys

def refuse_fork(event, args):
    if event in ("os.fork", "os.forkpty"):
        raise RuntimeError(f"{event} from prep cache's own process")

if __name__ == "__main__":
    sys.addaudithook(refuse_fork)
    from prep.cache import prepare_cache

    summary = prepare_cache(sys.argv[1], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]), processes=True)
    print(summary.mode, summary.n_items, f"worker CPU {summary.worker_cpu_s:.1f} s")
"""


@pytest.mark.slow
def test_four_worker_processes_never_fork_prep_cache_and_prepare_the_threads_cache(
    tmp_path: Path, nifti_dataset: Path
) -> None:
    script = tmp_path / "no_fork.py"
    script.write_text(NO_FORK)
    out = tmp_path / "processes"
    proc = subprocess.run([sys.executable, str(script), str(nifti_dataset), str(SPHERES), str(out), "4"],
                          capture_output=True, text=True, timeout=600, env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("4 processes 6 worker CPU ") and float(line.split()[5]) > 0, proc.stdout
    threads = tmp_path / "threads"
    prepare_cache(nifti_dataset, SPHERES, threads, workers=2, processes=False)
    assert_same_cache(threads, out)
    assert verify_cache(out) == []


FROZEN = """
import gc
import json

import sys


def given():
    from loaders.cache import chain

    return len(chain._GIVEN)


if __name__ == "__main__":
    from prep.cluster import ClusterStarter
    from prep.pipeline import load_pipeline

    load_pipeline(sys.argv[1])  # prep cache's planning: its fingerprint analyses the transforms' classes
    with ClusterStarter(2, None, processes=True, pipeline=sys.argv[1]) as starter:
        counts = starter.client().run(gc.get_freeze_count)
        taken = starter.client().run(given)
    print(json.dumps({"workers": sorted(counts.values()), "own": gc.get_freeze_count(), "given": list(taken.values())}))
"""


@pytest.mark.slow
def test_worker_processes_start_frozen_and_take_the_planners_class_analysis(tmp_path: Path) -> None:
    """The forkserver freezes what it imported (prep.frozen): a worker's garbage collector leaves those objects'
    shared pages alone (16-core box, spheres W16: 51.7k -> 12.5k page faults and 0.77 -> 0.26 CPU s a worker
    at its start); `prep cache`'s own process is not frozen. Workers warm with what the planner found of the
    transforms' classes (`loaders.cache.chain.take_runtime_attrs`)."""
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    proc = subprocess.run([sys.executable, str(script), str(SPHERES)], capture_output=True, text=True, timeout=600,
                          env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["workers"]) == 2 and all(n > 10_000 for n in got["workers"]), proc.stdout  # torch, MONAI
    assert got["own"] == 0
    assert len(got["given"]) == 2 and min(got["given"]) >= 4  # the head's classes, analysed once by the planner
