from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prep.cli import app

runner = CliRunner()


def invoke(*args: str):  # type: ignore[no-untyped-def]
    result = runner.invoke(app, list(args))
    return result


@pytest.mark.parametrize(
    "cmd",
    [[], ["synth"], ["synth", "nifti"], ["synth", "images"], ["bmap"], ["bmap", "verify"], ["cache"], ["verify"]],
)
def test_help_has_examples(cmd: list[str]) -> None:
    result = invoke(*cmd, "--help")
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_synth_nifti_writes_datalist(tmp_path: Path) -> None:
    result = invoke("synth", "nifti", str(tmp_path / "d"), "--count", "2", "--size", "16")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "dataset.json").exists()


def test_synth_images(tmp_path: Path) -> None:
    result = invoke("synth", "images", str(tmp_path / "i"), "--classes", "2", "--per-class", "2", "--size", "16")
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "i" / "train").rglob("*.JPEG"))) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count", "0"], "--count must be at least 1"),
        (["--size", "2"], "--size must be at least 8"),
    ],
)
def test_bad_arguments_one_line_exit_1(tmp_path: Path, args: list[str], message: str) -> None:
    result = invoke("synth", "nifti", str(tmp_path / "d"), *args)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_parent_exit_1(tmp_path: Path) -> None:
    result = invoke("synth", "nifti", str(tmp_path / "missing" / "d"))
    assert result.exit_code == 1
    assert "does not exist" in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_parent_exit_1_nonroot(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    result = invoke("synth", "nifti", str(ro / "d"))
    assert result.exit_code == 1


def test_unwritable_path_exit_1(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # a path under a regular file cannot be created, even by root
    result = invoke("synth", "images", str(blocker / "d"))
    assert result.exit_code == 1
    assert "error:" in result.output


def test_version() -> None:
    from loaders import __version__

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"blockprep {__version__}"
