"""The research set's `dali-readers` scenario: the ways of feeding one DALI pipeline the same class tree,
ranked against `fn.readers.file` (same files, same order, same batch): the research code's Python iterator,
blockprep's FileSource and BmapSource, and the pipeline's own bound (one batch held, no reading). Every timed
pass keeps a digest of its labels: a way whose labels differ is a wrong reader, not a slow one.

    python -m workflows.benchmark --batchsize 64 --batches 1000 dali-readers --datadir /data --bmap bmap.json
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import ceilings, scenario
from workflows.bench.core import Options, Result, Rows, cycle
from workflows.bench.research import (
    _DATADIR,
    DECODE,
    LABELS,
    _dali,
    _decode,
    _pipeline,
    blockprep_dali,
    dali_file,
    python_read,
    run_pipeline,
    train_dir,
    tree_files,
)


def same_labels(rows: Rows, peer: str) -> None:
    """Replace each row's labels digest by whether it equals the peer's (the same labels in the same order),
    and say so under the table; a difference is a wrong reader, not a slow one."""
    want = next((r.extra.get("labels") for r in rows.results if r.name == peer), None)
    differ = []
    for r in rows.results:
        got = r.extra.pop("labels", None)
        if got is not None and want is not None and r.name != peer:
            r.extra["labels"] = "= peer" if got == want else "DIFFER"
            differ += [r.name] if got != want else []
    if want is not None:
        rows.footer.append(f"labels: {'DIFFER in ' + ', '.join(differ) if differ else 'every way = ' + peer}")


def held_batch(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """The pipeline's own bound: an `external_source` handed the same batch, read once, every time (no
    reading; with --decode, the decoder's rate). No way that feeds this pipeline can go faster."""
    dali = _dali()
    files, _ = tree_files(datadir)
    batch = python_read([files[i] for i in cycle(len(files), opts.batchsize)])

    def build() -> Any:
        pipe = _pipeline(opts)
        with pipe:
            encoded = dali.fn.external_source(source=lambda: batch, batch=True, dtype=dali.types.UINT8)
            pipe.set_outputs(_decode(encoded, files, opts))
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, "ceiling DALI, one batch held", kind="ceiling")


class ResearchFileIterator:
    """The research code's Python iterator for `external_source` (its FileInputIterator), unshuffled so every
    way reads the same order: `np.fromfile` per file, one after another, labels as int32 arrays."""

    def __init__(self, files: list[str], labels: list[int], batch_size: int) -> None:
        self.files, self.labels, self.batch_size = files, labels, batch_size
        self.i = 0

    def __iter__(self) -> ResearchFileIterator:
        self.i = 0
        return self

    def __next__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        n = len(self.files)
        at = [(self.i + k) % n for k in range(self.batch_size)]
        self.i += self.batch_size
        return [np.fromfile(self.files[j], dtype=np.uint8) for j in at], [
            np.array([self.labels[j]], dtype=np.int32) for j in at
        ]


def research_iterator(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """The research code's plain Python `external_source` iterator over a class tree."""
    dali = _dali()
    files, labels = tree_files(datadir)

    def build() -> Any:
        pipe = _pipeline(opts)
        with pipe:
            data, label = dali.fn.external_source(
                source=ResearchFileIterator(files, labels, opts.batchsize), num_outputs=2
            )
            pipe.set_outputs(_decode(data, files, opts), label)
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, "research Python iterator", kind="research")


@scenario(
    "dali-readers", "Ways of feeding DALI one class tree: readers.file, the research iterator, FileSource, BmapSource."
)
def dali_readers(
    opts: Options,
    datadir: Annotated[Path, _DATADIR],
    bmap: Annotated[Path | None, typer.Option(help="bmap.json of the tree's filesystem (adds BmapSource)")] = None,
    decode: Annotated[bool, typer.Option(help="decode the images (off: compare the reading alone)")] = False,
    rounds: Annotated[int, typer.Option(min=1, help="interleaved rounds of every way; rows are medians")] = 1,
) -> Rows:
    """readers.file is the peer every other row is compared with (same files, same order, same batch); with
    `rounds`, each row is its median round and notes the median of its per-round ratios to readers.file."""
    tree = train_dir(datadir)
    rows = Rows(title=f"DALI readers over {tree}")
    rows.peers["images"] = peer = "dali readers.file"
    token, check = DECODE.set(decode), LABELS.set(True)
    jobs: list[tuple[str, Callable[[], Result]]] = [
        ("held batch", lambda: held_batch(tree, opts)),
        ("dali", lambda: dali_file(tree, opts)),
        ("research iterator", lambda: research_iterator(tree, opts)),
        ("FileSource", lambda: blockprep_dali(opts, tree, name="blockprep FileSource")),
    ]
    if bmap is not None:
        jobs.append(("BmapSource", lambda: blockprep_dali(opts, tree, bmap, "blockdev", name="blockprep BmapSource")))
    try:
        ceilings.image_ceilings(rows, lambda: tree_files(tree)[0], opts)
        rows.add_rounds(jobs, rounds, peer)
        same_labels(rows, peer)
    finally:
        DECODE.reset(token)
        LABELS.reset(check)
    return rows
