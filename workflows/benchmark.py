"""Measure every way of loading the same data in one run, against ceilings and MONAI/DALI peers.

    python -m workflows.benchmark all --data demo --batchsize 4 --batches 4 --cold --out bench_out
    python -m workflows.benchmark prepared --cache demo/cache --backend direct
    python -m workflows.benchmark persistent --datalist demo/nifti/dataset.json --pipeline PIPELINE.py
    python -m workflows.benchmark dali --datadir demo/images/train

`all --data DIR` expects the demo layout (`make demo`): DIR/nifti/dataset.json, DIR/images/train, DIR/cache,
DIR/bmap.json. It prints one table: items/s, GB/s, the ratio to the ceiling measured on the same data in
the same run (cold: O_DIRECT with many requests in flight; warm: np.fromfile) and the ratio to MONAI's
PersistentDataset. A way that cannot run here (no GPU, no libxnvme) prints one line saying why.

Every way first makes one untimed pass over the same items (imports, thread pools and pipeline builds stay
out of the timing); `--cold` then evicts its files from the page cache (posix_fadvise DONTNEED per file,
and drop_caches as root) before the timed pass. GB/s counts the tensor (or file) bytes each way delivers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loaders.errors import PrepError
from workflows.bench import ceilings, ours, peers, report, research
from workflows.bench.core import Options, Result, Unavailable

DEFAULT_PIPELINE = Path(__file__).parent / "pipelines" / "spheres.py"
Way = Callable[[argparse.Namespace, Options], Result]
CEILINGS = ("O_DIRECT", "np.fromfile", "kvikio")  # the order _volume_ceilings/_image_ceilings return them in


def _volume_ceilings(cache: Path, opts: Options) -> list[Callable[[], Result]]:
    def items() -> list[list[ceilings.Span]]:
        if not (cache / "manifest.json").is_file():
            raise Unavailable(f"{cache}: no committed prepared cache, so no volume ceiling")
        return ceilings.cache_items(cache)

    return [
        lambda: ceilings.direct(items(), opts, "volumes"),
        lambda: ceilings.fromfile(items(), opts, "volumes"),
        lambda: ceilings.kvikio_bulk(items(), opts, "volumes"),
    ]


def _image_ceilings(datadir: Path, opts: Options) -> list[Callable[[], Result]]:
    def items() -> list[list[ceilings.Span]]:
        return ceilings.file_items(research.tree_files(datadir)[0])

    return [
        lambda: ceilings.direct(items(), opts, "images"),
        lambda: ceilings.fromfile(items(), opts, "images"),
        lambda: ceilings.kvikio_bulk(items(), opts, "images"),
    ]


def _npy(args: argparse.Namespace, opts: Options) -> Result:
    if args.npy is not None:
        npy = {p.name: sorted(str(f) for f in p.glob("*.npy")) for p in sorted(Path(args.npy).iterdir()) if p.is_dir()}
    elif args.cache is not None:
        npy = peers.export_npy(args.cache, opts.work / "npy")
    else:
        raise Unavailable("dali-numpy needs --cache (to export) or --npy (exports)")
    return peers.dali_numpy(npy, opts)


def _xnvme_gds(args: argparse.Namespace, opts: Options) -> Result:
    return ours.xnvme_gds(args.uri, args.bmap, args.mem, opts, datadir=args.datadir)


def _xnvme_bam(args: argparse.Namespace, opts: Options) -> Result:
    return ours.xnvme_bam(args.uri, args.bmap, opts)


# name -> (help, arguments, function). Arguments: (flag, kwargs) for argparse.
_DATADIR = ("--datadir", {"type": Path, "required": True, "help": "class-folder file tree (e.g. demo/images/train)"})
_CACHE = ("--cache", {"type": Path, "required": True, "help": "prepared cache folder (e.g. demo/cache)"})
_DATALIST = ("--datalist", {"type": Path, "required": True, "help": "decathlon datalist (demo/nifti/dataset.json)"})
_PIPELINE = ("--pipeline", {"type": Path, "default": DEFAULT_PIPELINE, "help": "PIPELINE.py whose head is run"})
_URI = ("--uri", {"required": True, "help": "xNVMe device URI (e.g. /dev/nvme0n1)"})
_BMAP = ("--bmap", {"type": Path, "required": True, "help": "bmap.json of the files (prep bmap)"})
WAYS: dict[str, tuple[str, list[tuple[str, dict[str, Any]]], Way]] = {
    "dali": ("DALI fn.readers.file + decode", [_DATADIR], lambda a, o: research.dali_file(a.datadir, o)),
    "python-file": ("Python reads into a DALI external_source", [_DATADIR],
                    lambda a, o: research.python_file(a.datadir, o)),
    "xnvme-file": ("xNVMe file API into an external_source", [_DATADIR],
                   lambda a, o: research.xnvme_file(a.datadir, o)),
    "xnvme-gds": ("xNVMe block ranges from a bmap into CPU or GPU buffers",
                  [_URI, _BMAP, ("--mem", {"choices": ["cpu", "gpu"], "default": "cpu", "help": "destination"}),
                   ("--datadir", {"type": Path, "default": None, "help": "only bmap files under this folder"})],
                  _xnvme_gds),
    "xnvme-bam": ("xNVMe BaM (GPU-initiated) block reads", [_URI, _BMAP], _xnvme_bam),
    "blockprep-dali": ("blockprep's DALI sources (FileSource, or BmapSource with --bmap) + decode",
                       [("--datadir", {"type": Path, "default": None, "help": "class-folder file tree"}),
                        ("--bmap", {"type": Path, "default": None, "help": "read the tree's files raw via this bmap"}),
                        ("--backend", {"default": "auto", "help": "backend (with --bmap: blockdev or xnvme)"})],
                       lambda a, o: research.blockprep_dali(o, a.datadir, a.bmap, a.backend)),
    "prepared": ("blockprep PreparedDataset over a prepared cache",
                 [_CACHE, ("--backend", {"choices": ours.BACKENDS, "default": "auto", "help": "backend"}),
                  ("--bmap", {"type": Path, "default": None, "help": "shards' bmap (default CACHE/bmap.json)"})],
                 lambda a, o: ours.prepared(a.cache, a.backend, o,
                                            **ours.backend_options(a.backend, a.bmap or a.cache / "bmap.json"))),
    "monai-dataset": ("MONAI Dataset: NIfTI + head per access", [_DATALIST, _PIPELINE],
                      lambda a, o: peers.monai_dataset(a.datalist, a.pipeline, o)),
    "persistent": ("MONAI PersistentDataset (.pt files)", [_DATALIST, _PIPELINE],
                   lambda a, o: peers.persistent(a.datalist, a.pipeline, o)),
    "cache-dataset": ("MONAI CacheDataset (in RAM)", [_DATALIST, _PIPELINE],
                      lambda a, o: peers.cache_dataset(a.datalist, a.pipeline, o)),
    "gds-dataset": ("MONAI GDSDataset (GPU)", [_DATALIST, _PIPELINE],
                    lambda a, o: peers.gds_dataset(a.datalist, a.pipeline, o)),
    "dali-numpy": ("DALI fn.readers.numpy on .npy exports of the cache",
                   [("--cache", {"type": Path, "default": None, "help": "prepared cache to export"}),
                    ("--npy", {"type": Path, "default": None, "help": "folder of <key>/*.npy (instead of --cache)"})],
                   _npy),
}  # fmt: skip


def _ceilings_for(name: str, args: argparse.Namespace, opts: Options) -> list[Callable[[], Result]]:
    """The ceilings of the data a single subcommand reads (so its ratio column is filled)."""
    if getattr(args, "cache", None) is not None:
        return _volume_ceilings(Path(args.cache), opts)
    if getattr(args, "datadir", None) is not None and name in ("dali", "python-file", "xnvme-file", "blockprep-dali"):
        return _image_ceilings(Path(args.datadir), opts)
    return []


def run_all(data: Path, opts: Options, pipeline: Path = DEFAULT_PIPELINE) -> tuple[list[Result], list[tuple[str, str]]]:
    """Every way that applies to a demo-layout folder; returns (results, [(way, why unavailable)])."""
    ns = argparse.Namespace(
        datadir=data / "images" / "train", cache=data / "cache", datalist=data / "nifti" / "dataset.json",
        pipeline=pipeline, uri=None, bmap=data / "bmap.json", mem="gpu" if opts.gpu else "cpu", npy=None,
    )  # fmt: skip
    jobs: list[tuple[str, Callable[[], Result]]] = []
    jobs += [(f"ceiling {k} (volumes)", f) for k, f in zip(CEILINGS, _volume_ceilings(ns.cache, opts))]
    for backend in ours.BACKENDS:
        jobs.append((f"prepared --backend {backend}", _bind(ours_prepared, ns, opts, backend)))
    for way in ("persistent", "monai-dataset", "cache-dataset", "gds-dataset", "dali-numpy"):
        jobs.append((way, _bind(WAYS[way][2], ns, opts)))
    jobs += [(f"ceiling {k} (images)", f) for k, f in zip(CEILINGS, _image_ceilings(ns.datadir, opts))]
    jobs.append(("blockprep-dali", lambda: research.blockprep_dali(opts, ns.datadir)))
    jobs.append(("blockprep-dali --bmap", lambda: research.blockprep_dali(opts, ns.datadir, ns.bmap, "blockdev")))
    for way in ("dali", "python-file", "xnvme-file", "xnvme-gds", "xnvme-bam"):
        jobs.append((way, _bind(WAYS[way][2], ns, opts)))
    return _run_jobs(jobs)


def ours_prepared(ns: argparse.Namespace, opts: Options, backend: str) -> Result:
    """`prepared` for `all`: blockdev reads the shards through the cache's own bmap (`prep cache` writes it)."""
    return ours.prepared(ns.cache, backend, opts, **ours.backend_options(backend, Path(ns.cache) / "bmap.json"))


def _bind(fn: Callable[..., Result], *args: Any) -> Callable[[], Result]:
    return lambda: fn(*args)


def _run_jobs(jobs: list[tuple[str, Callable[[], Result]]]) -> tuple[list[Result], list[tuple[str, str]]]:
    results: list[Result] = []
    skipped: list[tuple[str, str]] = []
    for label, job in jobs:
        try:
            result = job()
        except (Unavailable, PrepError) as exc:  # PrepError: this data lacks what the way needs (one line)
            why = str(exc).splitlines()[0].removeprefix(f"{label}: ")
            skipped.append((label, why))
            print(f"  unavailable: {label}: {why}", flush=True)  # the one line a way that cannot run prints
            continue
        results.append(result)
        print(f"  {result.name}: {result.items_per_s:.1f} items/s, {result.gb_per_s:.3f} GB/s", flush=True)
    return results, skipped


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--batchsize", type=int, default=4, help="items per batch (default 4)")
    common.add_argument(
        "--batches", type=int, default=4, help="timed batches per way (default 4; wraps around small data)"
    )
    cold = common.add_mutually_exclusive_group()
    cold.add_argument("--cold", dest="cold", action="store_true", default=True, help="evict page cache first")
    cold.add_argument("--warm", dest="cold", action="store_false", help="read from the page cache (warm-up pass)")
    common.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    common.add_argument("--workers", type=int, default=0, help="DataLoader workers for the MONAI peers")
    common.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for bench.csv/json/png")
    parser = argparse.ArgumentParser(
        prog="python -m workflows.benchmark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="way", required=True, metavar="WAY")
    every = sub.add_parser("all", parents=[common], help="every way that applies to a demo-layout folder")
    every.add_argument("--data", type=Path, required=True, help="folder made by `make demo`")
    every.add_argument("--pipeline", type=Path, default=DEFAULT_PIPELINE, help="PIPELINE.py for the MONAI peers")
    for name, (help_text, arguments, _fn) in WAYS.items():
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        for flag, kwargs in arguments:
            p.add_argument(flag, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; returns the exit status (1 when nothing could be measured)."""
    args = _parser().parse_args(argv)
    if args.batchsize < 1 or args.batches < 1:
        print("error: --batchsize and --batches must be at least 1", file=sys.stderr)
        return 2
    opts = Options(args.batchsize, args.batches, args.cold, args.device, args.workers, args.out, args.out / "work")
    mode = "cold" if opts.cold else "warm"
    print(f"benchmark: {args.way}, {mode}, {opts.batches} batches of {opts.batchsize}, device {opts.device}")
    if args.way == "all":
        if not args.data.is_dir():
            print(f"error: {args.data}: no such folder; run `make demo` first", file=sys.stderr)
            return 2
        results, skipped = run_all(args.data, opts, args.pipeline)
    else:
        jobs = [(f"ceiling {k}", f) for k, f in zip(CEILINGS, _ceilings_for(args.way, args, opts))]
        jobs.append((args.way, _bind(WAYS[args.way][2], args, opts)))
        results, skipped = _run_jobs(jobs)
    rows = report.ratios(results, opts.cold)
    print()
    print(report.table(rows, skipped))
    written = report.write(args.out, rows, skipped, opts)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0 if any(r.kind != "ceiling" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
