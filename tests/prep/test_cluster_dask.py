"""`prep cache --scheduler` on real dask clusters: `dask scheduler` + `dask worker` subprocesses on localhost,
a worker killed with SIGKILL mid-run, and a TLS scheduler that refuses clients without its certificate."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cacheutil import SPHERES
from clusterutil import assert_same_cache, dask_cluster, kill9, make_certs, stop, subprocess_env
from typer.testing import CliRunner

from prep.cache import prepare_cache
from prep.cache_verify import verify_cache
from prep.cli import app

# Each item leaves a mark named by the PID that prepares it, then waits: the test sees which worker is busy.
MARKING_PIPELINE = """
import os
import time
from pathlib import Path
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandFlipd, ScaleIntensityd

MARKS = Path(__file__).with_name("marks")

class MarkAndWait(MapTransform):  # a MONAI Transform: a plain function would end the cached head
    def __call__(self, d):
        name = Path(str(d["image"].meta["filename_or_obj"])).name
        (MARKS / f"{os.getpid()}-{name}").touch()
        time.sleep(2.0)  # the window in which the test kills the victim mid-item
        return d

transform = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
                     ScaleIntensityd(keys="image"), MarkAndWait(keys=["image"]), RandFlipd(keys=["image"], prob=0.5)])
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prep", *args], capture_output=True, text=True, timeout=600,
                          env=subprocess_env())  # fmt: skip


@pytest.mark.slow
def test_cache_on_a_scheduler_with_two_workers_equals_a_local_run(tmp_path: Path, nifti_dataset: Path) -> None:
    local = tmp_path / "local"
    prepare_cache(nifti_dataset, SPHERES, local, workers=1, processes=False)
    with dask_cluster(tmp_path / "dask", {"w0": True, "w1": True}) as cluster:
        proc = _cli("cache", str(nifti_dataset), "--pipeline", str(SPHERES), "--output", str(tmp_path / "remote"),
                    "--scheduler", cluster.address)  # fmt: skip
        logs = cluster.log("w0") + cluster.log("w1")
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "6 items: 6 cached" in proc.stdout
    assert_same_cache(local, tmp_path / "remote")
    assert verify_cache(tmp_path / "remote") == []


@pytest.mark.slow
def test_a_worker_killed_mid_run_still_gives_the_clean_cache(tmp_path: Path, nifti_dataset: Path) -> None:
    pipe = tmp_path / "pipe" / "marking.py"
    pipe.parent.mkdir()
    pipe.write_text(MARKING_PIPELINE)
    marks = pipe.parent / "marks"
    marks.mkdir()
    clean = tmp_path / "clean"
    prepare_cache(nifti_dataset, pipe, clean, workers=1, processes=False)
    shutil.rmtree(marks)
    marks.mkdir()
    out = tmp_path / "killed"
    # the victim runs without a nanny: SIGKILL removes it for good and its task must move to the survivor
    with dask_cluster(tmp_path / "dask", {"survivor": True, "victim": False}) as cluster:
        victim = cluster.workers["victim"]
        args = [sys.executable, "-m", "prep", "cache", str(nifti_dataset), "--pipeline", str(pipe), "--output",
                str(out), "--scheduler", cluster.address]  # fmt: skip
        run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        try:
            deadline = time.monotonic() + 300
            while not any(m.name.startswith(f"{victim.pid}-") for m in marks.iterdir()):
                assert run.poll() is None and time.monotonic() < deadline, "the victim never started an item"
                time.sleep(0.05)
            kill9(victim)  # mid-item: it is inside the head, holding an unfinished task
            output, _ = run.communicate(timeout=600)
        finally:
            stop(run)
    assert run.returncode == 0, output
    assert "6 items: 6 cached" in output, output
    victim_items = {m.name.split("-", 1)[1] for m in marks.iterdir() if m.name.startswith(f"{victim.pid}-")}
    others = {m.name.split("-", 1)[1] for m in marks.iterdir() if not m.name.startswith(f"{victim.pid}-")}
    assert victim_items & others, "the item the victim held should have been prepared again by the survivor"
    assert_same_cache(clean, out)
    assert verify_cache(out) == []


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates (apt-get install openssl)")
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.slow
def test_tls_scheduler_serves_the_certificate_and_refuses_others(
    tmp_path: Path, nifti_dataset: Path, certs: dict[str, Path]
) -> None:
    local = tmp_path / "local"
    prepare_cache(nifti_dataset, SPHERES, local, workers=1, processes=False)
    stranger = make_certs(tmp_path / "stranger", roles=("client",), ca_name="other-ca")
    runner = CliRunner()
    base = ["cache", str(nifti_dataset), "--pipeline", str(SPHERES)]
    with dask_cluster(tmp_path / "dask", {"w0": True}, certs=certs) as cluster:
        assert cluster.address.startswith("tls://")
        tcp = cluster.address.replace("tls://", "tcp://")
        refused = {
            "no certificate": [*base, "--output", str(tmp_path / "a"), "--scheduler", cluster.address],
            "plain tcp": [*base, "--output", str(tmp_path / "b"), "--scheduler", tcp],
            "trusting another CA": [*base, "--output", str(tmp_path / "c"), "--scheduler", cluster.address,
                           "--tls-ca-file", str(stranger["ca"]), "--tls-cert", str(stranger["client.crt"]),
                           "--tls-key", str(stranger["client.key"])],
            "a certificate of another CA": [*base, "--output", str(tmp_path / "d"), "--scheduler", cluster.address,
                                            "--tls-ca-file", str(certs["ca"]), "--tls-cert",
                                            str(stranger["client.crt"]), "--tls-key", str(stranger["client.key"])],
        }  # fmt: skip
        for case, args in refused.items():
            result = runner.invoke(app, args)
            assert result.exit_code == 1, (case, result.output)
            errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and "Traceback" not in result.output, (case, result.output)
            assert "--tls-ca-file" in errors[0] or "refused" in errors[0], (case, errors)
            print(case, "->", errors[0])
        ok = runner.invoke(app, [*base, "--output", str(tmp_path / "tls"), "--scheduler", cluster.address,
                                 "--tls-ca-file", str(certs["ca"]), "--tls-cert", str(certs["client.crt"]),
                                 "--tls-key", str(certs["client.key"])])  # fmt: skip
        assert ok.exit_code == 0, ok.output + cluster.log("w0")
    assert not any((tmp_path / name / "manifest.json").exists() for name in "abcd")
    assert_same_cache(local, tmp_path / "tls")


def test_tls_options_are_checked_before_connecting(tmp_path: Path, nifti_dataset: Path) -> None:
    runner = CliRunner()
    base = ["cache", str(nifti_dataset), "--pipeline", str(SPHERES), "--output", str(tmp_path / "c")]
    cases = {
        "missing --tls-key": ["--scheduler", "tls://127.0.0.1:9", "--tls-ca-file", str(SPHERES), "--tls-cert",
                              str(SPHERES)],
        "tls:// scheduler": ["--scheduler", "tcp://127.0.0.1:9", "--tls-ca-file", str(SPHERES), "--tls-cert",
                             str(SPHERES), "--tls-key", str(SPHERES)],
        "not found": ["--scheduler", "tls://127.0.0.1:9", "--tls-ca-file", str(tmp_path / "none.pem"),
                      "--tls-cert", str(SPHERES), "--tls-key", str(SPHERES)],
    }  # fmt: skip
    for expected, extra in cases.items():
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 1 and expected in result.output, (expected, result.output)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("scheduler", "warned"),
    [("tcp://10.1.2.3:8786", True), ("tcp://node7:8786", True), ("tcp://[2001:db8::1]:8786", True),
     ("tcp://127.0.0.1:8786", False), ("tcp://localhost:8786", False), ("tcp://[::1]:8786", False),
     ("tls://10.1.2.3:8786", False), (None, False)],
)  # fmt: skip
def test_plain_tcp_off_loopback_warns_in_one_line(scheduler: str | None, warned: bool) -> None:
    from prep.cluster import plain_tcp_warning

    line = plain_tcp_warning(scheduler)
    assert (line is not None) == warned
    if line:
        assert "\n" not in line and "run code" in line and "tls://" in line and "--tls-ca-file" in line
