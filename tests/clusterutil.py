"""Real clusters for tests: `dask scheduler` / `dask worker` subprocesses, TLS certificates, cache comparison.

Every process is started here and stopped by its PID (terminate, then kill); nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment with the repository first on PYTHONPATH and one torch thread per process
    (several processes share this machine's cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **extra})
    return env


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop one process we started: SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


@dataclass
class DaskProcs:
    """A scheduler and workers running as `dask` subprocesses on localhost."""

    address: str
    scheduler: subprocess.Popen
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: Path = Path()

    def log(self, name: str) -> str:
        """The captured output of the scheduler or a worker (for failure messages)."""
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def tls_args(certs: dict[str, Path] | None, role: str) -> list[str]:
    """dask CLI options for a role's certificate (`scheduler`, `worker`), signed by certs['ca']."""
    if not certs:
        return []
    return ["--tls-ca-file", str(certs["ca"]), "--tls-cert", str(certs[f"{role}.crt"]),
            "--tls-key", str(certs[f"{role}.key"])]  # fmt: skip


@contextmanager
def dask_cluster(
    tmp: Path, workers: dict[str, bool], certs: dict[str, Path] | None = None, timeout: float = 180.0
) -> Iterator[DaskProcs]:
    """`dask scheduler` on a free port (port 0, read back from its scheduler file) and one `dask worker`
    per name (value: with a nanny), each with one thread; waits until all workers are registered."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = subprocess_env()
    sched_file = tmp / "scheduler.json"
    protocol = ["--protocol", "tls"] if certs else []

    def spawn(name: str, args: list[str]) -> subprocess.Popen:
        with open(tmp / f"{name}.log", "wb") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    python = [sys.executable, "-m"]
    sched = spawn("scheduler", [*python, "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                                "--dashboard-address", ":0", "--scheduler-file", str(sched_file), *protocol,
                                *tls_args(certs, "scheduler")])  # fmt: skip
    procs = DaskProcs("", sched, logs=tmp)
    try:
        _wait_for(lambda: sched_file.exists() and json.loads(sched_file.read_text() or "{}").get("address"),
                  timeout, "the dask scheduler to write its address", procs)  # fmt: skip
        procs.address = json.loads(sched_file.read_text())["address"]
        for name, nanny in workers.items():
            args = [*python, "distributed.cli.dask_worker", procs.address, "--nthreads", "1", "--name", name,
                    "--dashboard-address", ":0", "--local-directory", str(tmp / name),
                    "--nanny" if nanny else "--no-nanny", *tls_args(certs, "worker")]  # fmt: skip
            procs.workers[name] = spawn(name, args)
        _wait_for(lambda: _n_workers(procs.address, certs) >= len(workers), timeout, "the workers to register", procs)
        yield procs
    finally:
        for proc in [*procs.workers.values(), sched]:
            stop(proc)


def _wait_for(ready: object, timeout: float, what: str, procs: DaskProcs) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        dead = [n for n, p in {"scheduler": procs.scheduler, **procs.workers}.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{procs.log(n)}" for n in ["scheduler", *procs.workers])
            raise AssertionError(f"gave up waiting for {what} (exited: {dead})\n{logs}")
        time.sleep(0.2)


def _n_workers(address: str, certs: dict[str, Path] | None) -> int:
    """Workers the scheduler knows, asked by a short-lived client."""
    from distributed import Client
    from distributed.security import Security

    security = None
    if certs:
        security = Security(tls_ca_file=str(certs["ca"]), tls_client_cert=str(certs["client.crt"]),
                            tls_client_key=str(certs["client.key"]), require_encryption=True)  # fmt: skip
    try:
        with Client(address, timeout="5s", security=security, set_as_default=False) as client:
            return len(client.scheduler_info(n_workers=-1)["workers"])
    except OSError:
        return 0


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL one process we started and reap it."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def make_certs(folder: Path, roles: tuple[str, ...] = ("scheduler", "worker", "client"), ca_name: str = "ca") -> dict:
    """A CA and one certificate per role signed by it, made with the openssl command; returns the paths:
    'ca', '<role>.crt', '<role>.key'."""
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    ca_key, ca = folder / f"{ca_name}.key", folder / f"{ca_name}.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "2", "-subj", f"/CN=blockprep-test-{ca_name}")  # fmt: skip
    out: dict[str, Path] = {"ca": ca}
    for role in roles:
        key, csr, crt = (folder / f"{role}.{ext}" for ext in ("key", "csr", "crt"))
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
                "-subj", f"/CN={role}")  # fmt: skip
        openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                "-out", str(crt), "-days", "2")  # fmt: skip
        out[f"{role}.crt"], out[f"{role}.key"] = crt, key
    return out


def cache_contents(root: Path) -> list[dict[str, Any]]:
    """Everything a reader gets from a cache, item by item, without file names (they carry run tokens): each
    tensor's key, dtype, shape, checksum and bytes, and the item's meta line."""
    from loaders.cache.format import PreparedCache

    cache = PreparedCache(root)
    items = []
    for i in range(len(cache)):
        tensors = {}
        for e in cache.entries(i):
            with open(e.shard, "rb") as f:
                f.seek(e.offset)
                raw = f.read(e.nbytes)
            tensors[e.key] = (str(e.dtype), tuple(e.shape), e.xxh3, np.frombuffer(raw, dtype=np.uint8).tobytes())
        items.append({"tensors": tensors, "meta": json.dumps(_without_ids(cache.meta(i)), sort_keys=True)})
    return items


def _without_ids(value: object) -> object:
    """Meta without MONAI's trace ids: `applied_operations` records id() of the transform object that ran,
    which differs between any two processes (JSON text also makes NaN equal to NaN)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if not (k == "id" and "class" in value)}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def assert_same_cache(a: Path, b: Path) -> None:
    """Two caches hold the same items, tensors bit for bit, checksums and meta equal."""
    ca, cb = cache_contents(a), cache_contents(b)
    assert len(ca) == len(cb) > 0, (len(ca), len(cb))
    for i, (x, y) in enumerate(zip(ca, cb)):
        assert x["tensors"].keys() == y["tensors"].keys(), i  # type: ignore[attr-defined]
        for key in x["tensors"]:  # type: ignore[attr-defined]
            assert x["tensors"][key] == y["tensors"][key], f"item {i} tensor {key} differs"  # type: ignore[index]
        assert x["meta"] == y["meta"], f"item {i}: meta differs"


def wait_for_text(path: Path, text: str, running: Callable[[], bool], timeout: float = 300.0) -> str:
    """The contents of `path` once they hold `text`; fails if `running()` turns False first or at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = path.read_text(errors="replace") if path.exists() else ""
        if text in got:
            return got
        if not running() or time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never appeared in {path}:\n{got[-3000:]}")
        time.sleep(0.05)
