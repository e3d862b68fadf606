"""blockprep's own ways: the prepared cache through PreparedDataset with each backend, and the research
loaders' block-range reads (xNVMe) driven by a blockprep bmap."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workflows.bench.core import Options, Result, Unavailable, cuda_sync, cycle, evict, files_under, time_batches

BACKENDS = ("posix", "direct", "blockdev", "kvikio", "xnvme", "auto")


def _backend_error(name: str, exc: BaseException) -> Unavailable:
    return Unavailable(f"backend {name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


def prepared(cache_dir: str | os.PathLike[str], backend: str, opts: Options, **backend_options: Any) -> Result:
    """PreparedDataset.iter_batches over the cache: each batch one backend call, two batches read ahead."""
    from loaders.dataset import PreparedDataset
    from loaders.errors import PrepError

    root = Path(cache_dir)
    if not (root / "manifest.json").is_file():
        raise Unavailable(f"{root}: no committed prepared cache here (run `prep cache` or `make demo`)")
    try:
        full = PreparedDataset(root, backend=backend, device=opts.device, backend_options=backend_options)
        chosen = full.backend.name  # builds the backend now, so a missing dependency is reported here
    except (PrepError, OSError, ImportError, TypeError) as exc:
        raise _backend_error(backend, exc) from exc
    dataset = full.subset(cycle(len(full), opts.items))
    shards = files_under(root / "shards")

    def batches() -> Iterator[Any]:
        yield from dataset.iter_batches(opts.batchsize, prefetch=2)

    try:
        for _ in batches():  # untimed pass: one-time costs (threads, imports) stay out; warm fills the cache
            pass
        how = evict(shards) if opts.cold else "warm"
        seconds, nbytes = time_batches(batches(), opts.batches, cuda_sync(opts.device))
    except PrepError as exc:
        raise _backend_error(backend, exc) from exc
    finally:
        full.close()
    name = f"blockprep prepared ({backend})" if backend == chosen else f"blockprep prepared ({backend}->{chosen})"
    return Result(name, "volumes", opts.items, seconds, nbytes, "ours", how)


def backend_options(backend: str, bmap: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Options a backend needs to be built: blockdev reads the shards through their bmap."""
    if backend != "blockdev":
        return {}
    if bmap is None or not Path(bmap).is_file():
        raise Unavailable(
            f"backend blockdev needs the shards' bmap ({bmap or '--bmap'} not found): "
            "run `prep bmap` over the cache folder on its mountpoint"
        )
    return {"bmap": str(bmap)}


def _bmap_items(bmap: Any, datadir: str | os.PathLike[str] | None) -> list[tuple[str, list[tuple[int, int]]]]:
    """(key, device byte ranges) of every raw-readable file of a bmap, or only of the files under `datadir`."""
    from loaders.errors import PrepError

    if datadir is not None:
        from workflows.bench.research import tree_files

        try:
            keys = [bmap.key_for(p) for p in tree_files(datadir)[0]]
        except (PrepError, KeyError, ValueError) as exc:
            raise Unavailable(f"xnvme-gds: files under {datadir} are not in the bmap ({exc})") from exc
    else:
        keys = list(bmap.keys())
    out = []
    for key in keys:
        entry = bmap.entry(key)
        if entry.raw_readable and entry.size:
            segs = bmap.segments(key, whole_disk=True)
            out.append((key, [(s.device_offset, s.nbytes) for s in segs if s.device_offset is not None]))
    if not out:
        raise Unavailable("xnvme-gds: the bmap has no raw-readable files to read")
    return out


def xnvme_gds(
    uri: str | None,
    bmap_path: str | os.PathLike[str],
    mem: str,
    opts: Options,
    datadir: str | os.PathLike[str] | None = None,
) -> Result:
    """The research loader's raw path: each file's block ranges (from a blockprep bmap, every extent, not
    only the first) read with xNVMe from the device, into host buffers or copied on to the GPU (mem=gpu).

    Not run here without libxnvme; on a node with it, `uri` is the whole NVMe namespace (e.g. /dev/nvme0n1).
    """
    from loaders.bmap import BlockMap
    from loaders.errors import PrepError

    if mem == "gpu":
        from workflows.bench.core import require_gpu

        require_gpu(opts, "xnvme-gds --mem gpu")
    if not Path(bmap_path).is_file():
        raise Unavailable(f"xnvme-gds: {bmap_path} not found (make one with `prep bmap`)")
    try:
        bmap = BlockMap.load(bmap_path)
        items = _bmap_items(bmap, datadir)
        from loaders.backends.xnvme import XnvmeBackend

        backend = XnvmeBackend(device_uri=uri or bmap.disk)
    except (PrepError, OSError, ImportError) as exc:
        raise Unavailable(f"xnvme-gds: {str(exc).splitlines()[0]}") from exc
    order = [items[i] for i in cycle(len(items), opts.items)]
    how = evict([bmap.file_path(k) for k, _ in items]) if opts.cold else "warm"

    def batches() -> Iterator[Any]:
        for at in range(0, len(order), opts.batchsize):
            ranges = [r for _, rs in order[at : at + opts.batchsize] for r in rs]
            arrays: list[Any] = backend.read_device_ranges(ranges)
            if mem == "gpu":  # host-staged: xNVMe's sync interfaces read into host memory
                import torch

                arrays = [torch.from_numpy(a).to(opts.device, non_blocking=True) for a in arrays]
            yield arrays

    with backend:
        seconds, nbytes = time_batches(batches(), opts.batches, cuda_sync(opts.device))
    return Result(f"xnvme-gds ({mem})", "images" if datadir else "files", opts.items, seconds, nbytes, "research", how)


def xnvme_bam(uri: str | None, bmap_path: str | os.PathLike[str], opts: Options) -> Result:
    """BaM (GPU-initiated NVMe queues) needs a BaM-enabled libxnvme build and a GPU; this benchmark has no
    BaM read path of its own, so it always reports which of those is missing."""
    from workflows.bench.core import require_gpu

    require_gpu(opts, "xnvme-bam")
    try:
        from loaders.backends.xnvme import load_capi

        api = load_capi()
    except Exception as exc:  # MissingDependencyError, OSError from ctypes: report, never crash the run
        raise Unavailable(f"xnvme-bam: {str(exc).splitlines()[0]}") from exc
    if not any("bam" in name.lower() for name in dir(api)):
        raise Unavailable("xnvme-bam: this libxnvme has no BaM backend (needs a BaM-enabled xNVMe build)")
    raise Unavailable(f"xnvme-bam: a BaM-enabled libxnvme is present but not driven by this benchmark ({uri})")
