"""prep cache over a grown or changed datalist: only new and changed entries are prepared, the rest kept, and the
committed cache equals a clean --force run on the new datalist (every item's tensors and meta), after a kill -9
too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cacheutil import REPO, SPHERES, same_as_clean, slow_pipeline
from typer.testing import CliRunner

import prep.worker
from loaders.cache.format import PreparedCache
from loaders.cache.spec import JOURNAL_DIR
from prep.cache import prepare_cache
from prep.cli import app
from prep.errors import StaleError
from prep.synth import nifti_dataset

SLOW_PIPELINE = slow_pipeline(0.3)


def _entries(tmp_path: Path, count: int) -> list[dict[str, str]]:
    """`count` image/label pairs as absolute entries."""
    datalist = nifti_dataset(tmp_path / "data", count=count, size=16, seed=3)
    doc = json.loads(datalist.read_text())
    return [{k: str(datalist.parent / v) for k, v in e.items()} for e in doc["training"]]


def _datalist(path: Path, entries: list[dict[str, str]]) -> Path:
    path.write_text(json.dumps({"training": entries}))
    return path


def test_grown_and_changed_datalist_prepares_only_those(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = _entries(tmp_path, 8)
    out = tmp_path / "cache"
    prepare_cache(_datalist(tmp_path / "a.json", e[:6]), SPHERES, out, workers=1, processes=False)
    changed = {"image": e[2]["image"], "label": e[7]["label"]}
    # one new (e[6], listed second), one changed (e[2]'s label), one dropped (e[3]), the rest kept and moved
    grown = _datalist(tmp_path / "b.json", [e[0], e[6], e[1], changed, e[4], e[5]])
    computed: list[dict[str, Any]] = []
    real = prep.worker._prepare_one

    def counted(head: Any, shards: Any, item: int, entry: dict[str, Any], *rest: Any) -> dict[str, Any]:
        computed.append(entry)
        return real(head, shards, item, entry, *rest)

    monkeypatch.setattr(prep.worker, "_prepare_one", counted)
    summary = prepare_cache(grown, SPHERES, out, workers=1, processes=False)
    assert sorted(computed, key=str) == sorted([e[6], changed], key=str)
    assert (summary.n_new, summary.n_kept, summary.n_dropped, summary.n_items) == (2, 4, 2, 6)
    assert "4 kept from the cache made from the earlier datalist (2 no longer listed, dropped)" in summary.lines()[0]
    monkeypatch.undo()
    same_as_clean(tmp_path, grown, SPHERES, out)
    again = prepare_cache(grown, SPHERES, out, workers=1, processes=False)  # now current: nothing to do
    assert again.up_to_date and again.n_new == 0


def test_cli_grown_datalist_without_force(tmp_path: Path) -> None:
    e = _entries(tmp_path, 4)
    out = tmp_path / "cache"
    runner = CliRunner()
    cmd = ["--pipeline", str(SPHERES), "--output", str(out), "--workers", "1"]
    first = runner.invoke(app, ["cache", str(_datalist(tmp_path / "a.json", e[:3])), *cmd])
    assert first.exit_code == 0, first.output
    grown = runner.invoke(app, ["cache", str(_datalist(tmp_path / "b.json", e)), *cmd])
    assert grown.exit_code == 0, grown.output
    assert "4 items: 4 cached; 1 processed in this run" in grown.output
    assert "3 kept from the cache made from the earlier datalist (0 no longer listed, dropped)" in grown.output
    assert len(PreparedCache(out)) == 4


def test_a_changed_head_is_still_stale(tmp_path: Path) -> None:
    e = _entries(tmp_path, 3)
    out = tmp_path / "cache"
    prepare_cache(_datalist(tmp_path / "a.json", e[:2]), SPHERES, out, workers=1, processes=False)
    other = tmp_path / "pipe.py"
    other.write_text(SPHERES.read_text().replace("pixdim=(1.0, 1.0, 1.0)", "pixdim=(2.0, 2.0, 2.0)"))
    with pytest.raises(StaleError, match=r"pipeline head settings changed.*datalist changed \(2 -> 3.*--force"):
        prepare_cache(_datalist(tmp_path / "b.json", e), other, out, workers=1, processes=False)


def _journaled(out: Path) -> set[int]:
    """Items the journals name (torn lines skipped)."""
    items = set()
    for path in (out / JOURNAL_DIR).glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            try:
                items.add(int(json.loads(line)["item"]))
            except (ValueError, KeyError):
                continue
    return items


@pytest.mark.slow
def test_kill9_mid_regrow_resumes_to_the_clean_cache(tmp_path: Path) -> None:
    e = _entries(tmp_path, 12)
    pipe = tmp_path / "slow.py"
    pipe.write_text(SLOW_PIPELINE)
    out = tmp_path / "cache"
    prepare_cache(_datalist(tmp_path / "a.json", e[:4]), pipe, out, workers=1, processes=False)
    grown = _datalist(tmp_path / "b.json", e[4:8] + e[:4] + e[8:])  # 4 kept (moved), 8 new
    cmd = [sys.executable, "-m", "prep", "cache", str(grown), "--pipeline", str(pipe), "--output", str(out),
           "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_journaled(out)) < 6 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert 6 <= len(_journaled(out)) < 12, "the kill should land mid-run"
    assert not (out / "manifest.json").exists()
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "12 items: 12 cached" in again.stdout and "resumed from the journal" in again.stdout
    same_as_clean(tmp_path, grown, pipe, out)
    assert np.unique([e.shard for n in range(12) for e in PreparedCache(out).entries(n)]).size >= 2
