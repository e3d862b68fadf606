"""MONAI's own tests of `PersistentDataset`, run twice: with MONAI's class, then with `PreparedPersistentDataset`
in its place (`monai.data.PersistentDataset` swapped before the tests import it; nothing else changed).

    python -m workflows.monai_tests --monai-git ~/src/MONAI          # the installed MONAI's release tag
    python -m workflows.monai_tests --monai-git MONAI.git --ref 1.5.0

MONAI's test files are in its git repository only (its PyPI sdist has no tests/): give a clone (or a bare git
folder); the files are taken at the tag of the installed MONAI's version (`git show`), written to a temporary
folder with MONAI's test helpers, and run by pytest (needs `parameterized`, MONAI's test dependency). Prints
one line per test file and run, and exits 1 where the swapped class fails a test that MONAI's class passes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# the PersistentDataset tests (MONAI 1.4 keeps them in tests/, 1.5 on in tests/data/), their selections
TESTS = {
    "test_persistentdataset.py": "",
    "test_cachedataset.py": "TestCacheThread",  # the class of that file that runs PersistentDataset
}
DIST = "test_persistentdataset_dist.py"  # two ranks over gloo: --dist
SWAP = """
import os

if os.environ.get("BLOCKPREP_SWAP") == "1":
    import monai.data

    from loaders import PreparedPersistentDataset

    monai.data.PersistentDataset = PreparedPersistentDataset
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def installed_monai() -> str:
    import monai

    return str(monai.__version__).split("+")[0]


def test_files(repo: Path, ref: str, dist: bool) -> tuple[list[str], list[str]]:
    """(MONAI's test helper files, the PersistentDataset test files) at `ref`, as repository paths."""
    names = git(repo, "ls-tree", "-r", "--name-only", ref, "tests").split()
    helpers = [n for n in names if re.fullmatch(r"tests/(__init__|utils|test_utils)\.py|tests/utils/.*\.py", n)]
    wanted = set(TESTS) | ({DIST} if dist else set())
    found = [n for n in names if os.path.basename(n) in wanted]
    return helpers, found


def write_tree(repo: Path, ref: str, paths: list[str], root: Path) -> None:
    """The files at `ref` under `root` (their repository paths kept), with the swap in a conftest.py."""
    for rel in paths:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(git(repo, "show", f"{ref}:{rel}"))
    (root / "conftest.py").write_text(SWAP)
    for folder in {(root / rel).parent for rel in paths}:
        (folder / "__init__.py").touch(exist_ok=True)


def run(root: Path, selections: list[str], swap: bool, timeout: int) -> dict[str, str]:
    """pytest over `selections` in `root`: {test id: outcome}, with the class swapped or not."""
    env = {**os.environ, "BLOCKPREP_SWAP": "1" if swap else "0", "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=", *selections]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return {sel: "TIMEOUT" for sel in selections}
    return dict(
        (m.group(2), m.group(1)) for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", out, re.MULTILINE)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--monai-git", type=Path, required=True, help="a clone of MONAI's repository")
    parser.add_argument("--ref", default=None, help="tag or commit (default: the installed MONAI's version)")
    parser.add_argument("--dist", action="store_true", help=f"also {DIST} (two processes; minutes)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for each pytest run")
    opts = parser.parse_args(argv)
    ref = opts.ref or installed_monai()
    try:
        git(opts.monai_git, "rev-parse", "--verify", f"{ref}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError):
        why = "" if opts.ref else " (the installed MONAI's version)"
        print(f"{opts.monai_git}: no commit {ref!r}{why}; fetch MONAI's tags or pass --ref")
        return 2
    helpers, found = test_files(opts.monai_git, ref, opts.dist)
    if not found:
        print(f"{opts.monai_git}: no PersistentDataset tests at {ref}; pass another --ref")
        return 2
    with tempfile.TemporaryDirectory(prefix="monai-tests-") as tmp:
        root = Path(tmp)
        write_tree(opts.monai_git, ref, helpers + found, root)
        selections = [f"{rel}::{TESTS[os.path.basename(rel)]}".rstrip(":") for rel in found]
        mine = {sel: run(root, [sel], False, opts.timeout) for sel in selections}
        swapped = {sel: run(root, [sel], True, opts.timeout) for sel in selections}
    return report(ref, mine, swapped)


def report(ref: str, mine: dict[str, dict[str, str]], swapped: dict[str, dict[str, str]]) -> int:
    """One line per selection and class; the tests the swap fails where MONAI passes, each on its own line."""
    worse = []
    for sel in mine:
        for name, got in (("MONAI's PersistentDataset", mine[sel]), ("PreparedPersistentDataset", swapped[sel])):
            counts = {o: sum(v == o for v in got.values()) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED", "TIMEOUT")}
            print(f"{sel} @ {ref}, {name}: " + ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n))
        worse += [t for t, o in swapped[sel].items() if o != "PASSED" and mine[sel].get(t) == "PASSED"]
    for test in worse:
        print(f"fails with PreparedPersistentDataset only: {test}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
