"""A real one-node SLURM cluster on localhost for tests: munged, slurmctld and slurmd in the foreground.

Everything (munge key and socket, state, spool, logs, slurm.conf) lives under one folder; the node is
declared with this machine's real CPUs and memory (`slurmd -C`); no systemd. Jobs run as root
(`SlurmUser=root`), tracked by `proctrack/linuxproc` with `task/none`, which work without cgroups.
Clients find the cluster through `SLURM_CONF` (see `SlurmCluster.env`). Daemons are stopped by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
               "PREEMPTED"}  # fmt: skip


def unavailable_reason() -> str | None:
    """Why a local SLURM cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (SlurmUser=root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    return None


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    """A running one-node cluster: its config, folder, node name and the daemons' processes."""

    root: Path
    conf: Path
    node: str
    cpus: int
    memory_mb: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for SLURM clients (and jobs, which inherit it through sbatch's --export=ALL)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """A SLURM client command; its stdout (raises with stderr on failure)."""
        proc = subprocess.run(args, capture_output=True, text=True, env=env or self.env(), cwd=cwd, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit a job (`--parsable`); returns its id."""
        return int(self.run("sbatch", "--parsable", *args, env=env, cwd=cwd).strip().split(";")[0])

    def state(self, job: int) -> str:
        """A job's state as the controller reports it (kept a while after the job ends)."""
        out = self.run("scontrol", "show", "job", "-o", str(job))
        match = re.search(r"JobState=(\S+)", out)
        return match.group(1) if match else "UNKNOWN"

    def wait(self, jobs: list[int], timeout: float = 600.0) -> dict[int, str]:
        """Wait until every job has ended; returns job -> final state."""
        deadline = time.monotonic() + timeout
        while True:
            states = {job: self.state(job) for job in jobs}
            if all(s in DONE_STATES for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still not done after {timeout} s: {states}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The tail of the daemons' logs (for failure messages)."""
        parts = []
        for name in ("slurmctld", "slurmd"):
            path = self.root / "log" / f"{name}.log"
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)


def _node_line() -> tuple[str, int, int]:
    """`slurmd -C`'s node definition (real CPUs, sockets, memory) without its UpTime; and cpus, memory."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    line = re.sub(r"\s*UpTime=\S+", "", line)
    cpus = int(re.search(r"CPUs=(\d+)", line).group(1))  # type: ignore[union-attr]
    memory = int(re.search(r"RealMemory=(\d+)", line).group(1))  # type: ignore[union-attr]
    return line, cpus, memory


def write_conf(root: Path) -> tuple[Path, str, int, int]:
    """slurm.conf for a one-node cluster under `root`; returns (path, node name, cpus, memory MB)."""
    node_line, cpus, memory = _node_line()
    node = re.search(r"NodeName=(\S+)", node_line).group(1)  # type: ignore[union-attr]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join([
            "ClusterName=blockprep-ci", f"SlurmctldHost={node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={root / 'munge' / 'munge.sock'}", "CredType=cred/munge",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}", f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}", f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none", "MailProg=/bin/true",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MinJobAge=3600", f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n"
    )  # fmt: skip
    return conf, node, cpus, memory


@contextmanager
def slurm_cluster(root: Path, timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd under `root`; wait for the node to be idle; stop them by PID."""
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    conf, node, cpus, memory = write_conf(root)
    cluster = SlurmCluster(root, conf, node, cpus, memory)
    key, sock = root / "munge" / "munge.key", root / "munge" / "munge.sock"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    daemons = {
        "munged": ["munged", "--foreground", f"--key-file={key}", f"--socket={sock}", "--force",
                   f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                   f"--seed-file={root / 'munge' / 'seed'}"],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(conf)],
        "slurmd": ["slurmd", "-D", "-f", str(conf), "-N", node],
    }  # fmt: skip
    try:
        for name, args in daemons.items():
            with open(root / "log" / f"{name}.out", "wb") as out:
                cluster.procs[name] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=cluster.env())
            if name == "munged":
                _wait(lambda: sock.exists(), timeout, "munged's socket", cluster)
        _wait(lambda: _idle(cluster), timeout, "the node to be idle", cluster)
        yield cluster
    finally:
        _stop_all(cluster)


def _idle(cluster: SlurmCluster) -> bool:
    try:
        return cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%T").strip() == "idle"
    except AssertionError:
        return False


def _wait(ready: object, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            outs = "\n".join((cluster.root / "log" / f"{n}.out").read_text(errors="replace")[-1500:] for n in dead)
            raise AssertionError(f"gave up waiting for {what} (exited: {dead})\n{outs}\n{cluster.logs()}")
        time.sleep(0.2)


def _stop_all(cluster: SlurmCluster) -> None:
    """Cancel what is still queued or running (job steps outlive slurmd), then stop the daemons in reverse."""
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        subprocess.run(["scancel", "--full", "--partition", "debug"], env=cluster.env(), capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h"], env=cluster.env(), capture_output=True, text=True).stdout
            if not out.strip():
                break
            time.sleep(0.5)
    for name in reversed(list(cluster.procs)):
        proc = cluster.procs[name]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)
