"""`prep cache` on a dask-jobqueue SLURM cluster, for datasets that outgrow one node.

Run it on a login node (or in a small job): it submits SLURM jobs that each start dask workers, waits
for them, and hands the scheduler's address to `prepare_cache`. Workers write their own shards and
journals into the shared output folder; a cache that was interrupted resumes where it stopped.

The scheduler and workers talk TLS by default (`security=True`: dask-jobqueue makes a temporary CA and
certificate for this run only; workers get them as files in --tls-dir, readable by you alone), so nobody
else on the cluster network can submit work to them. `--no-tls` turns this off (needs no `cryptography`).

    pip install 'blockprep[slurm]'
    python workflows/slurm/prep_cache_jobqueue.py demo/nifti/dataset.json \\
        --pipeline workflows/pipelines/spheres.py --output /project/me/cache_spheres \\
        --jobs 4 --cores 8 --memory 32GB --walltime 01:00:00 --queue cpu --account myproject
    python workflows/slurm/prep_cache_jobqueue.py ... --dry-run     # print the worker job script only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("datalist", type=Path, help="decathlon-style datalist JSON")
    p.add_argument("--pipeline", type=Path, required=True, help="PIPELINE.py or bundle config")
    p.add_argument("--output", type=Path, required=True, help="cache folder on storage every node can reach")
    p.add_argument("--jobs", type=int, default=2, help="SLURM jobs to submit (each runs --processes workers)")
    p.add_argument("--cores", type=int, default=8, help="cores per job")
    p.add_argument("--processes", type=int, default=None, help="dask worker processes per job (default: cores)")
    p.add_argument("--memory", default="32GB", help="memory per job")
    p.add_argument("--walltime", default="01:00:00", help="time limit per job")
    p.add_argument("--queue", default=None, help="SLURM partition")
    p.add_argument("--account", default=None, help="SLURM account")
    p.add_argument("--local-directory", default=None, help="node-local folder for dask's spill (e.g. $TMPDIR)")
    p.add_argument("--job-extra", action="append", default=[], help="extra #SBATCH directive (repeatable)")
    p.add_argument("--python", default=sys.executable, help="python on the compute nodes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the first worker")
    p.add_argument("--dry-run", action="store_true", help="print the worker job script and submit nothing")
    p.add_argument(
        "--no-tls", dest="tls", action="store_false", help="plain tcp:// (anyone on the network may connect)"
    )
    p.add_argument(
        "--tls-dir",
        type=Path,
        default=Path("~/.cache/blockprep/jobqueue-tls"),
        help="folder the compute nodes can read for this run's certificate files (made 0700)",
    )
    return p.parse_args(argv)


def make_cluster(args: argparse.Namespace) -> Any:
    """A dask-jobqueue SLURMCluster sized from the options (no job is submitted until it is scaled)."""
    from loaders.deps import require

    jobqueue = require("dask_jobqueue", "prep cache on SLURM (pip install 'blockprep[slurm]')")
    if args.tls:
        require("cryptography", "TLS between the dask scheduler and its workers (pip install 'blockprep[slurm]')")
    tls_dir = args.tls_dir.expanduser()
    if args.tls:
        tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tls_dir.chmod(0o700)  # the worker key is written here
    # default one thread per worker process: NIfTI decoding and MONAI transforms hold the GIL
    processes = args.processes or args.cores
    threads = max(1, args.cores // processes)
    return jobqueue.SLURMCluster(
        cores=args.cores,
        processes=processes,
        memory=args.memory,
        walltime=args.walltime,
        queue=args.queue,
        account=args.account,
        local_directory=args.local_directory,
        job_extra_directives=list(args.job_extra),
        python=args.python,
        # torch in each worker process gets its share of the job's cores, not all of them
        job_script_prologue=[f"export OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads}"],
        # a free port for the dashboard: login nodes are shared, 8787 is often taken
        scheduler_options={"dashboard_address": ":0"},
        security=True if args.tls else None,
        shared_temp_directory=str(tls_dir) if args.tls else None,
    )


def main(argv: list[str] | None = None) -> int:
    """Build the cluster, scale it, prepare the cache through its scheduler; returns the exit status."""
    from loaders.errors import PrepError

    args = parse(argv)
    try:
        return _run(args)
    except PrepError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    with make_cluster(args) as cluster:
        if args.dry_run:
            print(cluster.job_script())
            return 0
        from dask.distributed import Client

        from prep.cache import prepare_cache

        cluster.scale(jobs=args.jobs)
        print(f"submitted {args.jobs} SLURM job(s); scheduler at {cluster.scheduler_address}", flush=True)
        with Client(cluster, security=cluster.security) as client:
            client.wait_for_workers(1, timeout=args.timeout)
            summary = prepare_cache(
                args.datalist, args.pipeline, args.output, scheduler=cluster.scheduler_address,
                security=cluster.security, workers=args.jobs * (args.processes or args.cores),
            )  # fmt: skip
        print("\n".join(summary.lines()))
        return 1 if summary.quarantined else 0


if __name__ == "__main__":
    sys.exit(main())
