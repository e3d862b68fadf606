"""The README and the docs cannot drift: every ```bash/```sh and ```python block of README.md and docs/*.md
runs against `make demo`'s outputs, page by page (README first) in page order, in one scratch folder that looks
like the repository root (its top-level entries linked) with `demo/` made there. A page's Python blocks share
one namespace (a block may use what an earlier one of the same page defined, as a reader would); pages do not
share files they make (each names its own folders under `data/`). Shell blocks run with
`bash -e -o pipefail`. A block whose last non-blank line before the fence is `<!-- not-run: <reason> -->`
(GPU, cluster, root, minutes of work) is only syntax-checked. Every relative link of every page must name a
file that exists and, with `#anchor`, a heading of that file; every `python -m workflows.benchmark` line must
parse.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README."""

    line: int  # 1-based line of the opening fence
    lang: str  # "bash" or "python"
    code: str
    not_run: str | None  # the reason, when marked
    page: str = "README.md"  # relative to the repository root

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}-{self.lang}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The bash/sh/python blocks of a markdown text, with their not-run reasons."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        lang = {"sh": "bash", "shell": "bash"}.get(match.group(1), match.group(1))
        if lang in ("bash", "python"):
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            reason = NOT_RUN.match(before.strip())
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(i + 1, lang, code, reason and reason.group(1), page))
        i = end + 1
    return blocks


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


BLOCKS = [b for page in PAGES for b in readme_blocks(page.read_text(), page_name(page))]


def syntax_check(block: Block) -> None:
    """bash -n or compile(): the block at least parses."""
    if block.lang == "python":
        compile(block.code, f"{block.page}:{block.line}", "exec")
        return
    done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert done.returncode == 0, f"{block.page}:{block.line}: {done.stderr}"


def test_readme_has_runnable_blocks() -> None:
    assert len(PAGES) >= 10, PAGES  # the README and its docs pages
    assert sum(b.not_run is None for b in BLOCKS) >= 10, [b.id for b in BLOCKS]
    assert {b.lang for b in BLOCKS} == {"bash", "python"}
    readme = [b for b in BLOCKS if b.page == "README.md" and b.not_run is None]
    assert {b.lang for b in readme} == {"bash", "python"}, "the README's quick start runs"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_parses(block: Block) -> None:
    syntax_check(block)


def test_the_block_parser(tmp_path: Path) -> None:
    text = "x\n<!-- not-run: needs a GPU -->\n\n```bash\nmake gpu\n```\n```python\nprint(1)\n```\n```text\nno\n```\n"
    got = readme_blocks(text)
    assert [(b.line, b.lang, b.code, b.not_run) for b in got] == [
        (4, "bash", "make gpu\n", "needs a GPU"),
        (7, "python", "print(1)\n", None),
    ]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like the repository root, with `demo/` made there by `python -m workflows.demo`
    (made in place: a cache records its sources' absolute paths, as the MONAI drop-in then looks them up)."""
    root = tmp_path_factory.mktemp("readme-root")
    for entry in ROOT.iterdir():
        if entry.name not in {"demo", ".git", "bench_out", "data", ".pytest_cache", ".mypy_cache", ".ruff_cache"}:
            (root / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "workflows.demo", "--out", "demo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


NAMESPACES: dict[str, dict[str, Any]] = {}


def namespace(page: str) -> dict[str, Any]:
    """One namespace per page for its Python blocks, in page order."""
    return NAMESPACES.setdefault(page, {"__name__": "__readme__"})


@pytest.mark.slow  # the demo first (about a minute on 2 cores), then every block
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(block: Block, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.not_run is not None:
        syntax_check(block)
        pytest.skip(f"not run here: {block.not_run}")
    monkeypatch.chdir(scratch)
    if block.lang == "python":
        monkeypatch.syspath_prepend(str(ROOT))
        with warnings.catch_warnings():  # shown, not fatal: e.g. "4 DataLoader workers on a 2-core machine"
            warnings.simplefilter("default")
            exec(compile(block.code, f"{block.page}:{block.line}", "exec"), namespace(block.page))
        return
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-e", "-o", "pipefail"], input=block.code, cwd=scratch, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    where = f"{block.page}:{block.line} exited {done.returncode}"
    assert done.returncode == 0, f"{where}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def benchmark_lines(blocks: list[Block]) -> list[tuple[str, list[str]]]:
    """Every `python -m workflows.benchmark ...` command of the shell blocks (run or not), as (page:line, argv)."""
    import shlex

    out = []
    for block in blocks:
        if block.lang != "bash":
            continue
        logical, start = "", 0
        for k, line in enumerate(block.code.splitlines()):
            logical, start = (logical + " " + line, start) if logical else (line, k)
            if logical.endswith("\\"):  # a continued line: read on
                logical = logical[:-1]
                continue
            words = shlex.split(logical, comments=True)
            logical = ""
            if words[:3] == ["python", "-m", "workflows.benchmark"]:
                out.append((f"{block.page}:{block.line + 1 + start}", words[3:]))
    return out


@pytest.mark.parametrize(("line", "argv"), benchmark_lines(BLOCKS), ids=lambda v: v if isinstance(v, str) else "")
def test_readme_benchmark_lines_parse(line: str, argv: list[str]) -> None:
    """Even a benchmark line that is not run here names a subcommand and options that exist."""
    import typer

    from workflows import benchmark
    from workflows.bench import load_scenarios

    benchmark._register()
    names = set(load_scenarios())
    args = benchmark.hoist_global_options(argv, names)
    at = next((i for i, a in enumerate(args) if a in names), None)
    assert at is not None, f"{line}: no known subcommand in {argv}"
    group = typer.main.get_command(benchmark.app)
    ctx = group.make_context("benchmark", args[: at + 1])  # raises click's usage error on a bad global option
    command = group.get_command(ctx, args[at])  # type: ignore[attr-defined]
    command.make_context(args[at], args[at + 1 :], parent=ctx)  # ... and on the subcommand's options


@pytest.mark.parametrize("argv", [["cache", "--laps", "4"], ["--batchsize", "x", "dali", "--datadir", "d"],
                                  ["nope"], ["dali"]])  # fmt: skip
def test_the_benchmark_line_check_refuses_drift(argv: list[str]) -> None:
    with pytest.raises((AssertionError, click_error())):
        test_readme_benchmark_lines_parse("test", argv)


def click_error() -> type[Exception]:
    """The base of the usage errors of typer's click (typer vendors it)."""
    import typer

    return typer.BadParameter.__mro__[1]  # UsageError


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text with every fenced block blanked (line numbers kept): links and headings live outside them."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces to hyphens,
    `-1`, `-2`... after a repeat."""
    seen: dict[str, int] = {}
    for line in prose(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if match:
            base = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            seen[f"{base}-{seen[base]}" if base in seen else base] = 0
            seen[base] = seen.get(base, 0) + 1
    return set(seen)


def broken_links(page: Path) -> list[str]:
    """Every relative link of `page` whose file, or heading after `#`, does not exist."""
    text = page.read_text()
    bad = []
    for match in LINK.finditer(prose(text)):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path) if path else page
        where = f"{page_name(page) if page.is_relative_to(ROOT) else page}:{text.count(chr(10), 0, match.start()) + 1}"
        if not dest.exists():
            bad.append(f"{where}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{where}: {target}: no heading with that anchor in {path or 'this page'}")
    return bad


LINKED = [*PAGES, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "workflows").glob("*/README.md"))]


@pytest.mark.parametrize("page", LINKED, ids=page_name)
def test_links_resolve(page: Path) -> None:
    assert not broken_links(page)


def test_the_link_check_refuses_drift(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## `prep cache`: one, two\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Here\n[a](other.md#prep-cache-one-two) [b](other.md#twice-1) [c](#here) [d](https://x.org/#y)\n"
        "[e](missing.md) [f](other.md#nope)\n```bash\n[g](inside-a-fence.md)\n```\n[h\nsplit](#nowhere)\n"
    )
    assert [line.split(": ", 1)[1] for line in broken_links(page)] == [
        "missing.md: no such file",
        "other.md#nope: no heading with that anchor in other.md",
        "#nowhere: no heading with that anchor in this page",
    ]


def stale_names(page: Path) -> list[str]:
    """Backticked repository paths (`workflows/slurm/train.sbatch`, `.ci/run`) that do not exist, and dotted
    names (`loaders.cache.chain.compare_versions`) whose module is not there or does not mention the last name."""
    text = prose(page.read_text())
    bad = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip("()").split("(")[0]
        if re.match(r"^(prep|loaders|workflows|tests|docs|\.ci)/[\w./-]+$", token):
            if not (ROOT / token).exists():
                bad.append(f"{token}: no such path")
        elif re.match(r"^(prep|loaders|workflows)(\.\w+)+$", token):
            parts, at = token.split("."), ROOT
            for part in parts:
                if (at / part).is_dir():
                    at = at / part
                elif (at / f"{part}.py").is_file():
                    at = at / f"{part}.py"
                else:
                    source = (at / "__init__.py" if at.is_dir() else at).read_text()
                    if not re.search(rf"\b{re.escape(part)}\b", source):
                        bad.append(f"{token}: {part} is not in {at.relative_to(ROOT)}")
                    break
    return bad


@pytest.mark.parametrize("page", LINKED, ids=page_name)
def test_named_modules_and_paths_exist(page: Path) -> None:
    assert not stale_names(page)


def test_the_name_check_refuses_drift(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`loaders.cache.chain.compare_versions` `loaders.PreparedLoader` `prep/cli.py` `loaders.tail.batched_names()`\n"
        "`loaders.nope` `loaders.cache.chain.no_such_name` `workflows/nothing.sh` `.ci/none`\n"
    )
    assert stale_names(page) == [
        "loaders.nope: nope is not in loaders",
        "loaders.cache.chain.no_such_name: no_such_name is not in loaders/cache/chain.py",
        "workflows/nothing.sh: no such path",
        ".ci/none: no such path",
    ]
