"""A cache never picks the code that runs (the training example runs the pipeline the user names, or the shipped
demo pipeline when the cache was made with exactly that file); `prep verify` decodes every meta line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from craft import copy_cache, reseal, rewrite_meta
from typer.testing import CliRunner

from prep.cli import app
from workflows import train_seg3d


def test_recorded_pipeline_is_never_run(good_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = copy_cache(good_cache, tmp_path / "cache")
    marker = tmp_path / "ran"
    evil = cache / "pipeline.py"  # handed over with the cache, its checksum recorded by whoever made it
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ntransform = []\n")
    digest = hashlib.sha256(evil.read_bytes()).hexdigest()
    reseal(cache, lambda doc: doc.update(pipeline=str(evil), pipeline_sha256=digest))
    with pytest.raises(SystemExit) as info:
        train_seg3d.main(["--cache", str(cache), "--iters", "1", "--channels", "4,8", "--workers", "0"])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--pipeline" in err and str(evil) in err, err
    assert not marker.exists()


def test_shipped_pipeline_used_when_made_with_it(good_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_seg3d.choose_pipeline(good_cache, None) == train_seg3d.DEFAULT_PIPELINE
    assert "same file" in capsys.readouterr().out
    named = Path("mine.py")
    assert train_seg3d.choose_pipeline(good_cache, named) is named


def test_recorded_default_path_with_other_bytes_refused(good_cache: Path, tmp_path: Path) -> None:
    from prep.errors import UsageError

    cache = copy_cache(good_cache, tmp_path / "cache")
    reseal(cache, lambda doc: doc.update(pipeline=str(train_seg3d.DEFAULT_PIPELINE), pipeline_sha256="0" * 64))
    with pytest.raises(UsageError, match="--pipeline"):
        train_seg3d.choose_pipeline(cache, None)


def test_verify_decodes_every_meta_line(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "cache")
    huge = {"__nd__": "<U100000000", "s": [1], "v": ["x"]}

    def edit(item: int, line: dict) -> dict:
        if item == 2:
            line["values"] = {"crafted": huge}
        return line

    rewrite_meta(cache, edit)
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    out = result.output.strip()
    assert "\n" not in out and "meta.jsonl: item 2" in out, out
