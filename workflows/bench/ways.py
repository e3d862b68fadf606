"""`all`: every way that applies to a `make demo` folder, one table; `prepared`: blockprep's reads of a cache.

`all --data DIR` expects the demo layout: DIR/nifti/dataset.json, DIR/images/train, DIR/cache,
DIR/bmap.json. Every way first makes one untimed pass over the same items (imports, thread pools and
pipeline builds stay out of the timing); `--cold` then evicts its files from the page cache before the
timed pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from workflows.bench import ceilings, ours, peers, research, scenario
from workflows.bench.core import Options, Rows

DEFAULT_PIPELINE = Path(__file__).parents[1] / "pipelines" / "spheres.py"
PIPELINE_OPTION = typer.Option(help="PIPELINE.py (or bundle config) whose deterministic head is run")


def prepared_rows(rows: Rows, cache: Path, backend: str, opts: Options, bmap: Path | None = None) -> None:
    """blockprep PreparedDataset over `cache` with one backend (blockdev reads the shards via their bmap)."""
    rows.add(f"prepared --backend {backend}", lambda: ours.prepared(cache, backend, opts,
                                          **ours.backend_options(backend, bmap or cache / "bmap.json")))  # fmt: skip


@scenario("prepared", "blockprep PreparedDataset over a prepared cache, with one backend.")
def prepared(
    opts: Options,
    cache: Annotated[Path, typer.Option(help="prepared cache folder (e.g. demo/cache)")],
    backend: Annotated[str, typer.Option(help="backend: " + ", ".join(ours.BACKENDS))] = "auto",
    bmap: Annotated[Path | None, typer.Option(help="the shards' bmap (default CACHE/bmap.json)")] = None,
) -> Rows:
    rows = Rows()
    ceilings.volume_ceilings(rows, cache, opts)
    prepared_rows(rows, cache, backend, opts, bmap)
    return rows


def run_all(data: Path, opts: Options, pipeline: Path = DEFAULT_PIPELINE) -> Rows:
    """Every way that applies to a demo-layout folder."""
    rows = Rows(title=f"every way over {data}")
    cache, datalist, train = data / "cache", data / "nifti" / "dataset.json", data / "images" / "train"
    ceilings.volume_ceilings(rows, cache, opts)
    for backend in ours.BACKENDS:
        prepared_rows(rows, cache, backend, opts)
    rows.extend(peers.volume_peers(datalist, pipeline, cache, opts))
    ceilings.image_ceilings(rows, lambda: research.tree_files(train)[0], opts)
    rows.add("blockprep-dali", lambda: research.blockprep_dali(opts, train))
    rows.add("blockprep-dali --bmap", lambda: research.blockprep_dali(opts, train, data / "bmap.json", "blockdev"))
    rows.add("dali", lambda: research.dali_file(train, opts))
    rows.add("python-file", lambda: research.python_file(train, opts))
    rows.add("xnvme-file", lambda: research.xnvme_file(train, opts))
    mem = "gpu" if opts.gpu else "cpu"
    rows.add("xnvme-gds", lambda: research.xnvme_gds(None, data / "bmap.json", mem, opts, datadir=train.parent))
    rows.add("xnvme-bam", lambda: research.xnvme_bam(None, data / "bmap.json", opts, datadir=train.parent))
    return rows


@scenario("all", "Every way that applies to a `make demo` folder: one table, every peer and ceiling.")
def every_way(
    opts: Options,
    data: Annotated[Path, typer.Option(help="folder made by `make demo`")],
    pipeline: Annotated[Path, PIPELINE_OPTION] = DEFAULT_PIPELINE,
) -> Rows:
    if not data.is_dir():
        raise typer.BadParameter(f"{data}: no such folder; run `make demo` first", param_hint="--data")
    return run_all(data, opts, pipeline)
