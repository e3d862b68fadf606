"""The research loaders' set: file trees read by DALI, by Python into an `external_source`, and by xNVMe.

Names and arguments follow the research code users compare against: `dali --datadir`, `python-file
--datadir`, `xnvme-file --datadir`, `xnvme-gds --uri --mem cpu|gpu --bmap`, `xnvme-bam --uri --bmap`.
Image files are decoded (`fn.decoders.image`) in every variant so that they differ only in how bytes arrive.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import ceilings, scenario
from workflows.bench.core import Options, Result, Rows, Unavailable, cycle, evict, files_under, optional, time_batches

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
Reader = Callable[[list[str]], list[np.ndarray]]


def _dali() -> Any:
    return optional("nvidia.dali", "the DALI ways")


def tree_files(datadir: str | os.PathLike[str]) -> tuple[list[str], list[int]]:
    """Files of a class-folder tree and their labels, in the order `fn.readers.file` gives them
    (classes = sorted subfolders numbered from 0; files sorted within each)."""
    root = Path(datadir)
    if not root.is_dir():
        raise Unavailable(f"{root}: no such folder (pass --datadir pointing at a class-folder tree)")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = files_under(root / name)
        files += found
        labels += [label] * len(found)
    if not files:
        raise Unavailable(f"{root}: no files in class subfolders")
    return files, labels


def _pipeline(opts: Options) -> Any:
    dali = _dali()
    device_id = int(opts.device.partition(":")[2] or 0) if opts.gpu else None
    return dali.Pipeline(batch_size=opts.batchsize, num_threads=max(2, os.cpu_count() or 2), device_id=device_id)


def _decode(encoded: Any, files: list[str], opts: Options) -> Any:
    if not files[0].lower().endswith(IMAGE_SUFFIXES):
        return encoded  # not images: deliver the bytes
    fn = _dali().fn
    return fn.decoders.image(encoded, device="mixed" if opts.gpu else "cpu")


def run_pipeline(
    build: Callable[[], Any],
    files: list[str],
    opts: Options,
    name: str,
    data: str = "images",
    kind: str = "research",
    outputs: int = 1,
) -> Result:
    """Time `opts.batches` runs of a fresh pipeline from `build()`, counting its first `outputs` outputs.

    A first pipeline reads the same items untimed (one-time costs stay out; warm runs find the page cache
    filled, cold runs evict after it), so the timed one starts at item 0.
    """
    warm = build()
    for _ in range(opts.batches):
        warm.run()
    del warm
    pipe = build()
    how = evict(files) if opts.cold else "warm"

    def batches() -> Iterator[Any]:
        while True:
            yield list(pipe.run())[:outputs]

    seconds, nbytes = time_batches(batches(), opts.batches)
    return Result(name, data, opts.items, seconds, nbytes, kind, how)


def dali_file(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """DALI `fn.readers.file` + decode: DALI's own reader threads."""
    files, labels = tree_files(datadir)
    fn = _dali().fn

    def build() -> Any:
        pipe = _pipeline(opts)
        with pipe:
            encoded, label = fn.readers.file(files=files, labels=labels, random_shuffle=False, name="reader")
            pipe.set_outputs(_decode(encoded, files, opts), label)
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, "dali readers.file")


def python_read(paths: list[str]) -> list[np.ndarray]:
    """Read whole files with Python `open().read()` (the baseline `external_source` feeding)."""
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(np.frombuffer(f.read(), dtype=np.uint8))
    return out


def backend_read(backend: Any) -> Reader:
    """Whole-file reads through a blockprep backend (used for the xNVMe file API)."""
    from loaders.backends import ReadRequest

    def read(paths: list[str]) -> list[np.ndarray]:
        reqs = [ReadRequest(p, 0, os.path.getsize(p)) for p in paths]
        return [np.asarray(b) for b in backend.read(reqs)]

    return read


def external(files: list[str], read: Reader, opts: Options, name: str) -> Result:
    """Feed batches that `read` returns into a DALI `external_source`, then decode like `dali`."""
    order = [files[i] for i in cycle(len(files), opts.items)]
    dali = _dali()

    def build() -> Any:
        state = {"at": 0}  # each pipeline starts at item 0

        def source() -> list[np.ndarray]:
            at = state["at"] % len(order)
            state["at"] = at + opts.batchsize
            batch = order[at : at + opts.batchsize]
            return read(batch + order[: opts.batchsize - len(batch)])

        pipe = _pipeline(opts)
        with pipe:
            encoded = dali.fn.external_source(source=source, batch=True, dtype=dali.types.UINT8)
            pipe.set_outputs(_decode(encoded, files, opts))
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, name)


def python_file(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """Python file reads into an `external_source`."""
    files, _ = tree_files(datadir)
    return external(files, python_read, opts, "python-file external_source")


def _xnvme_backend(**options: Any) -> Any:
    from loaders.backends import backend_names, get_backend
    from loaders.errors import PrepError

    if "xnvme" not in backend_names():
        raise Unavailable("xnvme: loaders.backends.xnvme is not part of this install")
    try:
        return get_backend("xnvme", **options)
    except (PrepError, OSError, ImportError) as exc:
        raise Unavailable(f"xnvme: {str(exc).splitlines()[0]}") from exc


def xnvme_file(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """xNVMe file API (libxnvme's file backend) into an `external_source`."""
    files, _ = tree_files(datadir)
    with _xnvme_backend() as backend:
        return external(files, backend_read(backend), opts, "xnvme-file external_source")


def _probe(source: Any) -> None:
    """Read the first item once, so that a backend that cannot read here fails before DALI wraps its error."""
    from loaders.errors import PrepError

    try:
        next(iter(source))
    except StopIteration as exc:
        raise Unavailable("the source lists no files") from exc
    except (PrepError, OSError) as exc:
        raise Unavailable(str(exc).splitlines()[0]) from exc


def blockprep_dali(
    opts: Options,
    datadir: str | os.PathLike[str] | None = None,
    bmap: str | os.PathLike[str] | None = None,
    backend: str = "auto",
) -> Result:
    """blockprep's DALI face: `loaders.dali.FileSource` (a file tree through a backend) or `BmapSource` (the
    files of a bmap as raw device ranges) into an `external_source`, decoded like `dali`."""
    from loaders.bmap import BlockMap
    from loaders.dali import BmapSource, FileSource
    from loaders.errors import PrepError

    if bmap is not None:
        if not Path(bmap).is_file():
            raise Unavailable(f"{bmap} not found (make one with `prep bmap`)")
        try:
            block_map = BlockMap.load(bmap)
        except PrepError as exc:
            raise Unavailable(str(exc).splitlines()[0]) from exc
        # the tree's folder inside the map (the demo maps images/train itself: folder "")
        folder = os.path.relpath(datadir, block_map.root) if datadir is not None else ""
        if folder == "." or folder.startswith(".."):
            folder = ""
        raw = backend if backend != "auto" else "blockdev"

        def make() -> Any:
            return BmapSource(block_map, backend=raw, batch_size=opts.batchsize, folder=folder)

        name = f"blockprep dali BmapSource ({raw})"
    elif datadir is not None:
        tree_files(datadir)  # the same checks and message as the other file-tree ways

        def make() -> Any:
            return FileSource(datadir, backend=backend, batch_size=opts.batchsize)

        name = f"blockprep dali FileSource ({backend})"
    else:
        raise Unavailable("pass --datadir (a class-folder tree) or --bmap (its block map)")
    made: list[Any] = []

    def tracked() -> Any:
        made.append(make())
        return made[-1]

    try:
        return _run_sources(tracked, bmap, datadir, opts, name)
    except (PrepError, OSError, TypeError) as exc:  # TypeError: a backend that takes no bmap
        raise Unavailable(str(exc).splitlines()[0]) from exc
    finally:  # open descriptors would keep the data's filesystem busy (and unmountable)
        for source in made:
            source.backend.close()


def _run_sources(
    make: Callable[[], Any], bmap: Any, datadir: str | os.PathLike[str] | None, opts: Options, name: str
) -> Result:
    probe = make()
    _probe(probe)
    root = Path(probe.bmap.root) / probe.prefix if bmap is not None else Path(str(datadir))
    files = [str(root / p) for p, _ in probe.files]
    dali = _dali()

    def build() -> Any:
        source = make()
        pipe = _pipeline(opts)
        with pipe:
            data, label = dali.fn.external_source(source=source, num_outputs=2, batch=True, cycle="quiet")
            pipe.set_outputs(_decode(data, files, opts), label)
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, name, kind="ours")


# --- the subcommands (the research code's command lines; global options before or after the subcommand) ---
_DATADIR = typer.Option(help="class-folder file tree (e.g. demo/images/train)")
_URI = typer.Option(help="xNVMe device URI (e.g. /dev/nvme0n1; default: the bmap's disk)")
_BMAP = typer.Option(help="bmap.json of the files (prep bmap)")


def _tree_way(name: str, help_text: str, way: Callable[[Path, Options], Result]) -> None:
    def run(opts: Options, datadir: Annotated[Path, _DATADIR]) -> Rows:
        rows = Rows()
        ceilings.image_ceilings(rows, lambda: tree_files(datadir)[0], opts)
        rows.add(name, lambda: way(datadir, opts))
        return rows

    scenario(name, help_text)(run)


_tree_way("dali", "DALI fn.readers.file + decode.", dali_file)
_tree_way("python-file", "Python reads into a DALI external_source + decode.", python_file)
_tree_way("xnvme-file", "xNVMe file API into a DALI external_source + decode.", xnvme_file)


@scenario("xnvme-gds", "xNVMe block ranges from a bmap into CPU or GPU buffers.")
def xnvme_gds_way(
    opts: Options,
    bmap: Annotated[Path, _BMAP],
    uri: Annotated[str | None, _URI] = None,
    mem: Annotated[str, typer.Option(help="destination: cpu or gpu")] = "cpu",
    datadir: Annotated[Path | None, typer.Option(help="only bmap files under this folder")] = None,
) -> Rows:
    from workflows.bench import ours

    rows = Rows()
    rows.add("xnvme-gds", lambda: ours.xnvme_gds(uri, bmap, mem, opts, datadir=datadir))
    return rows


@scenario("xnvme-bam", "xNVMe BaM (GPU-initiated) block reads.")
def xnvme_bam_way(opts: Options, bmap: Annotated[Path, _BMAP], uri: Annotated[str | None, _URI] = None) -> Rows:
    from workflows.bench import ours

    rows = Rows()
    rows.add("xnvme-bam", lambda: ours.xnvme_bam(uri, bmap, opts))
    return rows


@scenario("blockprep-dali", "blockprep's DALI sources (FileSource, or BmapSource with --bmap) + decode.")
def blockprep_dali_way(
    opts: Options,
    datadir: Annotated[Path | None, typer.Option(help="class-folder file tree")] = None,
    bmap: Annotated[Path | None, typer.Option(help="read the tree's files raw via this bmap")] = None,
    backend: Annotated[str, typer.Option(help="backend (with --bmap: blockdev or xnvme)")] = "auto",
) -> Rows:
    rows = Rows()
    if datadir is not None:
        ceilings.image_ceilings(rows, lambda: tree_files(datadir)[0], opts)
    rows.add("blockprep-dali", lambda: blockprep_dali(opts, datadir, bmap, backend))
    return rows
