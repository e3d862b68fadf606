"""PreparedLoader: the same tensors as MONAI's per-item tail for the same draws, whatever the read path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cacheutil import SPHERES

from loaders.errors import StaleError
from loaders.fast.loader import PreparedLoader, dataset_bytes, parse_bytes
from workflows.bench.train_loop import pipeline_source

CROP = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(pipeline, cache): five 24^3 volumes prepared with the training benchmark's pipeline (16^3 crops)."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("feed")
    pipeline = root / "pipeline.py"
    pipeline.write_text(pipeline_source(CROP))
    datalist = nifti_dataset(root / "nifti", count=5, size=24, seed=3)
    prepare_cache(datalist, pipeline, root / "cache", workers=1)
    return pipeline, root / "cache"


def _transform(pipeline: Path) -> object:
    from prep.pipeline import load_pipeline

    return load_pipeline(pipeline).transform


def _reference(pipeline: Path, cache: Path, order: list[int], seed: int) -> list[dict[str, np.ndarray]]:
    """MONAI's per-item tail over the cached heads, in `order`, seeded as the loader seeds it."""
    from loaders import PreparedDataset
    from loaders.cache.chain import tail_compose

    tail = tail_compose(_transform(pipeline))
    tail.set_random_state(seed=seed)
    ds = PreparedDataset(cache)
    out = []
    for i in order:
        item = tail(ds[i])
        out.append(
            {
                k: np.asarray(item[k].as_tensor() if hasattr(item[k], "as_tensor") else item[k])
                for k in ("image", "label")
            }
        )
    return out


@pytest.mark.parametrize("tail_thread", [True, False], ids=["tail-in-read-thread", "tail-in-caller"])
@pytest.mark.parametrize(
    ("crop_read", "budget"),
    [("auto", 0), ("cold", 0), (False, 0), ("auto", "1GiB"), ("auto", 24**3 * 4 * 2 * 2)],
    ids=["crop-reads", "crop-reads-cold", "whole-reads", "all-in-tier", "part-in-tier"],
)
def test_batches_equal_monai_per_item_tail_over_epochs(
    prepared: tuple[Path, Path], crop_read: object, budget: object, tail_thread: bool
) -> None:
    pipeline, cache = prepared
    if crop_read == "cold":  # out of the page cache: regions take the cold path (merged runs, scratch slabs)
        from workflows.bench.core import evict

        evict(sorted(str(p) for p in (cache / "shards").iterdir()), drop_caches=False)
        crop_read = "auto"
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", shuffle=False, drop_last=False,
                            crop_read=crop_read, gpu_budget=budget, tail_thread=tail_thread)  # fmt: skip
    loader.set_random_state(11)
    got = [b for _ in range(3) for b in loader]  # epoch 1 fills the tier, epochs 2-3 read from it
    want = _reference(pipeline, cache, [0, 1, 2, 3, 4] * 3, 11)
    flat_items = [int(i) for b in got for i in b["_items"]]
    assert flat_items == [0, 1, 2, 3, 4] * 3
    k = 0
    for batch in got:
        assert batch["image"].shape[2:] == (CROP,) * 3
        for j in range(len(batch["_items"])):
            for key in ("image", "label"):
                np.testing.assert_allclose(batch[key][j].numpy(), want[k][key], rtol=1e-6)
            k += 1
    assert loader.tier_bytes <= parse_bytes(budget)
    if parse_bytes(budget) == 0:
        assert not loader.tier
    loader.close()


def test_switch_interval_applies_while_iterating_and_is_restored(prepared: tuple[Path, Path]) -> None:
    import sys

    pipeline, cache = prepared
    before = sys.getswitchinterval()
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", switch_interval=before / 4)
    seen = [sys.getswitchinterval() for _ in loader]
    assert seen and all(s == pytest.approx(before / 4) for s in seen)
    assert sys.getswitchinterval() == before
    next(iter(loader))  # left unfinished: restored when the iteration is dropped
    assert sys.getswitchinterval() == before


def test_the_tier_holds_what_fits_and_not_the_whole_dataset(prepared: tuple[Path, Path]) -> None:
    pipeline, cache = prepared
    total = dataset_bytes(cache)
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", gpu_budget=total // 2)
    list(loader)
    assert 0 < loader.tier_bytes <= total // 2 and 0 < len(loader.tier) < 5


def test_shards_cover_every_item_once_per_epoch_and_reshuffle(prepared: tuple[Path, Path]) -> None:
    pipeline, cache = prepared
    ranks = [PreparedLoader(cache, _transform(pipeline), 1, device="cpu", seed=4).shard(r, 2) for r in range(2)]
    splits = []
    for epoch in range(4):
        parts = [sorted(int(i) for i in rank.epoch_items(epoch)) for rank in ranks]
        assert set(parts[0]) | set(parts[1]) == set(range(5))
        assert len(parts[0]) == len(parts[1]) == 3  # padded so both ranks step equally
        splits.append(parts[0])
    assert len({tuple(s) for s in splits}) > 1
    ranks[0].set_epoch(2)
    assert [int(b["_items"][0]) for b in ranks[0]] == list(ranks[0].epoch_items(2))


def test_each_iteration_is_the_next_epoch_unless_pinned(prepared: tuple[Path, Path]) -> None:
    pipeline, cache = prepared
    loader = PreparedLoader(cache, _transform(pipeline), 5, device="cpu", seed=1)
    first, second = (b["_items"].tolist() for b in (next(iter(loader)), next(iter(loader))))
    assert sorted(first) == sorted(second) == list(range(5)) and first != second


def test_a_different_head_is_refused(prepared: tuple[Path, Path]) -> None:
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd

    _, cache = prepared
    other = Compose([LoadImaged(keys="image"), EnsureChannelFirstd(keys="image"), RandFlipd(keys="image")])
    with pytest.raises(StaleError, match="different pipeline head"):
        PreparedLoader(cache, other, 2, device="cpu")


@pytest.mark.parametrize(
    ("text", "value"), [("8GiB", 8 << 30), ("500MB", 500 * 10**6), ("1.5k", 1500), (7, 7), (None, 0)]
)
def test_parse_bytes(text: object, value: int) -> None:
    assert parse_bytes(text) == value  # type: ignore[arg-type]


def test_parse_bytes_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


@pytest.mark.gpu
def test_gpu_batches_equal_cpu_batches(prepared: tuple[Path, Path]) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pipeline, cache = prepared
    out = {}
    for device, budget, thread in (("cpu", 0, True), ("cuda:0", 0, True), ("cuda:0", "1GiB", True),
                                   ("cuda:0", 0, False), ("cuda:0", "1GiB", False)):  # fmt: skip
        loader = PreparedLoader(cache, _transform(pipeline), 2, device=device, shuffle=False, gpu_budget=budget,
                                tail_thread=thread)  # fmt: skip
        loader.set_random_state(5)
        out[(device, budget, thread)] = [{k: b[k].cpu() for k in ("image", "label")} for _ in range(2) for b in loader]
    for key in out:
        for a, b in zip(out[("cpu", 0, True)], out[key]):
            torch.testing.assert_close(a["image"], b["image"])
            torch.testing.assert_close(a["label"], b["label"])


@pytest.mark.gpu
@pytest.mark.parametrize("tail_thread", [True, False], ids=["tail-thread", "tail-in-caller"])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_gpu_batches_equal_cpu_batches_over_epochs_of_few_batches(
    prepared: tuple[Path, Path], batch_size: int, tail_thread: bool
) -> None:
    """Where an epoch has few batches (5, 2, 1 here), the next epoch's first reads begin while this epoch's last
    batches still wait for their uploads: each batch reads into staging slots of its own, so every batch of three
    epochs on the GPU is the CPU loader's."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pipeline, cache = prepared

    def epochs(device: str) -> list[dict[str, object]]:
        loader = PreparedLoader(cache, _transform(pipeline), batch_size, device=device, shuffle=False, gpu_budget=0,
                                tail_thread=tail_thread, feeder=False)  # fmt: skip
        loader.set_random_state(5)
        out = [{k: b[k].cpu() for k in ("image", "label")} for _ in range(3) for b in loader]
        loader.close()
        return out

    want, got = epochs("cpu"), epochs("cuda:0")
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(want, got)):
        for key in ("image", "label"):
            torch.testing.assert_close(b[key], a[key], msg=lambda m, i=i, key=key: f"batch {i} {key}: {m}")


@pytest.fixture(scope="module")
def spheres(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three 40^3 volumes through the demo pipeline (resampled: unequal shapes; 2 pos/neg crops per item)."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("spheres")
    datalist = nifti_dataset(root / "nifti", count=3, size=40, seed=2)
    prepare_cache(datalist, SPHERES, root / "cache", workers=1)
    return root / "cache"


def test_multi_sample_crops_give_monai_list_collate_layout(spheres: Path) -> None:
    from monai.data import list_data_collate

    loader = PreparedLoader(spheres, _transform(SPHERES), batch_size=2, device="cpu", shuffle=False, drop_last=False)
    loader.set_random_state(3)
    got = list(loader)
    want = _reference_lists(spheres, [0, 1, 2], 3)
    collated = [list_data_collate(want[0] + want[1]), list_data_collate(want[2])]
    assert [b["_items"].tolist() for b in got] == [[0, 0, 1, 1], [2, 2]]
    for batch, ref in zip(got, collated):
        for key in ("image", "label"):
            np.testing.assert_allclose(batch[key].numpy(), np.asarray(ref[key].as_tensor()), rtol=1e-6)


def _reference_lists(cache: Path, order: list[int], seed: int) -> list[list[dict[str, object]]]:
    from loaders import PreparedDataset
    from loaders.cache.chain import tail_compose

    tail = tail_compose(_transform(SPHERES))
    tail.set_random_state(seed=seed)
    ds = PreparedDataset(cache)
    return [list(tail(ds[i])) for i in order]


def test_warm_crop_reads_of_a_batch_are_packed_by_key(prepared: tuple[Path, Path]) -> None:
    """The crops of a batch land key-major and back to back: each key's batch is one view (no stack)."""
    import torch

    from loaders.reading.staging import landed

    pipeline, cache = prepared
    for shard in (cache / "shards").iterdir():
        shard.read_bytes()  # warm (another test evicts them): warm crops are copied straight into the buffer
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=3, device="cpu")
    plan = loader.assembly.fetch(loader.assembly.plan([4, 0, 2]))
    got = plan.reads["regions"]
    buf, nbytes, places = got.buf, got.nbytes, got.places
    assert [p[:2] for p in places] == [(("row", r), k) for k in ("image", "label") for r in range(3)]
    flat = torch.from_numpy(np.asarray(buf[:nbytes]))
    packed, _ = landed(flat, places, ["image", "label"], 3)
    assert packed is not None and packed["image"].shape == (3, 1, CROP, CROP, CROP)
    for j, (_, _, at, dtype, shape) in enumerate(places[:3]):
        one = np.asarray(buf[at : at + int(np.prod(shape)) * np.dtype(dtype).itemsize]).view(dtype).reshape(shape)
        np.testing.assert_array_equal(packed["image"][j].numpy(), one)
    rows, by_tag = landed(flat, places[::-1], ["image", "label"], 3)
    assert rows is None and sorted(by_tag) == [("row", r) for r in range(3)]  # not in batch order: per item
    loader.close()


@pytest.mark.parametrize("tail_thread", [True, False])
def test_the_loader_threads_are_kept_from_epoch_to_epoch(prepared: tuple[Path, Path], tail_thread: bool) -> None:
    """One read thread (and one tail thread) for every epoch, not one started and joined an epoch; close stops
    them."""
    import threading

    pipeline, cache = prepared
    others = {t.ident for t in threading.enumerate()}  # another test's loader not yet collected keeps its own
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", gpu_budget=0,
                            tail_thread=tail_thread)  # fmt: skip

    def ours() -> dict[str, int]:
        threads = [t for t in threading.enumerate() if t.ident not in others]
        return {
            n: t.ident or 0 for t in threads if (n := t.name.rsplit("_", 1)[0]) in ("blockprep-read", "blockprep-feed")
        }

    seen = []
    for _ in range(3):
        for _ in loader:
            pass
        seen.append(ours())
    names = {"blockprep-read", "blockprep-feed"} if tail_thread else {"blockprep-read"}
    assert set(seen[0]) == names and seen[0] == seen[1] == seen[2]
    loader.close()
    for t in threading.enumerate():
        if t.ident in seen[0].values():
            t.join(10)
    assert not ours()
