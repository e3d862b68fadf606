"""ARCHITECTURE.md stays true to the code: every module path it names exists, and every module of `prep/` and
`loaders/` (subpackages included) is named there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PACKAGES = ("prep", "loaders")


def named_paths(text: str) -> set[str]:
    """Every backticked repository path of the page (`loaders/fast/loader.py`, `workflows/slurm/`)."""
    return set(re.findall(r"`((?:prep|loaders|workflows|tests)/[\w./-]*)`", text))


def bare_module_names(text: str) -> set[str]:
    """Backticked `*.py` names without their folder: the page names every module by its full path."""
    prefixes = ("prep/", "loaders/", "workflows/", "tests/")
    return {name for name in re.findall(r"`([\w./-]+\.py)`", text) if not name.startswith(prefixes)}


def modules(root: Path = ROOT) -> set[str]:
    """Every Python module of prep/ and loaders/, as a path from the repository root."""
    return {str(p.relative_to(root)) for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}


TEXT = ARCHITECTURE.read_text()


@pytest.mark.parametrize("path", sorted(named_paths(TEXT)))
def test_every_named_path_exists(path: str) -> None:
    assert (ROOT / path).exists(), f"ARCHITECTURE.md names {path}, which is not in the repository"


def test_every_module_is_named() -> None:
    missing = sorted(modules() - named_paths(TEXT))
    assert not missing, f"ARCHITECTURE.md does not name: {', '.join(missing)}"


def test_modules_are_named_by_full_path() -> None:
    assert not bare_module_names(TEXT), "name these by their path from the repository root"


def test_the_checks_see_drift(tmp_path: Path) -> None:
    (tmp_path / "loaders" / "tail").mkdir(parents=True)
    for name in ("loaders/__init__.py", "loaders/tail/__init__.py", "loaders/tail/new.py", "prep/cli.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    text = "`loaders/__init__.py`, `loaders/tail/` (`loaders/tail/__init__.py`), `prep/cli.py`, `buffers.py`"
    assert modules(tmp_path) - named_paths(text) == {"loaders/tail/new.py"}
    assert bare_module_names(text) == {"buffers.py"}
