"""blockprep's own ways: the prepared cache through PreparedDataset with each backend, and the research
loaders' block-range reads (xNVMe) driven by a blockprep bmap."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workflows.bench.core import Options, Result, Unavailable, cuda_sync, cycle, files_under, start_pass, time_batches

BACKENDS = ("posix", "direct", "blockdev", "kvikio", "xnvme", "auto")


def _backend_error(name: str, exc: BaseException) -> Unavailable:
    return Unavailable(f"backend {name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


def prepared(cache_dir: str | os.PathLike[str], backend: str, opts: Options, **backend_options: Any) -> Result:
    """PreparedDataset.iter_batches over the cache: each batch one backend call, two batches read ahead."""
    from loaders import PreparedDataset
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
        how = start_pass(shards, opts.cold)
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
