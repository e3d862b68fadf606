"""Non-tensor head outputs (class labels) come through PreparedLoader batched as MONAI batches them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

MEDNIST = Path(__file__).parents[2] / "workflows" / "pipelines" / "mednist.py"


@pytest.fixture(scope="module")
def mednist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prep.cache import prepare_cache
    from prep.synth import mednist_like

    root = tmp_path_factory.mktemp("mednist")
    prepare_cache(mednist_like(root / "data", 10, size=16), MEDNIST, root / "cache", workers=1)
    return root / "cache"


def test_int_labels_batched_as_monai_collates_them(mednist: Path) -> None:
    from monai.data.utils import list_data_collate

    from loaders import PreparedDataset, PreparedLoader
    from loaders.cache.chain import tail_compose
    from prep.pipeline import load_pipeline

    transform = load_pipeline(MEDNIST).transform
    loader = PreparedLoader(mednist, transform, batch_size=4, device="cpu", shuffle=False, drop_last=False)
    loader.set_random_state(5)
    got = list(loader)
    tail = tail_compose(load_pipeline(MEDNIST).transform)
    tail.set_random_state(seed=5)
    ds = PreparedDataset(mednist)
    want = [list_data_collate([tail(ds[i]) for i in range(s, min(s + 4, 10))]) for s in range(0, 10, 4)]
    assert [len(b["_items"]) for b in got] == [4, 4, 2]
    for g, w in zip(got, want):
        assert g["label"].dtype == w["label"].dtype == torch.int64
        assert g["label"].tolist() == w["label"].tolist() == [i % 6 for i in g["_items"].tolist()]
        np.testing.assert_allclose(g["image"].numpy(), w["image"].numpy(), rtol=1e-6, atol=1e-6)


def test_a_tail_reading_a_value_key_sees_it_as_monai_does(mednist: Path) -> None:
    """A tail transform naming a value key gets each item's value, as MONAI's per-item chain gives it."""
    from monai.data.utils import list_data_collate
    from monai.transforms import Compose, RandLambdad

    from loaders import PreparedDataset, PreparedLoader
    from prep.pipeline import load_pipeline

    head = load_pipeline(MEDNIST).transform.transforms[:3]
    transform = Compose([*head, RandLambdad(keys="label", func=lambda x: x + 1)])
    loader = PreparedLoader(mednist, transform, batch_size=4, device="cpu", shuffle=False, drop_last=False)
    ds = PreparedDataset(mednist)
    for s, got in zip(range(0, 10, 4), loader):
        want = list_data_collate([{"label": ds[i]["label"] + 1} for i in range(s, min(s + 4, 10))])
        assert got["label"].tolist() == want["label"].tolist() and got["label"].dtype == want["label"].dtype


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [0, "1GiB"])
def test_int_labels_come_on_the_gpu_with_the_images(mednist: Path, budget: Any) -> None:
    """On a GPU the collated labels are on the loader's device too (a training loop's .to(device) of a host
    tensor would wait for every queued step); same values as on the CPU; `_items` stays on the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from loaders import PreparedLoader
    from prep.pipeline import load_pipeline

    transform = load_pipeline(MEDNIST).transform
    got = {}
    for device in ("cpu", "cuda:0"):
        loader = PreparedLoader(mednist, transform, batch_size=4, device=device, shuffle=False, drop_last=False,
                                gpu_budget=budget if device != "cpu" else 0)  # fmt: skip
        got[device] = [(b["label"], b["_items"]) for _ in range(2) for b in loader]
    for (cpu_label, cpu_items), (gpu_label, gpu_items) in zip(got["cpu"], got["cuda:0"]):
        assert gpu_label.device.type == "cuda" and gpu_items.device.type == "cpu"
        assert gpu_label.dtype == cpu_label.dtype and gpu_label.cpu().tolist() == cpu_label.tolist()
        assert gpu_items.tolist() == cpu_items.tolist()
