"""The benchmark behind `python -m workflows.benchmark`: one harness, one small module per scenario.

Harness (shared by every scenario):
    core.py      Options (the global flags), Result (one table row), Rows (rows + ways that could not run),
                 timing, page-cache eviction, `optional()` / `cuda_available()` for optional packages
    ceilings.py  the same bytes moved as fast as this machine moves them: O_DIRECT with many requests in
                 flight (cold), `np.fromfile` (warm), kvikio (GPU)
    report.py    ratios, the text table, bench.csv / bench.json / bench.png

Scenarios (each registers its subcommands when imported; `load_scenarios()` imports every module here):
    ways.py      `all` and `prepared` (blockprep's own reads), over the `make demo` layout
    peers.py     MONAI Dataset / PersistentDataset / CacheDataset / GDSDataset, DALI readers.numpy
    research.py  the research loaders' command lines (dali, python-file, xnvme-file, xnvme-gds, ...)
    research_readers.py  `dali-readers`: the ways of feeding one DALI pipeline, against readers.file
    loaders.py   PreparedDataset per backend on synthetic volumes, GPU rows, region reads
    backends.py  every backend on the same byte ranges
    bmap.py      `prep bmap` against filefrag, raw range reads (root: loop-mounted ext4)
    cache.py     `prep cache` against MONAI PersistentDataset's first pass; opening a big index
    cold_rate.py `cold-rate`: a cold epoch's read rate against the disk's, the loader in a memory cgroup

Adding a scenario is one file here, e.g. workflows/bench/hello.py:

    from typing import Annotated
    import typer
    from workflows.bench import scenario
    from workflows.bench.core import Options, Result, Rows

    @scenario("hello", "What it measures, in one line.")
    def hello(opts: Options, size: Annotated[int, typer.Option(help="bytes per item")] = 4096) -> Rows:
        rows = Rows()
        rows.add("hello world", lambda: Result("hello", "bytes", opts.items, 1.0, opts.items * size, "ours"))
        return rows

The first parameter receives the global options (`--batchsize --batches --cold/--warm --device --workers
--out`, accepted before or after the subcommand); the others become the subcommand's own typer options.
The harness prints the table, writes bench.csv/json/png under `--out`, and exits 1 when nothing but
ceilings could be measured. Add a smoke test under tests/workflows/ that runs it at a tiny size.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SCENARIOS", "Scenario", "load_scenarios", "scenario"]


@dataclass(frozen=True)
class Scenario:
    """One subcommand: its name, one-line help and the function that measures."""

    name: str
    help: str
    run: Callable[..., Any]


SCENARIOS: dict[str, Scenario] = {}
_HARNESS = {"core", "ceilings", "report"}


def scenario(name: str, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # noqa: A002
    """Register `fn(opts, **options) -> Rows` as the subcommand `name` (decorator; returns `fn` unchanged)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in SCENARIOS and SCENARIOS[name].run is not fn:
            raise ValueError(f"benchmark scenario {name!r} is registered twice")
        SCENARIOS[name] = Scenario(name, help, fn)
        return fn

    return register


def load_scenarios() -> dict[str, Scenario]:
    """Import every module of this package (each registers its scenarios); returns the registry."""
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _HARNESS and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    return SCENARIOS
