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


COMMANDS = [[], ["synth"], ["synth", "nifti"], ["synth", "images"], ["bmap"], ["bmap", "verify"], ["cache"], ["verify"]]


def help_text(*cmd: str) -> str:
    result = runner.invoke(app, [*cmd, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def option_line(text: str, option: str) -> str:
    """The help line of one option (its first line: the option, its value placeholder, the start of its help)."""
    return next(line for line in text.splitlines() if line.strip().startswith(option + " "))


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_examples(cmd: list[str]) -> None:
    assert "Example: prep " in help_text(*cmd)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_no_type_placeholders(cmd: list[str]) -> None:
    """Flags take no value, so nothing follows them; valued options name what they take (N, DIR, GLOB...)."""
    text = help_text(*cmd)
    for placeholder in ("<bool>", "<str>", "<int>", "list[", "--no-"):
        assert placeholder not in text, (cmd, placeholder, text)


def test_help_lists_choices_and_marks_required() -> None:
    assert "--format <full|seed>" in option_line(help_text("bmap"), "--format")
    assert "[required, except for `bmap verify`]" in option_line(help_text("bmap"), "--mountpoint")
    cache = help_text("cache")
    for option in ("--pipeline", "--output"):
        assert "[required]" in option_line(cache, option), cache
    assert "[required]" not in option_line(cache, "--workers")
    assert option_line(help_text(), "--version").split() == ["--version", "Print", "the", "version", "and", "exit."]


def test_bad_choice_names_the_choices(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bmap", "--mountpoint", str(tmp_path), "--format", "xml"])
    assert result.exit_code == 2
    assert "'full'" in result.output and "'seed'" in result.output, result.output


def test_mountpoint_missing_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bmap", "--output", str(tmp_path / "b.json")])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: --mountpoint is required (the folder the filesystem is mounted on); see `prep bmap --help`"
    )
    assert not (tmp_path / "b.json").exists()


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


def test_the_cli_lets_idle_openmp_threads_sleep_unless_the_user_says_otherwise() -> None:
    import subprocess
    import sys

    probe = "import prep.cli, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"
