"""The `prep` command: thin option parsing over library functions; PrepError becomes a one-line exit 1.

Each command group keeps its options here and its work in its own module (synth, bmap, cache).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from prep.errors import PrepError

if TYPE_CHECKING:
    from prep.mapping import BmapSummary
    from prep.progress import Progress
    from prep.summary import CacheSummary

T = TypeVar("T")

# Before torch is imported: idle OpenMP threads sleep instead of spinning between a head's torch ops (the
# worker processes get the same, prep.processes.worker_environ): less CPU for the same wall time (docs/benchmarks.md,
# Preparation); a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Plain click help: flags show no `<bool>` type, choices read `<full|seed>`, required options say `[required]`
# (typer's rich panels print a type after every flag, `--help` included).
HELP_STYLE: dict[str, Any] = {
    "rich_markup_mode": None,
    "context_settings": {"max_content_width": 100, "help_option_names": ["-h", "--help"]},
}
app = typer.Typer(
    help="blockprep: block maps, prepared caches and fast loaders for GPU training.\n\n"
    "Example: prep synth nifti data/ --count 8 --size 64",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    **HELP_STYLE,
)
synth_app = typer.Typer(
    help="Make synthetic datasets for demos and tests.\n\nExample: prep synth nifti data/ --count 8",
    no_args_is_help=True,
    **HELP_STYLE,
)
app.add_typer(synth_app, name="synth")


def _version(value: bool) -> None:
    if value:
        from loaders import __version__

        typer.echo(f"blockprep {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """blockprep: block maps, prepared caches and fast loaders for GPU training."""


def fail(message: str) -> typer.Exit:
    """Print a one-line error to stderr and return the Exit(1) to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a library function; PrepError and Ctrl-C become a one-line message and a non-zero exit."""
    try:
        return fn(*args, **kwargs)
    except PrepError as exc:
        raise fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting changes nothing
        typer.echo("interrupted: finished work is kept; run the same command again to resume", err=True)
        raise typer.Exit(130) from None


@synth_app.command("nifti", short_help="3D image/label NIfTI pairs (spheres, CT-like, MR-like) + dataset.json.")
def synth_nifti(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output folder (its parent must exist).")],
    count: Annotated[int, typer.Option(metavar="N", help="Number of image/label pairs.")] = 8,
    size: Annotated[int, typer.Option(metavar="VOXELS", help="Edge length of each volume (see --shape-range).")] = 64,
    seed: Annotated[int, typer.Option(metavar="N", help="Random seed; the same seed gives the same files.")] = 0,
    kind: Annotated[
        str,
        typer.Option(
            metavar="spheres|ct|mr",
            help="spheres (float32 spheres), ct (int16 Hounsfield units, an organ label) or mr "
            "(4 contrasts, BraTS label classes 0/1/2/4).",
        ),
    ] = "spheres",
    shape_range: Annotated[
        float, typer.Option(metavar="R", help="Each edge of each volume is VOXELS x U(1-R, 1+R): shapes differ.")
    ] = 0.0,
    spacing_range: Annotated[
        str | None,
        typer.Option(metavar="LO,HI", help="Voxel spacing per axis drawn from U(LO, HI) mm: spacings differ."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a dataset already in OUT (refused otherwise).")
    ] = False,
) -> None:
    """3D image/label NIfTI pairs (.nii.gz) of random spheres, CT-like or MR-like volumes, plus a
    decathlon-style dataset.json.

    Example: prep synth nifti data/ct --kind ct --count 32 --size 160 --shape-range 0.3 --spacing-range 0.7,2.5
    """
    from prep import synth
    from prep.progress import Progress

    spacing = None
    if spacing_range is not None:
        try:
            lo, hi = (float(v) for v in spacing_range.split(","))
        except ValueError:
            raise fail(f"--spacing-range takes LO,HI in mm, not {spacing_range!r}") from None
        spacing = (lo, hi)
    with Progress(count, "synth nifti", unit="pairs") as bar:
        datalist = guarded(synth.nifti_dataset, out, count, size, seed, progress=bar.update, force=force,
                           kind=kind, shape_range=shape_range, spacing_range=spacing)  # fmt: skip
    typer.echo(f"wrote {count} {kind} image/label pairs of about {size}^3 voxels; datalist: {datalist}")


@synth_app.command("images")
def synth_images(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output folder (its parent must exist).")],
    classes: Annotated[int, typer.Option(metavar="N", help="Number of class folders.")] = 4,
    per_class: Annotated[int, typer.Option(metavar="N", help="JPEG files per class.")] = 16,
    size: Annotated[int, typer.Option(metavar="PIXELS", help="Edge length of each square image.")] = 64,
    seed: Annotated[int, typer.Option(metavar="N", help="Random seed; the same seed gives the same files.")] = 0,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an OUT/train tree already there (refused otherwise).")
    ] = False,
) -> None:
    """An ImageNet-style class-folder JPEG tree: OUT/train/<class>/<file>.JPEG.

    Example: prep synth images data/imgs --classes 10 --per-class 100
    """
    from prep import synth
    from prep.progress import Progress

    with Progress(classes * per_class, "synth images", unit="files") as bar:
        train = guarded(synth.image_tree, out, classes, per_class, size, seed, progress=bar.update, force=force)
    typer.echo(f"wrote {classes * per_class} JPEG files in {classes} classes under {train}")


# --- bmap commands (work in prep/mapping/) ---

bmap_app = typer.Typer(
    help="Block maps: where every file's bytes lie on the block device (FIEMAP), for raw-device readers.\n\n"
    "Example: prep bmap --mountpoint /mnt/scratch --output bmap.json --workers 8",
    short_help="Block maps (FIEMAP) of every file under a mountpoint, for raw-device readers.",
    **HELP_STYLE,
)
app.add_typer(bmap_app, name="bmap")


class MapFormat(str, Enum):
    """What `prep bmap --format` writes."""

    full = "full"
    seed = "seed"


@bmap_app.callback(invoke_without_command=True)
def bmap_map(
    ctx: typer.Context,
    mountpoint: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="Mountpoint of the filesystem to map.  [required, except for `bmap verify`]"),
    ] = None,
    output: Annotated[Path, typer.Option(metavar="FILE", help="Where to write the map (temp file + rename).")] = Path(
        "bmap.json"
    ),
    fmt: Annotated[
        MapFormat,
        typer.Option("--format", help="full: bmap.json with all extents; seed: flat {key: startblock/endblock}."),
    ] = MapFormat.full,
    workers: Annotated[
        int, typer.Option(metavar="N", help="Parallel workers (threads; processes for 20,000+ files).")
    ] = 4,
    include: Annotated[
        list[str] | None, typer.Option(metavar="GLOB", help="Files to map (repeatable; default all).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(metavar="GLOB", help="Files or folders to skip (repeatable).")
    ] = None,
    allow_subdir: Annotated[
        bool,
        typer.Option("--allow-subdir", help="Map a folder that is not itself a mountpoint (keys stay relative to it)."),
    ] = False,
    checksums: Annotated[
        bool, typer.Option("--checksums", help="Also store an xxh3 of every file (reads all data).")
    ] = False,
) -> None:
    """Map every regular file under MOUNTPOINT with FIEMAP and write a versioned, checksummed block map.

    Example: prep bmap --mountpoint /mnt/nvme --output bmap.json --exclude '*.tmp' --workers 8
    """
    if ctx.invoked_subcommand is not None:
        return
    if mountpoint is None:
        raise fail("--mountpoint is required (the folder the filesystem is mounted on); see `prep bmap --help`")
    import tqdm

    from prep import mapping as bmap

    tqdm.tqdm.monitor_interval = 0  # no monitor thread: large trees are mapped by forked worker processes

    from prep.progress import Progress

    with Progress(None, "prep bmap", unit="files") as bar:
        summary = guarded(bmap.build_bmap, mountpoint, output, include=include or (), exclude=exclude or (),
                          workers=workers, fmt=fmt.value, require_mountpoint=not allow_subdir, progress=bar.update,
                          checksums=checksums)  # fmt: skip
    _report_map(summary)


def _report_map(summary: BmapSummary) -> None:
    """Print what `prep bmap` mapped: a warning if any, the summary line, where the seed's left-out files are."""
    if summary.warning():
        typer.echo(f"warning: {summary.warning()}", err=True)
    typer.echo(summary.line())
    if summary.skipped_path is not None:
        typer.echo(f"files left out of the seed, with reasons: {summary.skipped_path}")


@bmap_app.command("verify", short_help="Compare every mapped range read raw with the filesystem.")
def bmap_verify(
    bmap_path: Annotated[Path, typer.Argument(metavar="BMAP", help="The bmap.json to check.")],
    device: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Read from this device, its whole disk, or the loop image file (default: the mapped one).",
        ),
    ] = None,
    workers: Annotated[int, typer.Option(metavar="N", help="Files verified in parallel.")] = 4,
) -> None:
    """Read every mapped range from the raw device and compare with the filesystem; exit 1 on any mismatch.

    Example: prep bmap verify bmap.json --device /scratch/images/train.img
    """
    from prep import mapping as bmap
    from prep.progress import Progress

    with Progress(None, "prep bmap verify", unit="files") as bar:
        mismatches = guarded(bmap.verify_bmap, bmap_path, device, workers=workers, progress=bar.update)
    for m in mismatches:
        typer.echo(f"mismatch: {m}", err=True)
    if mismatches:
        raise fail(f"{bmap_path}: {len(mismatches)} mismatch(es); re-run `prep bmap` before raw reads")
    typer.echo(f"ok: every mapped range in {bmap_path} matches the filesystem")


# --- cache and verify commands (work in prep/cache.py) ---


# prep cache's options, one alias each (typer reads their Annotated help), so that its signature stays a list
_Datalist = Annotated[
    Path, typer.Argument(metavar="DATALIST", help="Decathlon-style datalist JSON (relative paths: its folder).")
]
_PipelineFile = Annotated[
    Path, typer.Option(metavar="FILE", help="PIPELINE.py with a `transform` Compose, or a bundle config.")
]
_CacheOutput = Annotated[Path, typer.Option(metavar="DIR", help="Cache folder to create or resume.")]
_CacheWorkers = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="Local dask workers: threads or processes, chosen from the head's time on the first item and the "
        "item count unless --threads or --processes.",
    ),
]
_Processes = Annotated[
    bool,
    typer.Option(
        "--processes",
        help="Local workers as processes (one torch thread each, started by a forkserver; isolates crashes).",
    ),
]
_Threads = Annotated[bool, typer.Option("--threads", help="Local workers as threads of this process.")]
_AllowEmptyHead = Annotated[
    bool, typer.Option("--allow-empty-head", help="Cache entries as they are if the first transform is random.")
]
_Scheduler = Annotated[
    str | None,
    typer.Option(metavar="URL", help="Use an existing dask cluster: tcp://host:port, or tls://host:port (--tls-*)."),
]
_ShardSize = Annotated[int, typer.Option(metavar="BYTES", help="Start a new shard file after this many bytes.")]
_CacheForce = Annotated[bool, typer.Option("--force", help="Rebuild a cache made with another pipeline/datalist.")]
_CacheVerify = Annotated[bool, typer.Option("--verify", help="Re-read and check every tensor after writing.")]
_BundleKey = Annotated[
    str | None, typer.Option(metavar="ID", help="Bundle config entry of the chain [default: preprocessing].")
]
_Sections = Annotated[
    list[str] | None,
    typer.Option(metavar="NAME", help="Datalist section to prepare (repeatable) [default: training]."),
]
_TlsCaFile = Annotated[
    Path | None, typer.Option(metavar="PEM", help="tls:// scheduler: the CA that signed its certificates.")
]
_TlsCert = Annotated[Path | None, typer.Option(metavar="PEM", help="tls:// scheduler: this client's certificate.")]
_TlsKey = Annotated[Path | None, typer.Option(metavar="PEM", help="tls:// scheduler: this client's private key.")]
_KeepRepeats = Annotated[
    bool, typer.Option("--keep-repeats", help="Prepare every copy of an entry listed more than once in its section.")
]
_MaxItemBytes = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="Quarantine an input whose header declares more than SIZE decoded (8G, 512M, bytes), checked "
        "before decoding [default: a quarter of the available memory].",
    ),
]


@app.command("cache", short_help="Run a MONAI chain's deterministic head once, on dask, into a cache.")
def cache_cmd(
    datalist: _Datalist,
    pipeline: _PipelineFile,
    output: _CacheOutput,
    workers: _CacheWorkers = 2,
    processes: _Processes = False,
    threads: _Threads = False,
    allow_empty_head: _AllowEmptyHead = False,
    scheduler: _Scheduler = None,
    shard_size: _ShardSize = 1 << 30,
    force: _CacheForce = False,
    verify: _CacheVerify = False,
    bundle_key: _BundleKey = None,
    section: _Sections = None,
    tls_ca_file: _TlsCaFile = None,
    tls_cert: _TlsCert = None,
    tls_key: _TlsKey = None,
    keep_repeats: _KeepRepeats = False,
    max_item_bytes: _MaxItemBytes = None,
) -> None:
    """Run the deterministic head of a MONAI transform chain once, on dask, into a prepared cache.

    Example: prep cache demo/nifti/dataset.json --pipeline workflows/pipelines/spheres.py --output demo/cache

    On a cluster: --scheduler tls://HOST:8786 --tls-ca-file ca.pem --tls-cert me.pem --tls-key me.key
    """
    from prep.cache import prepare_cache
    from prep.progress import Progress

    tls = (tls_ca_file, tls_cert, tls_key)
    limit, security, mode = _cache_options(max_item_bytes, scheduler, tls, processes, threads)
    with Progress(None, "prep cache", unit="items") as bar:
        summary = guarded(
            prepare_cache, datalist, pipeline, output, workers=workers, scheduler=scheduler, shard_size=shard_size,
            force=force, verify=verify, sections=tuple(section or ("training",)), bundle_key=bundle_key,
            processes=mode, progress=_growing(bar), security=security,
            allow_empty_head=allow_empty_head, max_item_bytes=limit, keep_repeats=keep_repeats,
        )  # fmt: skip
    _report_cache(summary)


def _cache_options(
    max_item_bytes: str | None,
    scheduler: str | None,
    tls: tuple[Path | None, Path | None, Path | None],
    processes: bool,
    threads: bool,
) -> tuple[int | None, Any, bool | None]:
    """prep cache's options checked: (the item bound in bytes, the scheduler's TLS security, processes or
    threads or the automatic choice); a plain tcp:// scheduler warned about."""
    from prep.cluster import plain_tcp_warning, scheduler_security
    from prep.item_size import parse_size

    limit = None if max_item_bytes is None else guarded(parse_size, max_item_bytes)
    security = guarded(scheduler_security, scheduler, *tls)
    if warning := plain_tcp_warning(scheduler):
        typer.echo(f"warning: {warning}", err=True)
    if processes and threads:
        raise fail("--processes and --threads exclude each other; give one, or neither to let prep cache choose")
    return limit, security, True if processes else False if threads else None


def _growing(bar: Progress) -> Callable[[int, int], None]:
    """prep cache's progress on `bar`, whose total is reset when the run's count of items changes."""

    def progress(advance: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total)
        bar.update(advance)

    return progress


def _report_cache(summary: CacheSummary) -> None:
    """Print what prep cache did; exit 1 where items were quarantined or tensors failed verification."""
    typer.echo("\n".join(summary.lines()))
    if summary.quarantined:
        raise fail(f"{len(summary.quarantined)} items quarantined (listed above); the rest is cached")
    if summary.bad:
        raise fail(f"{len(summary.bad)} tensors failed verification (listed above)")


@app.command("sampling", short_help="Add a label-driven crop's sampling sets to an existing cache.")
def sampling_cmd(
    cache: Annotated[Path, typer.Argument(metavar="CACHE", help="A cache made by `prep cache`.")],
    pipeline: Annotated[
        Path, typer.Option(metavar="FILE", help="The PIPELINE.py (or bundle config) the cache was made with.")
    ],
    workers: Annotated[int, typer.Option(metavar="N", help="Threads computing the sets.")] = 2,
    bundle_key: Annotated[
        str | None, typer.Option(metavar="ID", help="Bundle config entry of the chain [default: preprocessing].")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Remake the sets even when current ones exist.")] = False,
) -> None:
    """Store what RandCropByPosNegLabeld / RandCropByLabelClassesd draw from, so loaders read only the crops.

    Example: prep sampling demo/cache --pipeline workflows/pipelines/spleen.py

    `prep cache` does this itself; this adds the sets to a cache made before, without running the head again.
    """
    from loaders.cache import chain
    from prep.pipeline import load_pipeline
    from prep.sampling import ensure_sets

    pipe = guarded(load_pipeline, pipeline, bundle_key)
    guarded(chain.check_fingerprint, pipe.transform, guarded(_manifest_of, cache), str(cache / "manifest.json"))
    line = guarded(ensure_sets, cache, pipe.tail, workers, force)
    if not line:
        raise fail(f"{pipeline}: its tail does not start with RandCropByPosNegLabeld or RandCropByLabelClassesd")
    typer.echo(f"{cache}: {line}")


def _manifest_of(cache: Path) -> Any:
    from loaders.cache.format import read_manifest

    return read_manifest(cache)


@app.command("verify", short_help="Check a prepared cache: every file's checksum, every tensor.")
def verify_cmd(
    cache_dir: Annotated[
        Path, typer.Argument(metavar="CACHE", help="Prepared cache folder (written by `prep cache`).")
    ],
) -> None:
    """Check every file of a prepared cache against the manifest's checksums, then every tensor (checksum,
    shape, dtype) and shard length; exit 1 on any damage.

    Example: prep verify demo/cache
    """
    from loaders.cache.format import PreparedCache
    from prep.cache_verify import verify_cache

    bad = guarded(verify_cache, cache_dir)
    for item in bad:
        typer.echo(f"bad: {item}")
    if bad:
        raise fail(f"{cache_dir}: {len(bad)} bad tensors; rebuild with `prep cache --force`")
    cache = PreparedCache(cache_dir)
    files = ", ".join(["manifest.json", *cache.files])
    typer.echo(f"{cache_dir}: ok: {files} match their checksums; every tensor verified ({len(cache.index)} "
               f"tensors in {len(cache.shards)} shard(s))")  # fmt: skip


@app.command("bricks", short_help="Add a copy of a cache's tensors in blocks, so cold crops read fewer bytes.")
def bricks_cmd(
    cache_dir: Annotated[Path, typer.Argument(metavar="CACHE", help="A cache made by `prep cache`.")],
    page: Annotated[int, typer.Option(metavar="BYTES", help="Bytes of one block (a multiple of 4096).")] = 4096,
    force: Annotated[bool, typer.Option("--force", help="Write them again even where current ones exist.")] = False,
) -> None:
    """Write every tensor again cut in blocks of one page (CACHE/bricks/): a crop read from disk then reads the
    blocks it touches (about 1.3-1.6x its bytes) instead of whole rows of pages (2-4x where crops are small
    against the volume). Warm reads keep using the cache itself. Costs a second copy's disk space.

    Example: prep bricks demo/cache
    """
    from loaders.cache.format import PreparedCache
    from prep.bricks import build_bricks
    from prep.progress import Progress

    if page < 4096 or page % 4096:
        raise fail(f"--page {page}: give a multiple of 4096 bytes (one page, or several)")
    total = len(guarded(PreparedCache, cache_dir).index)
    with Progress(total, "prep bricks", unit="tensors") as bar:
        out = guarded(build_bricks, cache_dir, page=page, force=force, progress=bar.update)
    typer.echo(f"{out}: {total} tensors in blocks of {page} bytes")


def main() -> None:
    """Entry point for `python -m prep`."""
    app(prog_name="prep")
