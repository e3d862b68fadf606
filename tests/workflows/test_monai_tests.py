"""workflows.monai_tests: MONAI's own test files taken from a git repository at a tag, run with MONAI's class and
with the drop-in swapped in; the swap reaches the tests' `from monai.data import PersistentDataset`, and a test
only the swapped run fails is named."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("monai")

from workflows.monai_tests import main  # noqa: E402

TESTS = """
import os

from monai.data import PersistentDataset


def test_the_class_is_the_one_the_run_asks_for():
    swapped = os.environ["BLOCKPREP_SWAP"] == "1"
    assert (PersistentDataset.__name__ == "PreparedPersistentDataset") == swapped


def test_only_monais_class_passes():
    assert PersistentDataset.__module__ == "monai.data.dataset"
"""


def _repo(tmp_path: Path) -> Path:
    """A git repository shaped as MONAI's 1.4 (tests/ at the top), tagged 9.9.9."""
    repo = tmp_path / "MONAI"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "utils.py").write_text("HELPER = 1\n")
    (repo / "tests" / "test_persistentdataset.py").write_text(TESTS)
    (repo / "tests" / "test_unrelated.py").write_text("def test_never_run():\n    raise AssertionError\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tests"], ["tag", "9.9.9"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=env)
    return repo


def test_the_swap_reaches_the_tests_and_a_test_only_it_fails_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--monai-git", str(_repo(tmp_path)), "--ref", "9.9.9", "--timeout", "300"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "tests/test_persistentdataset.py @ 9.9.9, MONAI's PersistentDataset: 2 passed" in out
    assert "tests/test_persistentdataset.py @ 9.9.9, PreparedPersistentDataset: 1 passed, 1 failed" in out
    assert (
        out[-1]
        == "fails with PreparedPersistentDataset only: tests/test_persistentdataset.py::test_only_monais_class_passes"
    )
    assert not any("test_unrelated" in line for line in out)


def test_a_tag_the_repository_lacks_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = _repo(tmp_path)
    assert main(["--monai-git", str(repo), "--ref", "0.0.1"]) == 2
    assert capsys.readouterr().out == f"{repo}: no commit '0.0.1'; fetch MONAI's tags or pass --ref\n"
