"""The research loaders' set: file trees read by DALI, by Python into an `external_source`, and by xNVMe.

Names and arguments follow the research code users compare against, and its lines run verbatim:
`python -m workflows.benchmark --batchsize 64 --batches 1000 dali --datadir /data` (global options before
or after the subcommand). `--datadir` is the folder HOLDING `train/`, as there; `--bmap` takes the flat
`{"train/a/x.JPEG": {"startblock": S, "endblock": E}}` map, `prep bmap --format seed` or a full bmap.json;
`--mem gpu` uses the default GPU. Images are decoded (`fn.decoders.image`) in every way, as the research
code does, so the ways differ only in how bytes arrive. `dali-readers` (`workflows/bench/research_readers.py`)
ranks the ways of feeding a DALI pipeline (readers.file, the research code's Python iterator, FileSource,
BmapSource) on one tree, over the pipelines run here.
"""

from __future__ import annotations

import contextvars
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from workflows.bench import ceilings, scenario
from workflows.bench.core import Options, Result, Rows, Unavailable, cycle, optional, start_pass, time_batches

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
Reader = Callable[[list[str]], list[np.ndarray]]


def _dali() -> Any:
    return optional("nvidia.dali", "the DALI ways")


def tree_files(datadir: str | os.PathLike[str]) -> tuple[list[str], list[int]]:
    """Files of a class-folder tree and their labels, exactly as `fn.readers.file(file_root=...)` lists them
    (sorted subfolders numbered from 0, empty ones too; DALI's file filters, so no stray non-image file)."""
    from loaders.faces.dali import list_labeled_files

    root = Path(datadir)
    if not root.is_dir():
        raise Unavailable(f"{root}: no such folder (pass --datadir pointing at a class-folder tree)")
    pairs = list_labeled_files(root)
    if not pairs:
        raise Unavailable(f"{root}: no image files in class subfolders")
    return [str(root / p) for p, _ in pairs], [label for _, label in pairs]


def train_dir(datadir: str | os.PathLike[str]) -> Path:
    """The class-folder tree of a research `--datadir`: the folder HOLDING `train/` (`/data` -> `/data/train`)."""
    d = Path(datadir)
    if (d / "train").is_dir():
        return d / "train"
    raise Unavailable(
        f"{d}: no train/ folder in it; --datadir is the folder holding train/<class>/<files> "
        f"(as the research code: --datadir /data reads /data/train)"
    )


def _pipeline(opts: Options) -> Any:
    dali = _dali()
    device_id = int(opts.device.partition(":")[2] or 0) if opts.gpu else None
    return dali.Pipeline(batch_size=opts.batchsize, num_threads=max(2, os.cpu_count() or 2), device_id=device_id)


# True inside `dali-readers`: each timed pass keeps a digest of its labels, compared with readers.file's
LABELS: contextvars.ContextVar[bool] = contextvars.ContextVar("labels", default=False)
# False inside `dali-readers --no-decode`: the pipelines deliver the encoded bytes (reading alone is compared)
DECODE: contextvars.ContextVar[bool] = contextvars.ContextVar("decode", default=True)


def _decode(encoded: Any, files: list[str], opts: Options) -> Any:
    if not DECODE.get() or not files[0].lower().endswith(IMAGE_SUFFIXES):
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
    # DALI's readers.file mmaps the files it reads: pages a live mapping holds survive fadvise and
    # drop_caches, so the untimed pipeline must be gone before `--cold` evicts (else "cold" reads are warm)
    gc.collect()
    pipe = build()
    how = start_pass(files, opts.cold)
    labels: list[np.ndarray] = []  # the output after the counted ones (the labels), copied: DALI reuses it
    keep_labels = LABELS.get()

    last: list[Any] = []

    def batches() -> Iterator[Any]:
        while True:
            out = list(pipe.run())
            if keep_labels and len(out) > outputs:
                labels.append(np.array(out[outputs].as_tensor()).ravel())
            last[:] = out[:outputs]
            yield out[:outputs]

    def sync() -> None:  # the last batch's GPU work is done before the clock stops
        for out in last:
            if hasattr(out, "as_cpu"):
                out.as_cpu()

    seconds, nbytes = time_batches(batches(), opts.batches, sync=sync if opts.gpu else None)
    result = Result(name, data, opts.items, seconds, nbytes, kind, how)
    if labels:
        result.extra["labels"] = labels_digest(np.concatenate(labels))
    return result


def labels_digest(labels: np.ndarray) -> str:
    """A short digest of a timed pass's labels in delivery order (int64, so dtypes do not matter)."""
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(labels, dtype=np.int64).tobytes(), digest_size=6).hexdigest()


def dali_file(datadir: str | os.PathLike[str], opts: Options) -> Result:
    """DALI `fn.readers.file(file_root=...)` + decode: DALI's own listing and reader threads."""
    fn = _dali().fn
    files, _ = tree_files(datadir)

    def build() -> Any:
        pipe = _pipeline(opts)
        with pipe:
            encoded, label = fn.readers.file(file_root=str(datadir), random_shuffle=False, name="reader")
            pipe.set_outputs(_decode(encoded, files, opts), label)
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, "dali readers.file")


def python_read(paths: list[str]) -> list[np.ndarray]:
    """Read whole files with `np.fromfile`, one after another: the research code's Python iterator."""
    return [np.fromfile(p, dtype=np.uint8) for p in paths]


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
    _dali()
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
    _dali()
    with _xnvme_backend() as backend:
        files, _ = tree_files(datadir)
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


def _load_bmap(bmap: str | os.PathLike[str], tree: Path | None, device: str | None) -> Any:
    """A bmap.json or a flat research map (its caveat printed once), or Unavailable in one line. A flat map's
    keys start with train/: with the class tree `tree` known, they are mounted at its parent."""
    import warnings

    from loaders.blockmap.bmap import BlockMap, FlatMapWarning
    from loaders.errors import PrepError

    if not Path(bmap).is_file():
        raise Unavailable(f"{bmap} not found (make one with `prep bmap`, or `prep bmap --format seed`)")
    root = tree.parent if tree is not None and _is_flat(bmap) else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FlatMapWarning)
        try:
            block_map = BlockMap.load(bmap, root=root, device=device)
        except PrepError as exc:
            raise Unavailable(str(exc).splitlines()[0]) from exc
    for w in caught[:1]:
        print(f"  note: {w.message}", flush=True)  # the flat map's caveat, once
    return block_map


def blockprep_dali(
    opts: Options,
    datadir: str | os.PathLike[str] | None = None,
    bmap: str | os.PathLike[str] | None = None,
    backend: str = "auto",
    device_path: str | None = None,
    name: str | None = None,
    be: str | None = None,
) -> Result:
    """blockprep's DALI face: `loaders.faces.dali.FileSource` (a file tree through a backend) or `BmapSource` (the
    files of a bmap as raw device ranges) into an `external_source`, decoded like `dali`. `datadir` is the
    class-folder tree; with a bmap it tells where the map's files are mounted (flat maps have no root)."""
    from loaders.errors import PrepError
    from loaders.faces.dali import BmapSource, FileSource

    _dali()
    if bmap is not None:
        tree = Path(datadir) if datadir is not None else None
        block_map = _load_bmap(bmap, tree, device_path)
        # the tree's folder inside the map (the demo maps images/train itself: folder "")
        folder: str | None = None
        if tree is not None and not block_map.flat:
            folder = os.path.relpath(tree, block_map.root)
            folder = "" if folder == "." or folder.startswith("..") else folder
        raw = backend if backend != "auto" else "blockdev"

        def make() -> Any:
            return BmapSource(block_map, backend=raw, batch_size=opts.batchsize, folder=folder,
                              device_path=device_path, backend_options={"be": be} if be else None)  # fmt: skip

        label = name or f"blockprep dali BmapSource ({raw})"
    elif datadir is not None:
        tree_files(datadir)  # the same checks and message as the other file-tree ways

        def make() -> Any:
            return FileSource(datadir, backend=backend, batch_size=opts.batchsize)

        label = name or f"blockprep dali FileSource ({backend})"
    else:
        raise Unavailable("pass --datadir (a class-folder tree) or --bmap (its block map)")
    made: list[Any] = []

    def tracked() -> Any:
        made.append(make())
        return made[-1]

    try:
        return _run_sources(tracked, bmap, datadir, opts, label)
    except (PrepError, OSError, TypeError) as exc:  # TypeError: a backend that takes no bmap
        raise Unavailable(str(exc).splitlines()[0]) from exc
    finally:  # open descriptors would keep the data's filesystem busy (and unmountable)
        for source in made:
            source.close()


def _is_flat(bmap: str | os.PathLike[str]) -> bool:
    with open(bmap, "rb") as f:
        return not f.read(20).startswith(b'{"checksum":"xxh3:')


def _run_sources(
    make: Callable[[], Any], bmap: Any, datadir: str | os.PathLike[str] | None, opts: Options, name: str
) -> Result:
    probe = make()
    try:
        _probe(probe)
    finally:
        probe.close()
    root = Path(probe.bmap.root) / probe.prefix if bmap is not None else Path(str(datadir))
    files = [str(root / p) for p, _ in probe.files]
    if bmap is not None and opts.cold:  # raw reads of a loop device may come from its image's page cache
        backing = probe.bmap.loop_backing_file
        files += [backing] if backing and os.path.isfile(backing) else []
    dali = _dali()
    source = make()  # one source for the untimed and the timed pipeline: its one-time costs stay out (below)

    def build() -> Any:
        # As a training run keeps its source across epochs: BmapSource checks each file once (open, fstat,
        # FIEMAP) before its first raw read, and while the filesystem is read-only not again; a new source
        # per pipeline would time that first-use check in every pass (readers.file has nothing to keep).
        pipe = _pipeline(opts)
        with pipe:
            data, label = dali.fn.external_source(source=source, num_outputs=2, batch=True, cycle="quiet")
            pipe.set_outputs(_decode(data, files, opts), label)
        pipe.build()
        return pipe

    return run_pipeline(build, files, opts, name, kind="ours")


def gpu_options(opts: Options, what: str) -> Options:
    """The run's options on a GPU: its --device when that is one, else the default GPU (as the research
    code, which has no --device); Unavailable in one line when there is none."""
    from dataclasses import replace

    from workflows.bench.core import cuda_available

    if not cuda_available():
        raise Unavailable(f"{what} needs a CUDA GPU; torch sees none here")
    return opts if opts.gpu else replace(opts, device="cuda:0")


def xnvme_gds(uri: str | None, bmap: Path, mem: str, opts: Options, datadir: Path | None = None) -> Result:
    """The research code's xnvme-gds: each file's block ranges (from the map) read with xNVMe from `uri` into
    host memory, then decoded as there: on the (default) GPU where there is one, else on the CPU."""
    from loaders.backends.xnvme import load_capi
    from loaders.errors import PrepError

    if mem not in ("cpu", "gpu"):
        raise Unavailable(f"xnvme-gds: --mem {mem}: choose cpu or gpu")
    from workflows.bench.core import cuda_available

    # the research code decodes on the GPU ("mixed") whatever --mem says: so here, wherever there is one
    run = gpu_options(opts, "xnvme-gds --mem gpu") if mem == "gpu" or cuda_available() else opts
    if uri is not None and not os.path.exists(uri):
        raise Unavailable(f"xnvme-gds: {uri}: no such device (pass --uri with the NVMe namespace the map addresses)")
    try:
        load_capi()
    except PrepError as exc:
        raise Unavailable(f"xnvme-gds: {str(exc).splitlines()[0]}; building libxnvme: docs/xnvme.md") from exc
    tree = train_dir(datadir) if datadir is not None else None
    return blockprep_dali(run, tree, bmap, "xnvme", uri, name=f"xnvme-gds ({mem}) BmapSource")


def xnvme_bam(uri: str | None, bmap: Path, opts: Options, datadir: Path | None = None) -> Result:
    """The research code's xnvme-bam: block ranges read through xNVMe's BaM backend (GPU-initiated NVMe
    queues). Needs a GPU, a BaM-enabled libxnvme fork and its /dev/libnvm* device; says which is missing."""
    import glob

    from loaders.backends.xnvme import load_capi
    from loaders.errors import PrepError

    run = gpu_options(opts, "xnvme-bam")
    try:
        api = load_capi()
    except PrepError as exc:
        raise Unavailable(f"xnvme-bam: {str(exc).splitlines()[0]}; building libxnvme: docs/xnvme.md") from exc
    if not hasattr(api, "xnvme_kernels_range_submit"):
        raise Unavailable("xnvme-bam: this libxnvme has no BaM backend (needs the BaM-enabled xNVMe fork)")
    if not glob.glob("/dev/libnvm*") or (uri is not None and not os.path.exists(uri)):
        raise Unavailable(f"xnvme-bam: {uri or '/dev/libnvm*'}: no BaM device (load BaM's libnvm kernel module)")
    tree = train_dir(datadir) if datadir is not None else None
    return blockprep_dali(run, tree, bmap, "xnvme", uri, name="xnvme-bam BmapSource", be="bam")


# --- the subcommands (the research code's command lines; global options before or after the subcommand) ---
_DATADIR = typer.Option(help="the folder HOLDING train/<class>/<files> (as the research code: /data)")
_URI = typer.Option(help="xNVMe device URI (e.g. /dev/nvme0n1, /dev/libnvm0; default: the bmap's device)")
_BMAP = typer.Option(help="block map: flat {key: startblock/endblock}, `prep bmap --format seed`, or bmap.json")


def _tree_way(name: str, help_text: str, way: Callable[[Path, Options], Result]) -> None:
    def run(opts: Options, datadir: Annotated[Path, _DATADIR]) -> Rows:
        rows = Rows()
        if (datadir / "train").is_dir():
            ceilings.image_ceilings(rows, lambda: tree_files(datadir / "train")[0], opts)
        rows.add(name, lambda: way(datadir, opts))
        return rows

    scenario(name, help_text)(run)


_tree_way("dali", "DALI fn.readers.file + decode.", lambda d, o: (_dali(), dali_file(train_dir(d), o))[1])
_tree_way("python-file", "Python reads into a DALI external_source + decode.",
          lambda d, o: (_dali(), python_file(train_dir(d), o))[1])  # fmt: skip
_tree_way("xnvme-file", "xNVMe file API into a DALI external_source + decode.",
          lambda d, o: (_dali(), _xnvme_backend().close(), xnvme_file(train_dir(d), o))[2])  # fmt: skip


@scenario("xnvme-gds", "xNVMe block ranges from a bmap into CPU or GPU buffers, then decode.")
def xnvme_gds_way(
    opts: Options,
    bmap: Annotated[Path, _BMAP],
    uri: Annotated[str | None, _URI] = None,
    mem: Annotated[str, typer.Option(help="destination: cpu or gpu (the default GPU)")] = "cpu",
    datadir: Annotated[Path | None, typer.Option(help="where the map's files are mounted (holds train/)")] = None,
) -> Rows:
    rows = Rows()
    rows.add("xnvme-gds", lambda: xnvme_gds(uri, bmap, mem, opts, datadir))
    return rows


@scenario("xnvme-bam", "xNVMe BaM (GPU-initiated) block reads, then decode.")
def xnvme_bam_way(opts: Options, bmap: Annotated[Path, _BMAP], uri: Annotated[str | None, _URI] = None) -> Rows:
    rows = Rows()
    rows.add("xnvme-bam", lambda: xnvme_bam(uri, bmap, opts))
    return rows


@scenario("blockprep-dali", "blockprep's DALI sources (FileSource, or BmapSource with --bmap) + decode.")
def blockprep_dali_way(
    opts: Options,
    datadir: Annotated[Path | None, typer.Option(help="the folder holding train/ (or the class tree itself)")] = None,
    bmap: Annotated[Path | None, typer.Option(help="read the tree's files raw via this bmap")] = None,
    backend: Annotated[str, typer.Option(help="backend (with --bmap: blockdev or xnvme)")] = "auto",
) -> Rows:
    rows = Rows()
    tree = datadir / "train" if datadir is not None and (datadir / "train").is_dir() else datadir
    if tree is not None:
        ceilings.image_ceilings(rows, lambda: tree_files(tree)[0], opts)
    rows.add("blockprep-dali", lambda: blockprep_dali(opts, tree, bmap, backend))
    return rows
