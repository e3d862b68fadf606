"""PreparedLoader(feeder=True): the batches made in a process of their own are the in-process loader's, batch
for batch, through epochs left early, reseeding and resuming; errors come back in one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from test_state import _loader, _plain, _same, make_cache

from loaders.fast.feeder import FeederError

OPTIONS: dict[str, Any] = {"gpu_budget": 0, "prefetch": 2}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cache(tmp_path_factory)


def _run(loader: Any) -> list[list[dict[str, Any]]]:
    """Epoch 0 left after its first batch, epoch 1 whole, epoch 2 whole (the feeder's child began it before it
    was asked for), reseeded, epoch 3 (the child's early start dropped), epoch 5 after set_epoch(5)."""
    out = [[_plain(next(iter(loader)))]]
    out.append([_plain(b) for b in loader])
    out.append([_plain(b) for b in loader])
    loader.set_random_state(9)
    out.append([_plain(b) for b in loader])
    loader.set_epoch(5)
    out.append([_plain(b) for b in loader])
    return out


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(OPTIONS, id="cpu"),
        pytest.param({"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0"}, id="gpu-tier", marks=pytest.mark.gpu),
    ],
)
def test_feeder_batches_are_the_in_process_loaders(made: tuple[Path, Path], options: dict[str, Any]) -> None:
    want_loader = _loader(made, {**options, "feeder": False})
    want = _run(want_loader)
    fed = _loader(made, {**options, "feeder": True})
    try:
        got = _run(fed)
        for e, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"epoch {e}")
        assert fed.state_dict() == want_loader.state_dict()
        resumed = _loader(made, {**options, "feeder": True})
        saved = want_loader.state_dict()
        resumed.load_state_dict(saved)
        _same([_plain(b) for b in resumed], [_plain(b) for b in want_loader], "resumed")
        resumed.close()
    finally:
        fed.close()
    assert fed._feeder._proc.poll() is not None  # the child is gone


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", ["1", "0"], ids=["handed-over-with-its-work", "at-the-credit"])
def test_feeder_batches_with_graphs_and_checks_are_the_in_process_loaders(
    made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, ahead: str
) -> None:
    """The child captures the tail as CUDA graphs (a dropout with a device-side check among them) and, by default,
    hands each batch over from its tail thread with the next batch's capture opened (BLOCKPREP_PACK_AHEAD and
    BLOCKPREP_CAPTURE_AHEAD at 0: at the parent's credit, each capture opened where it begins): the in-process
    loader's batches, through an epoch left early, the child's early start taken and dropped, and a resume."""
    from test_folds import CHAINS

    monkeypatch.setenv("BLOCKPREP_PACK_AHEAD", ahead)
    monkeypatch.setenv("BLOCKPREP_CAPTURE_AHEAD", ahead)
    source = (
        CHAINS["posneg-3d"][2]
        .replace(
            "RandScaleIntensityd(",
            'RandCoarseDropoutd(keys="image", holes=2, spatial_size=2, prob=0.5), RandScaleIntensityd(',
        )
        .replace("from monai.transforms import (", "from monai.transforms import (RandCoarseDropoutd, ")
    )
    options = {"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0"}
    want_loader = _loader(made, {**options, "feeder": False}, source)
    want = _run(want_loader)
    fed = _loader(made, {**options, "feeder": True}, source)
    try:
        got = _run(fed)
        for e, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"epoch {e}")
    finally:
        fed.close()
    assert fed._feeder._proc.poll() is not None


def test_building_the_loader_does_not_wait_for_the_child_to_connect(
    made: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader is built and its first batch made while the child has not even connected (a child that sleeps
    before it starts here; on a GPU box the child's interpreter and imports took 3-4 s, the defaults' first batch
    with them); a close meanwhile stops the child and ends the wait for its connection."""
    from loaders.fast import feeder

    monkeypatch.setattr(feeder, "_CHILD", "import time; time.sleep(60); " + feeder._CHILD)
    want = _plain(next(iter(_loader(made, {**OPTIONS, "feeder": False}))))
    fed = _loader(made, {**OPTIONS, "feeder": True})
    got = _plain(next(iter(fed)))
    assert fed._feeder._conn is None and fed.made_here == 1  # made here, the child not yet connected
    _same([got], [want], "first batch")
    fed.close()
    assert fed._feeder._proc.poll() is not None and not fed._feeder._accepting.is_alive()


def test_the_child_builds_its_loader_only_once_the_first_batch_is_made(made: tuple[Path, Path]) -> None:
    """The child connects and takes its arguments at once, but builds its loader (on a GPU: its CUDA context, whose
    making holds up this process's first pinned and device allocations) only once this process has made its
    first batch; `wait_feeder` lets it go too."""
    import time

    fed = _loader(made, {**OPTIONS, "feeder": True})
    try:
        assert fed._feeder._connected(wait=True)  # connected, its arguments sent
        time.sleep(2.0)  # time enough to build a loader of four items on the CPU
        assert not fed._feeder.poll_ready() and not fed._feeder._go_said
        it = iter(fed)
        next(it)
        assert fed._feeder._go_said and fed.made_here == 1
        fed._feeder.wait_ready()
        it.close()
    finally:
        fed.close()
    waited = _loader(made, {**OPTIONS, "feeder": True})
    try:
        waited.wait_feeder()
        assert waited._feeder.ready and waited.made_here == 0
    finally:
        waited.close()


def test_batches_come_at_once_while_the_child_starts_then_from_the_child(made: tuple[Path, Path]) -> None:
    """The first batch does not wait for the child (its imports take seconds): this process makes the batches
    until the child is ready, then hands the rest of the epoch over at a batch boundary with the random states
    as of the last batch delivered; the epochs are the in-process loader's, batch for batch."""
    want_loader = _loader(made, {**OPTIONS, "feeder": False})
    want = [[_plain(b) for b in want_loader] for _ in range(2)]
    fed = _loader(made, {**OPTIONS, "feeder": True})
    try:
        it = iter(fed)
        got = [_plain(next(it))]
        assert fed.made_here == 1 and not fed._feeder.ready  # made here: the child is still starting
        fed._feeder.wait_ready()
        got += [_plain(b) for b in it]  # batch 2 on: the child's
        assert fed.made_here == 1
        _same(got, want[0], "epoch 0, handed over after its first batch")
        _same([_plain(b) for b in fed], want[1], "epoch 1, the child's")
        assert fed.made_here == 1 and fed.state_dict() == want_loader.state_dict()
    finally:
        fed.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_auto_feeder_on_a_gpu_where_the_transform_can_go(made: tuple[Path, Path], device: str) -> None:
    """feeder="auto" (the default): a child process on a CUDA device, in process on the CPU; a transform that
    cannot be sent (a lock) or a Backend object keeps the batches in process instead of failing."""
    import threading

    from monai.transforms import Compose, Lambdad

    from loaders.backends import get_backend
    from loaders.fast.loader import PreparedLoader

    default = _loader(made, {"gpu_budget": 0, "device": device})
    try:
        assert (default._feeder is not None) == (device != "cpu")
        assert default.tail_thread == (device == "cpu")  # the child runs the tail on its main thread
    finally:
        default.close()
    cache, pipeline = made
    from test_folds import _transform

    local = Compose([*_transform(pipeline).transforms, Lambdad(keys="image", func=lambda x: x)])
    local.guard = threading.Lock()  # type: ignore[attr-defined]
    held = PreparedLoader(cache, local, batch_size=2, device=device, gpu_budget=0)
    assert held._feeder is None
    held.close()
    backend = get_backend("posix", device)
    given = PreparedLoader(cache, _transform(pipeline), batch_size=2, device=device, gpu_budget=0, backend=backend)
    assert given._feeder is None
    given.close()


def test_feeder_refuses_what_cannot_be_sent(made: tuple[Path, Path]) -> None:
    """A lambda goes by value (cloudpickle); a lock held by the transform cannot go at all."""
    import threading

    from monai.transforms import Compose, Lambdad

    from loaders.fast.loader import PreparedLoader

    cache, pipeline = made
    from test_folds import _transform

    chain = _transform(pipeline)
    local = Compose([*chain.transforms, Lambdad(keys="image", func=lambda x: x)])
    PreparedLoader(cache, local, batch_size=2, device="cpu", gpu_budget=0, feeder=True).close()
    local.guard = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(FeederError, match="cannot be sent to a process of its own") as info:
        PreparedLoader(cache, local, batch_size=2, device="cpu", gpu_budget=0, feeder=True)
    assert "\n" not in str(info.value)


def test_a_failure_in_the_feeder_comes_back_in_one_line(made: tuple[Path, Path], tmp_path: Path) -> None:
    """A shard cut short after the loader was built: the child's read fails, the training process raises
    FeederError naming it, in one line; the child is still there for the next epoch or close."""
    import shutil

    cache, pipeline = made
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    fed = _loader((copy, pipeline), {**OPTIONS, "feeder": True})
    try:
        assert fed.tail_thread is False  # in the child the tail runs on its main thread
        fed._feeder.wait_ready()  # the child makes the batches (not this process, while it starts)
        for shard in (copy / "shards").iterdir():
            with open(shard, "r+b") as f:
                f.truncate(16)
        with pytest.raises(FeederError) as info:
            list(fed)
        assert "\n" not in str(info.value) and "feeder=True" in str(info.value)
        assert fed._feeder._proc.poll() is None
    finally:
        fed.close()
    assert _loader(made, OPTIONS).tail_thread is True  # in process, the default is the read thread


class OnlyHere:
    """Unpickles only in the process that made it (a stand-in for a transform that cannot be rebuilt)."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["pid"] != os.getpid():
            raise RuntimeError("this object refuses to be rebuilt in another process")
        self.__dict__.update(state)


def test_a_child_that_cannot_build_the_loader_says_so_at_the_first_epoch(made: tuple[Path, Path]) -> None:
    """The child builds its loader while the caller goes on (and this process makes the batches meanwhile); its
    failure is raised at the first batch boundary after it, in one line, and every later use says the feeder
    is gone."""
    from test_folds import _transform

    from loaders.fast.loader import PreparedLoader

    cache, pipeline = made
    chain = _transform(pipeline)
    chain.stowaway = OnlyHere()  # type: ignore[attr-defined]
    fed = PreparedLoader(cache, chain, batch_size=2, device="cpu", gpu_budget=0, feeder=True)  # built: no wait
    try:
        fed._feeder._proc.wait(timeout=120)  # the child has said why and left
        with pytest.raises(FeederError, match="refuses to be rebuilt") as info:
            next(iter(fed))
        assert "\n" not in str(info.value)
        with pytest.raises(FeederError, match="gone|refuses"):
            next(iter(fed))
    finally:
        fed.close()


def test_an_auto_feeder_that_cannot_start_leaves_the_batches_to_this_process(made: tuple[Path, Path]) -> None:
    """feeder="auto" (the GPU default; forced here on the CPU): a child that cannot build the loader is said
    once as a warning, and the same batches come from this process."""
    from test_folds import _transform

    from loaders.fast.loader import PreparedLoader

    cache, pipeline = made
    want = _run(
        PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", gpu_budget=0).set_random_state(5)
    )
    chain = _transform(pipeline)
    chain.stowaway = OnlyHere()  # type: ignore[attr-defined]
    fed = PreparedLoader(cache, chain, batch_size=2, device="cpu", gpu_budget=0, feeder=True, tail_thread=None)
    fed._feeder_auto = True  # what feeder="auto" sets on a GPU
    fed.set_random_state(5)
    fed._feeder._proc.wait(timeout=120)  # the child has said why and left
    try:
        with pytest.warns(RuntimeWarning, match="refuses to be rebuilt.*made in this process instead"):
            got = _run(fed)
        assert fed._feeder is None and fed.tail_thread
        for e, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"epoch {e}")
    finally:
        fed.close()


def test_the_child_ignores_the_signals_its_training_script_handles(made: tuple[Path, Path]) -> None:
    """Ctrl-C and SLURM's USR1/USR2 reach a whole process group: the child takes none of them (USR1 would kill
    it by default), so a script that saves its state on the signal goes on with the same batches."""
    import signal
    import time

    want = _run(_loader(made, {**OPTIONS, "feeder": False}))
    fed = _loader(made, {**OPTIONS, "feeder": True})
    try:
        fed._feeder.wait_ready()
        for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            os.kill(fed._feeder._proc.pid, sig)
        time.sleep(0.2)
        assert fed._feeder._proc.poll() is None
        for e, (g, w) in enumerate(zip(_run(fed), want)):
            _same(g, w, f"epoch {e}")
    finally:
        fed.close()


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie whose parent is gone has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_ends_when_the_training_process_is_killed(made: tuple[Path, Path], tmp_path: Path) -> None:
    """A training process killed outright (kill -9, the OOM killer, a job's end) leaves no feeder behind holding
    memory: the child sees its socket close and exits."""
    import signal
    import subprocess
    import sys
    import time

    cache, pipeline = made
    script = tmp_path / "train.py"
    script.write_text(
        "import time\n"
        "from prep.pipeline import load_pipeline\n"
        "from loaders.fast.loader import PreparedLoader\n"
        f"fed = PreparedLoader({str(cache)!r}, load_pipeline({str(pipeline)!r}).transform, batch_size=2, "
        "device='cpu', gpu_budget=0, feeder=True)\n"
        "next(iter(fed))\n"
        "print(fed._feeder._proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 120  # a child still importing on a loaded 2-core box leaves after its imports
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child), f"the feeder process {child} outlived its training process"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


@pytest.mark.gpu
def test_loaders_on_every_gpu_in_one_process_with_the_defaults(made: tuple[Path, Path]) -> None:
    """One loader with the defaults (a feeder each) on every GPU of the box (2, 4, ...) in one process whose
    current device is cuda:0: each batch on its loader's device, equal to that device's in-process loader,
    through the start (made here) and after it (made by the child)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    devices = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    want = {}
    for d in devices:
        plain = _loader(made, {"gpu_budget": 0, "device": d, "feeder": False})
        want[d] = [[_plain(b) for b in plain] for _ in range(2)]
        plain.close()
    fed = {d: _loader(made, {"gpu_budget": 0, "device": d}) for d in devices}
    try:
        for d, loader in fed.items():
            assert loader._feeder is not None  # the default on a GPU
            first = list(loader)
            assert all(b["image"].device == torch.device(d) for b in first)
            _same([_plain(b) for b in first], want[d][0], f"{d} epoch 0")
            loader._feeder.wait_ready()
            _same([_plain(b) for b in loader], want[d][1], f"{d} epoch 1 (the child's)")
    finally:
        for loader in fed.values():
            loader.close()


def test_the_child_writes_its_profile_on_request(
    made: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pstats

    from loaders.fast.child import PROFILE

    monkeypatch.setenv(PROFILE, str(tmp_path))
    fed = _loader(made, {**OPTIONS, "feeder": True})
    try:
        fed.wait_feeder()  # a child still starting is stopped at once on close, with nothing to write
        assert [_plain(b) for b in fed] and fed.made_here == 0
        pid = fed.feeder_pid
    finally:
        fed.close()
    stats = pstats.Stats(str(tmp_path / f"feeder-{pid}.prof"))
    assert any(path.endswith("loader.py") for path, _, _ in stats.stats)  # type: ignore[attr-defined]


def test_closing_while_the_child_starts_stops_it_at_once(made: tuple[Path, Path]) -> None:
    """A child still starting holds nothing: close() kills it rather than waiting out its imports."""
    import signal

    fed = _loader(made, {**OPTIONS, "feeder": True})
    first = _plain(next(iter(fed)))  # made in this process while the child imports
    starting = not fed._feeder.ready
    fed.close()
    assert first and fed.made_here >= 1
    assert fed._feeder._proc.poll() == (-signal.SIGKILL if starting else 0)


def test_the_parent_sends_tensors_by_reference_as_the_child_does() -> None:
    """What the training process sends (the lent device tier) goes through torch's reductions, as the child's
    batches do: a tensor arrives sharing its memory (on a GPU: its CUDA IPC handle), not as a copy of its
    bytes through the socket (plain pickle copied the whole tier: seconds at the hand-over)."""
    import torch

    from loaders.fast.feeder import Feeder, loads

    class Wire:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send_bytes(self, data: bytes) -> None:
            self.sent.append(data)

    feeder = Feeder.__new__(Feeder)
    feeder._conn = Wire()
    t = torch.arange(1 << 16, dtype=torch.float32)
    feeder._send("tier", {0: {"image": t}})
    kind, items = loads(feeder._conn.sent[0])
    got = items[0]["image"]
    assert kind == "tier" and torch.equal(got, t)
    assert got.is_shared() and len(feeder._conn.sent[0]) < t.nbytes // 4  # a handle, not the 256 KiB


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_the_child_makes_at_most_prefetch_batches_beyond_those_taken(made: tuple[Path, Path], device: str) -> None:
    """The child's credits are the batches the parent has taken (the shared tally): with prefetch=2 and one batch
    taken, two more are sent and no third until the tally moves; then exactly one."""
    import time

    from loaders.fast.feeder import loads

    fed = _loader(made, {**OPTIONS, "feeder": True, "batch_size": 1, "device": device})
    try:
        fed.wait_feeder()
        assert len(fed) == 7
        it = iter(fed)
        next(it)  # batch 0 taken
        time.sleep(1.5)  # the child has had time to make more than it may
        feeder = fed._feeder
        kinds = []
        while feeder._conn.poll(0.5):
            kinds.append(loads(feeder._conn.recv_bytes())[0])
        assert kinds == ["batch", "batch"]  # batches 1 and 2
        feeder._tally.set(feeder._taken + 1)  # as if batch 1 were taken
        assert feeder._conn.poll(10.0) and loads(feeder._conn.recv_bytes())[0] == "batch"  # batch 3
        assert not feeder._conn.poll(1.0)
    finally:
        fed.close()
    assert fed._feeder._proc.poll() is not None
