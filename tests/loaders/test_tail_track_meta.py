"""A tail transform that sets MONAI's process-wide track_meta (MONAI before 1.6: RandSimulateLowResolution) runs
on the training loop's thread: on the loader's thread it would turn the loop's own MONAI calls to plain tensors."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

mt = pytest.importorskip("monai.transforms")

from loaders.cache.chain import track_meta_switch  # noqa: E402
from loaders.errors import ArgumentValueError  # noqa: E402
from loaders.fast.loader import PreparedLoader  # noqa: E402
from workflows.bench.train_loop import pipeline_source  # noqa: E402


class SwitchesTrackMeta(mt.MapTransform):
    """Turns track_meta off while it works and back after, as MONAI 1.4's RandSimulateLowResolution does."""

    def __init__(self, keys: Any) -> None:
        super().__init__(keys)
        self.threads: set[int] = set()

    def __call__(self, data: Any) -> Any:
        from monai.data import get_track_meta, set_track_meta

        self.threads.add(threading.get_ident())
        was = get_track_meta()
        set_track_meta(False)
        try:
            return dict(data)
        finally:
            set_track_meta(was)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(the training benchmark's chain, its cache of four 20^3 volumes)."""
    from prep.cache import prepare_cache
    from prep.pipeline import load_pipeline
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("trackmeta")
    pipeline = root / "pipeline.py"
    pipeline.write_text(pipeline_source(12))
    datalist = nifti_dataset(root / "nifti", count=4, size=20, seed=5)
    prepare_cache(datalist, pipeline, root / "cache", workers=1)
    return load_pipeline(pipeline).transform, root / "cache"


def test_the_switching_tail_runs_on_the_callers_thread(prepared: tuple[Any, Path]) -> None:
    transform, cache = prepared
    switch = SwitchesTrackMeta(["image", "label"])
    chain = mt.Compose([*transform.transforms, switch])
    assert track_meta_switch(chain) == "SwitchesTrackMeta"
    loader = PreparedLoader(cache, chain, batch_size=2, device="cpu", shuffle=False)
    assert loader.tail_thread is False
    batches = [b for _ in range(2) for b in loader]
    assert len(batches) == 4
    assert switch.threads == {threading.get_ident()}


def test_the_same_tail_on_the_loaders_thread_is_refused_in_one_line(prepared: tuple[Any, Path]) -> None:
    transform, cache = prepared
    chain = mt.Compose([*transform.transforms, SwitchesTrackMeta(["image"])])
    with pytest.raises(ArgumentValueError, match=r"tail_thread=True\): SwitchesTrackMeta sets MONAI's") as err:
        PreparedLoader(cache, chain, batch_size=2, device="cpu", tail_thread=True)
    assert "\n" not in str(err.value)


def test_a_tail_that_switches_nothing_keeps_its_thread(prepared: tuple[Any, Path]) -> None:
    transform, cache = prepared
    assert track_meta_switch(transform) is None
    assert PreparedLoader(cache, transform, batch_size=2, device="cpu").tail_thread is True


def test_monais_low_resolution_transform_found_exactly_where_it_sets_track_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found (or not) as the installed MONAI behaves: its calls to set_track_meta counted while it runs."""
    import torch
    from monai.transforms.spatial import array

    calls: list[bool] = []
    if hasattr(array, "set_track_meta"):
        real = array.set_track_meta
        monkeypatch.setattr(array, "set_track_meta", lambda value: (calls.append(value), real(value))[1])
    t = mt.RandSimulateLowResolutiond(keys="image", prob=1.0, zoom_range=(0.5, 0.5))
    t.set_random_state(0)
    t({"image": torch.rand(1, 8, 8, 8)})
    assert (track_meta_switch(mt.Compose([mt.RandFlipd("image"), mt.OneOf([t])])) is not None) == bool(calls)
