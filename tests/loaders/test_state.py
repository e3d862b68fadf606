"""PreparedLoader.state_dict / load_state_dict: a run stopped after batch k of epoch e and resumed in a new
loader (a new process would build one) gives, from batch k+1 on, exactly the batches of a run that never
stopped: label-driven crops, the tier, whole and crop reads, the tail on either thread, a DDP shard."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_folds import CHAINS, _transform, _volumes

from loaders.errors import LoaderStateError, PrepError
from loaders.fast.loader import PreparedLoader

EPOCHS = 3
CONFIGS = {
    "crops-read-thread": {"gpu_budget": 0, "tail_thread": True, "prefetch": 3},
    "tier-tail-on-caller": {"gpu_budget": "1GiB", "tail_thread": False, "prefetch": 2},
    "whole-reads-shard": {"gpu_budget": 0, "crop_read": False, "shard": (1, 2), "batch_size": 1},
    "gpu-tier-read-thread": {
        "gpu_budget": "1GiB",
        "tail_thread": True,
        "prefetch": 3,
        "device": "cuda:0",
        "feeder": False,
    },  # fmt: skip
    "gpu-crops-tail-on-caller": {
        "gpu_budget": 0,
        "tail_thread": False,
        "prefetch": 2,
        "device": "cuda:0",
        "feeder": False,
    },  # fmt: skip
    "feeder-crops-shard": {"gpu_budget": 0, "prefetch": 2, "shard": (0, 2), "batch_size": 1, "feeder": True},
    "gpu-feeder-tier": {"gpu_budget": "1GiB", "prefetch": 2, "device": "cuda:0", "feeder": True},
}


def _config(name: str) -> Any:
    on_gpu = CONFIGS[name].get("device", "cpu") != "cpu"
    return pytest.param(name, id=name, marks=[pytest.mark.gpu] if on_gpu else [])


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_cache(tmp_path_factory)


def make_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A cache of seven small volumes made with the posneg-3d chain, and its pipeline file."""
    from prep.cache import prepare_cache

    root = tmp_path_factory.mktemp("state")
    datalist = _volumes(root / "data", 3, "uint8", n=7)
    pipeline = root / "pipeline.py"
    pipeline.write_text(CHAINS["posneg-3d"][2])
    prepare_cache(datalist, pipeline, root / "cache", workers=1)
    return root / "cache", pipeline


def _loader(made: tuple[Path, Path], options: dict[str, Any], source: str | None = None) -> PreparedLoader:
    cache, pipeline = made
    if source is not None:
        pipeline = pipeline.with_name("other.py")
        pipeline.write_text(source)
    options = dict(options)
    shard = options.pop("shard", None)
    batch_size = options.pop("batch_size", 2)
    device = options.pop("device", "cpu")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=batch_size, device=device, **options)
    if shard is not None:
        loader.shard(*shard)
    return loader.set_random_state(5)  # the script seeds at start, a resumed run too


def _plain(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.cpu()).copy() for k, v in batch.items() if k in ("image", "label", "_items")}


def _same(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]], where: str) -> None:
    assert len(got) == len(want), where
    for j, (g, w) in enumerate(zip(got, want)):
        for key in w:
            assert np.array_equal(g[key], w[key]), f"{where}: batch {j} {key}"


@pytest.mark.parametrize("config", [_config(name) for name in CONFIGS])
@pytest.mark.parametrize(("epoch", "k"), [(0, 1), (1, 2), (2, 1)])
def test_resumed_run_gives_the_batches_of_one_never_stopped(
    made: tuple[Path, Path], config: str, epoch: int, k: int
) -> None:
    options = CONFIGS[config]
    loader = _loader(made, options)
    whole = [[_plain(b) for b in loader] for _ in range(EPOCHS)]
    assert all(len(e) > k for e in whole), "the test wants more batches an epoch"

    stopped = _loader(made, options)
    saved = None
    for e in range(epoch + 1):
        for j, _batch in enumerate(stopped):
            if e == epoch and j == k - 1:  # batch k delivered: save there (the read-ahead has drawn more)
                saved = json.loads(json.dumps(stopped.state_dict()))
                break
    assert saved is not None and (saved["epoch"], saved["batch"]) == (epoch, k)
    assert len(json.dumps(saved)) < 64 * 1024  # small: no tensors

    resumed = _loader(made, options)
    resumed.load_state_dict(saved)
    got = [_plain(b) for b in resumed]
    _same(got, whole[epoch][k:], f"{config}: epoch {epoch} after batch {k}")
    for e in range(epoch + 1, EPOCHS):
        resumed.set_epoch(e)  # as a DDP script calls it: the order and draws go on
        _same([_plain(b) for b in resumed], whole[e], f"{config}: epoch {e}")


def test_state_after_a_whole_epoch_points_at_the_next(made: tuple[Path, Path]) -> None:
    loader = _loader(made, CONFIGS["crops-read-thread"])
    first = [_plain(b) for b in loader]
    saved = loader.state_dict()
    assert (saved["epoch"], saved["batch"]) == (1, 0)
    after = [_plain(b) for b in loader]
    resumed = _loader(made, CONFIGS["crops-read-thread"])
    resumed.load_state_dict(saved)
    _same([_plain(b) for b in resumed], after, "epoch 1")
    assert not all(np.array_equal(a["image"], b["image"]) for a, b in zip(first, after))  # negative control


@pytest.mark.parametrize("feeder", [False, True], ids=["in-process", "feeder"])
def test_state_after_break_is_the_state_inside_the_loop(made: tuple[Path, Path], feeder: bool) -> None:
    """The usual checkpoint: a flag set, the loop left with `break`, the state saved after it (the loop's
    iterator is closed by then); resumed, the run gives the rest of that epoch, then the next."""
    options = {"gpu_budget": 0, "feeder": feeder}
    whole = _loader(made, options)
    want = [_plain(b) for b in whole] + [_plain(b) for b in whole]
    whole.close()
    run = _loader(made, options)
    got = []
    for k, batch in enumerate(run):
        got.append(_plain(batch))
        if k == 1:
            inside = run.state_dict()
            break
    after = run.state_dict()
    run.close()
    assert after == inside and (after["epoch"], after["batch"]) == (0, 2)
    resumed = _loader(made, options)
    resumed.load_state_dict(after)
    got += [_plain(b) for b in resumed] + [_plain(b) for b in resumed]
    resumed.close()
    _same(got, want[: len(got)], "resumed after break")
    assert len(got) == len(want)


_ZERO_KEY = base64.b64encode(bytes(624 * 4)).decode()  # a twister that draws zeros forever (numpy takes it)


def test_a_state_from_elsewhere_is_refused_in_one_line(made: tuple[Path, Path]) -> None:
    options = CONFIGS["crops-read-thread"]
    loader = _loader(made, options)
    next(iter(loader))
    saved = loader.state_dict()
    other_world = _loader(made, {**options, "shard": (0, 2)})
    extra = CHAINS["posneg-3d"][2].replace("RandScaleIntensityd(", "RandFlipd(keys=K, prob=0.5), RandScaleIntensityd(")
    cases: list[tuple[Any, Any, str]] = [
        (other_world, saved, "world=1.*same world size"),
        (_loader(made, options, source=extra), saved, "another cache or transform"),
        (_loader(made, {**options, "seed": 3}), saved, "seed=0"),
        (_loader(made, options), {**saved, "random": saved["random"][:-1]}, "number of random transforms"),
        (_loader(made, options), {**saved, "random": [[*r[:1], "@@", *r[2:]] for r in saved["random"]]}, "damaged"),
        (_loader(made, options), {**saved, "batch": -1}, "non-negative"),
        (_loader(made, options), {**saved, "epoch": 2**70}, "below 2\\^62"),
        (
            _loader(made, options),
            {**saved, "random": [[r[0], _ZERO_KEY, *r[2:]] for r in saved["random"]]},
            "all zeros",
        ),
        (
            _loader(made, options),
            {**saved, "random": [[*r[:4], float("nan")] for r in saved["random"]]},
            "out of range",
        ),
        (
            _loader(made, options),
            {**saved, "random": [[*r[:2], 9999, *r[3:]] for r in saved["random"]]},
            "out of range",
        ),
        (_loader(made, options), {"epoch": 1}, "not a blockprep loader state"),
    ]
    for target, state, match in cases:
        with pytest.raises(LoaderStateError, match=match) as info:
            target.load_state_dict(state)
        assert isinstance(info.value, PrepError) and "\n" not in str(info.value)
    it = iter(loader)
    next(it)
    with pytest.raises(LoaderStateError, match="being iterated"):
        loader.load_state_dict(saved)
