"""Uniform numbers described by the generator's state and made where they are used (loaders.tail.uniforms): read on
the host they are numpy's draw; `Rand3DElasticd`'s offsets described in MONAI's own `randomize` leave MONAI's
magnitude, sigma and state; the elastic tail and its replay with described offsets give MONAI's batches; on a GPU
the kernel's numbers are numpy's, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("monai.transforms")

from tailutil import assert_same, make_batch, reference_batches  # noqa: E402

from loaders.tail import BatchedTail, uniforms  # noqa: E402
from loaders.tail.uniforms import Deferring, Uniforms  # noqa: E402


@pytest.fixture
def told() -> Iterator[None]:
    """This process describes its draws, as a host feeder's child told so does."""
    uniforms.tell(True)
    try:
        yield
    finally:
        uniforms.tell(None)


def _state(seed: int, pos: int) -> tuple[np.ndarray, int]:
    r = np.random.RandomState(seed)
    return np.array(r.get_state()[1], np.uint32), pos


@pytest.mark.parametrize("pos", [0, 1, 311, 623, 624])
@pytest.mark.parametrize("count", [1, 2, 313, 5000])
def test_a_description_reads_as_numpys_draw(pos: int, count: int) -> None:
    key, _ = _state(pos * 7 + count, pos)
    u = Uniforms(key, pos, -1.0, 1.0, (count,)).astype(np.float32, copy=False)
    r = np.random.RandomState()
    r.set_state(("MT19937", key, pos))
    want = r.uniform(-1.0, 1.0, count).astype(np.float32)
    got = np.asarray(u)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(np.asarray(u.reshape(1, count)), want.reshape(1, count))


def _elastic_inner(seed: int) -> Any:
    t = mt.Rand3DElastic(sigma_range=(2, 3), magnitude_range=(2, 5), prob=1.0)
    t.set_random_state(seed)
    return t


@pytest.mark.parametrize("seed", [0, 5, 9])
def test_monais_randomize_describes_its_offsets_and_draws_the_rest_as_it_would(seed: int) -> None:
    shape = (6, 5, 4)
    theirs = _elastic_inner(seed)
    start = theirs.R.get_state()
    theirs.randomize(shape)
    end = theirs.R.get_state()
    mine = copy.deepcopy(_elastic_inner(seed))
    if not Deferring.usable(end, 4):
        pytest.skip("this seed's draws end in a block's first words")
    mine.R = Deferring(start, end, 3 * 6 * 5 * 4, 4)
    mine.randomize(shape)
    assert isinstance(mine.rand_offset, Uniforms) and mine.rand_offset.dtype == np.float32
    assert np.array_equal(np.asarray(mine.rand_offset), theirs.rand_offset)
    assert (mine.magnitude, mine.sigma) == (theirs.magnitude, theirs.sigma)
    got = mine.R.get_state()
    assert got[2] == end[2] and np.array_equal(got[1], end[1])


def test_draws_that_end_in_a_blocks_first_words_are_not_described() -> None:
    assert not Deferring.usable(("MT19937", np.zeros(624, np.uint32), 3, 0, 0.0), 4)
    assert Deferring.usable(("MT19937", np.zeros(624, np.uint32), 4, 0, 0.0), 4)


def _chain() -> list[Any]:
    return [
        mt.Rand3DElasticd(["image", "label"], sigma_range=(2, 3), magnitude_range=(2, 5), prob=0.6,
                          mode=("bilinear", "nearest"), padding_mode="border"),
        mt.RandFlipd(["image", "label"], spatial_axis=0, prob=0.5),
    ]  # fmt: skip


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    real = Deferring.uniform

    def uniform(self: Deferring, *a: Any, **k: Any) -> Any:
        out = real(self, *a, **k)
        if isinstance(out, Uniforms):
            made.append(out.count)
        return out

    monkeypatch.setattr(Deferring, "uniform", uniform)
    return made


def _batches(device: str, n: int = 4) -> list[dict[str, Any]]:
    return [{k: v.to(device) for k, v in make_batch(n=3, spatial=(12, 10, 8), seed=s).items()} for s in range(n)]


def _tail_equals_monai(device: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from monai.transforms import Compose

    made = _counted(monkeypatch)
    batches = _batches(device)
    want = reference_batches(Compose(_chain()).set_random_state(6), [dict(b) for b in batches])
    tail = BatchedTail(Compose(_chain())).set_random_state(6)
    for b, w in zip(batches, want):
        assert_same(tail(b), w, keys=("image", "label"))
    assert tail.fallbacks == []
    return made


def test_the_elastic_tail_with_described_offsets_equals_monai(told: None, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _tail_equals_monai("cpu", monkeypatch)
    assert made and set(made) == {3 * 12 * 10 * 8}


def test_the_elastic_replay_with_described_offsets_equals_monai(told: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_tail_replay import _compare_elastic

    made = _counted(monkeypatch)
    _compare_elastic("cpu", 3)
    assert made


def test_a_failed_check_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose check fails (no cupy here; on a GPU box, no such device) is not used, and says why."""
    monkeypatch.setattr(uniforms, "_READY", {})
    monkeypatch.setattr(uniforms, "_WHY", {})
    uniforms._check(97)
    assert uniforms._READY == {97: False}
    assert uniforms.why_not("cuda:97") and uniforms.why_not("cuda:97") != "not checked"
    assert uniforms.why_not("cuda:96") == "not checked"


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    pytest.importorskip("cupy")
    assert uniforms.wait_ready("cuda:0"), f"the kernel is not used on this GPU: {uniforms.why_not('cuda:0')}"


@pytest.mark.gpu
def test_the_kernel_makes_numpys_numbers() -> None:
    """Many states at once, from every kind of position, counts up to a 96^3 elastic item's: bit for bit."""
    _gpu()
    r = np.random.RandomState(3)
    values = []
    for i, (pos, count) in enumerate([(0, 1), (623, 2), (624, 3 * 96**3), (5, 3 * 96**3), (311, 100_003)]):
        key, _ = _state(i, pos)
        values.append(Uniforms(key, pos, float(-1 - i), float(r.uniform(0, 3)), (count,)).astype(np.float32))
    got = uniforms.made(values, "cuda:0")
    torch.cuda.synchronize()
    for g, u in zip(got, values):
        assert np.array_equal(g.cpu().numpy(), np.asarray(u))


@pytest.mark.gpu
def test_the_elastic_tail_makes_its_offsets_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the training process, once the kernel is checked: described offsets made on the GPU, MONAI's batches."""
    _gpu()
    monkeypatch.setattr(uniforms, "_DEVICE", torch.device("cuda:0"))
    made = _tail_equals_monai("cuda:0", monkeypatch)
    assert made


@pytest.mark.gpu
def test_the_replay_makes_described_offsets_on_the_gpu(told: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a host feeder's child describes them and the training process replays them as graphs: MONAI's batches."""
    _gpu()
    from test_tail_replay import _compare_elastic

    made = _counted(monkeypatch)
    replayed = _compare_elastic("cuda:0", 6)
    assert made and replayed.captures >= 2
