"""The seeds' own programs, as they write them, on blockprep at CPU sizes.

000: MONAI's GDS notebook chain (its transforms verbatim, `cuda` replaced by `cpu`) through `prep cache` and
the drop-in under `ThreadDataLoader(batch_size=1)`, against `PersistentDataset`. 001: the HPC slides'
`CacheDataset` example through `prep cache` and the drop-in. 002/004: the research benchmark's command
lines. 003: the cluster guide's MedNIST job through `PreparedLoader`.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from seedlines import SEED_LINES

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

# seed 000's "Setup transforms" cell; `device` was "cuda:0", the output size (200, 210, 220) is scaled down
SEED000 = """
import monai.transforms as mt

device = "cpu"
transform = mt.Compose(
    [
        mt.LoadImageD(keys=("image", "label"), image_only=True, ensure_channel_first=True),
        mt.EnsureTypeD(keys=("image", "label"), device=device),
        mt.SpacingD(keys=("image", "label"), pixdim=1.5),
        mt.RandRotateD(
            keys=("image", "label"), prob=1.0, range_x=0.1, range_y=0.1, range_z=0.3, mode=("bilinear", "nearest"),
        ),
        mt.RandZoomD(keys=("image", "label"), prob=1.0, min_zoom=0.8, max_zoom=1.2, mode=("trilinear", "nearest")),
        mt.ResizeWithPadOrCropD(keys=("image", "label"), spatial_size=(20, 21, 22)),
    ]
)
"""

# seed 001's CacheDataset cell
SEED001 = """
from monai.transforms import Compose, LoadImaged, EnsureChannelFirstd, ScaleIntensityd
fn_keys = ("image", "label")
trans=Compose([
    LoadImaged(keys=fn_keys),
    EnsureChannelFirstd(keys=fn_keys),
    ScaleIntensityd(keys=fn_keys)
])
transform = trans
"""

# seed 003's monai_101.py transform
SEED003 = """
from monai.transforms import LoadImageD, EnsureChannelFirstD, ScaleIntensityD, Compose
transform = Compose(
    [
        LoadImageD(keys="image", image_only=True),
        EnsureChannelFirstD(keys="image"),
        ScaleIntensityD(keys="image"),
    ]
)
"""


def _load(tmp: Path, name: str, text: str) -> tuple[Path, Any]:
    from prep.pipeline import load_pipeline

    path = tmp / name
    path.write_text(text)
    return path, load_pipeline(path).transform


def _same(ref: Any, got: Any, where: str) -> None:
    """Keys, types, dtypes, devices and values alike (MetaTensors compared as tensors, with their affines)."""
    assert set(ref) == set(got), where
    for key in ref:
        r, g = ref[key], got[key]
        assert type(g) is type(r), (where, key, type(r), type(g))
        if isinstance(r, torch.Tensor):
            assert (g.dtype, g.device, g.shape) == (r.dtype, r.device, r.shape), (where, key)
            assert torch.equal(torch.as_tensor(g), torch.as_tensor(r)), (where, key)
            if hasattr(r, "affine"):
                assert torch.equal(g.affine, r.affine), (where, key)
        else:
            assert g == r, (where, key)


@pytest.mark.parametrize("track_meta", [None, True], ids=["default", "track_meta"])
def test_seed000_chain_through_prep_cache_and_the_drop_in(
    nifti_dataset: Path, tmp_path: Path, track_meta: bool | None
) -> None:
    """Under the notebook's own settings (`track_meta` left at its default, False) and with True. With the
    default, MONAI's PersistentDataset gives two things: its filling pass hands the tail the head's MetaTensors
    (its affines go on into the tail's), every later pass the plain tensors it saved (the tail's affines
    start from identity); the values are the same. The drop-in gives the later passes' every epoch."""
    from monai.data import PersistentDataset, ThreadDataLoader
    from monai.utils import set_determinism

    from loaders import PreparedPersistentDataset
    from loaders.faces.monai import dropin_device
    from prep.cache import load_datalist, prepare_cache

    pipeline, transform = _load(tmp_path, "seed000.py", SEED000)
    assert dropin_device(_load(tmp_path, "cuda.py", SEED000.replace('"cpu"', '"cuda:0"'))[1]) == "cuda:0"
    summary = prepare_cache(nifti_dataset, pipeline, tmp_path / "cache", workers=2)
    assert not summary.quarantined
    data = [entry for _, entry in load_datalist(nifti_dataset)]
    has_option = "track_meta" in inspect.signature(PersistentDataset.__init__).parameters
    if track_meta and not has_option:
        pytest.skip("MONAI 1.4's PersistentDataset has no track_meta: it keeps meta, the default case runs that")
    kw = {} if track_meta is None else {"track_meta": track_meta}
    ref = PersistentDataset(data=data, transform=transform, cache_dir=tmp_path / "pt", **kw)
    ours = PreparedPersistentDataset(data=data, transform=transform, cache_dir=tmp_path / "cache", **kw)
    assert ours.dataset.device == "cpu"  # where the head's EnsureTypeD put its tensors
    assert ours.track_meta is (bool(track_meta) if has_option else True)

    def epoch(ds: Any, seed: int) -> list[Any]:
        set_determinism(seed=seed)  # as the notebook does; MONAI's DataLoader then seeds the dataset
        return list(ThreadDataLoader(ds, batch_size=1))

    filling = epoch(ref, 0)
    for seed in range(2):
        want, got = epoch(ref, seed), epoch(ours, seed)  # PersistentDataset now reads the cache it filled
        assert len(got) == len(want) == len(data)
        for i, (w, g) in enumerate(zip(want, got)):
            _same(w, g, f"epoch {seed} item {i}")
            assert g["image"].shape[2:] == (20, 21, 22)
    for w, f in zip(epoch(ref, 0), filling):
        assert torch.equal(torch.as_tensor(w["image"]), torch.as_tensor(f["image"]))
        assert torch.equal(w["image"].affine, f["image"].affine) is ours.track_meta  # MONAI's two passes


def _seed001_files(root: Path, count: int) -> list[dict[str, str]]:
    """Seed 001's dataset cell at 32^3 instead of 128^3 (its own calls, its own names)."""
    import nibabel as nib
    from monai.data import create_test_image_3d

    filenames = []
    for i in range(count):
        im, seg = create_test_image_3d(32, 32, 32, num_objs=6, num_seg_classes=2, rad_max=8)
        im_filename = f"{root}/im{i}.nii.gz"
        seg_filename = f"{root}/seg{i}.nii.gz"
        filenames.append({"image": im_filename, "label": seg_filename})
        nib.save(nib.Nifti1Image(im, np.eye(4)), im_filename)
        nib.save(nib.Nifti1Image(seg, np.eye(4)), seg_filename)
    return filenames


def test_seed001_cache_dataset_example_through_prep_cache_and_the_drop_in(tmp_path: Path) -> None:
    from monai.data import CacheDataset, DataLoader

    from loaders import PreparedPersistentDataset
    from prep.cache import prepare_cache

    filenames = _seed001_files(tmp_path, 4)
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({"training": filenames}))
    pipeline, trans = _load(tmp_path, "seed001.py", SEED001)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=2)
    ds = CacheDataset(filenames, transform=trans, progress=False)
    ours = PreparedPersistentDataset(filenames, trans, cache_dir=tmp_path / "cache", track_meta=True)
    want = list(DataLoader(ds, num_workers=0))
    got = list(DataLoader(ours, num_workers=0))
    assert len(got) == len(want) == 4
    for i, (w, g) in enumerate(zip(want, got)):
        _same({k: w[k] for k in ("image", "label")}, {k: g[k] for k in ("image", "label")}, f"item {i}")


@pytest.mark.parametrize("line", [x for x in SEED_LINES if x.split()[4] in ("dali", "python-file")])
def test_seed004_benchmark_lines_at_small_sizes(line: str, image_tree: Path, tmp_path: Path) -> None:
    """Seed 004's README lines (002's notebook's ways) as written, at 4 x 2 instead of 64 x 1000."""
    pytest.importorskip("nvidia.dali")
    from workflows import benchmark

    args = line.replace("64", "4").replace("1000", "2").replace("/data", str(image_tree.parent)).split()
    assert benchmark.main([*args, "--warm", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    ways = [r for r in rows if r["kind"] != "ceiling"]
    assert len(ways) == 1 and ways[0]["items"] == 8 and ways[0]["nbytes"] > 0


def test_seed003_mednist_job_through_prepared_loader(tmp_path: Path) -> None:
    """The MedNIST job's transform and loader settings (batches, shuffled) on PreparedLoader: every image
    once an epoch, as MONAI's Dataset gives it, and its int label with it."""
    from monai.data import Dataset, load_decathlon_datalist

    from loaders import PreparedLoader
    from prep.cache import prepare_cache
    from prep.synth import mednist_like

    datalist = mednist_like(tmp_path / "MedNIST", 12, size=16)
    pipeline, transform = _load(tmp_path, "monai_101.py", SEED003)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=2)
    data = load_decathlon_datalist(str(datalist), data_list_key="training")
    ref = Dataset(data, transform)
    loader = PreparedLoader(tmp_path / "cache", transform, batch_size=5, device="cpu", shuffle=True)
    seen = []
    for batch in loader:
        assert batch["label"].dtype == torch.int64 and batch["image"].shape[1:] == (1, 16, 16)
        for item, label, image in zip(batch["_items"].tolist(), batch["label"].tolist(), batch["image"]):
            want = ref[item]
            assert label == want["label"] == item % 6
            assert torch.equal(image, torch.as_tensor(want["image"]))
            seen.append(item)
    assert len(seen) == 10 and len(set(seen)) == 10  # drop_last: 2 batches of 5, no item twice
