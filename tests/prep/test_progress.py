"""prep.progress: periodic log lines without a terminal, a tqdm bar on one."""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path

from prep.progress import Progress, format_duration


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_every_interval_and_at_the_end() -> None:
    out = io.StringIO()
    with Progress(total=4, desc="prep cache", interval=0.0, stream=out) as progress:
        for _ in range(3):
            progress.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert [re.match(r"prep cache: (\d+)/4 items, [\d.]+ items/s", line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "1",
        "2",
        "3",
        "3",
    ]
    assert "ETA" in lines[0]
    assert "\r" not in out.getvalue()  # no bar redraws in a log file


def test_no_line_before_the_interval_one_at_the_end() -> None:
    out = io.StringIO()
    with Progress(total=10, desc="bmap", unit="files", interval=1e9, stream=out) as progress:
        progress.update(4)
        progress.update(6)
        assert out.getvalue() == ""
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("bmap: 10/10 files, ")
    assert "elapsed" in lines[0] and "ETA" not in lines[0]


def test_unknown_total_and_reset() -> None:
    out = io.StringIO()
    progress = Progress(total=None, desc="walk", interval=0.0, stream=out)
    with progress:
        progress.update(2)
        progress.reset(5)
        progress.update(1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("walk: 2 items, ")
    assert lines[1].startswith("walk: 3/5 items, ")


def test_nothing_done_writes_nothing() -> None:
    out = io.StringIO()
    with Progress(total=None, desc="prep cache", stream=out):
        pass
    assert out.getvalue() == ""


def test_updates_from_threads_are_all_counted() -> None:
    out = io.StringIO()
    with Progress(total=800, desc="x", interval=1e9, stream=out) as progress:
        threads = [threading.Thread(target=lambda: [progress.update() for _ in range(200)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert progress.n == 800
    assert out.getvalue().startswith("x: 800/800 items")


def test_tty_gets_a_bar() -> None:
    out = _TTY()
    with Progress(total=3, desc="synth", unit="pairs", interval=0.0, stream=out) as progress:
        progress.update(3)
    text = out.getvalue()
    assert "synth" in text and "/3" in text and "pair/s" in text
    assert "\r" in text and "ETA" not in text  # the bar, not the log lines
    assert progress.n == 3


def test_format_duration() -> None:
    assert format_duration(25.4) == "25 s"
    assert format_duration(185) == "3 min 5 s"
    assert format_duration(7800) == "2 h 10 min"


def test_prep_cache_logs_progress_without_a_tty(tmp_path: Path, nifti_dataset: Path) -> None:
    from typer.testing import CliRunner

    from prep.cli import app

    pipeline = Path(__file__).resolve().parents[2] / "workflows" / "pipelines" / "spheres.py"
    args = ["cache", str(nifti_dataset), "--pipeline", str(pipeline), "--output", str(tmp_path / "c"), "--workers", "1"]
    result = CliRunner().invoke(app, [*args, "--verify"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^prep cache: 6/6 items, [\d.]+ items/s, ", result.output, re.M), result.output
    assert ": 6 items: 6 cached; 6 processed in this run (" in result.output
    assert "verify: ok: manifest, index.npy, meta.jsonl, meta_offsets.npy match their checksums" in result.output
    assert "every tensor re-read and matches its checksum (12 tensors)" in result.output
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "6 items: 6 cached; already complete and up to date" in result.output
