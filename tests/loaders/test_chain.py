"""loaders.cache.chain: the head/tail split and fingerprint shared by prep and the training-time loaders."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    RandGaussianNoised,
    ScaleIntensityd,
    Spacingd,
)

from loaders.cache import chain
from loaders.errors import StaleError


def _chain(pixdim: float = 1.0) -> Compose:
    return Compose(
        [
            LoadImaged(keys=["image"]),
            Compose([EnsureChannelFirstd(keys=["image"]), Spacingd(keys=["image"], pixdim=(pixdim,) * 3)]),
            RandFlipd(keys=["image"], prob=0.5),
            ScaleIntensityd(keys=["image"]),  # after the first random transform: tail, although deterministic
        ]
    )


def test_split_at_first_randomizable_flattening_nested_composes() -> None:
    head, tail = chain.split(_chain())
    assert [type(t).__name__ for t in head] == ["LoadImaged", "EnsureChannelFirstd", "Spacingd"]
    assert [type(t).__name__ for t in tail] == ["RandFlipd", "ScaleIntensityd"]
    head2, tail2 = chain.split(list(_chain().transforms))
    assert len(head2) == 3 and len(tail2) == 2
    all_head, no_tail = chain.split([ScaleIntensityd(keys=["image"])])
    assert len(all_head) == 1 and no_tail == []


def test_fingerprint_is_stable_and_sensitive() -> None:
    head = chain.split(_chain())[0]
    assert chain.fingerprint(head) == chain.fingerprint(chain.split(_chain())[0])
    assert chain.fingerprint(head) != chain.fingerprint(chain.split(_chain(1.5))[0])
    assert chain.fingerprint(head) != chain.fingerprint(head[:2])
    assert len(chain.fingerprint(head)) == 64


def test_fingerprint_ignores_random_state() -> None:
    a, b = RandGaussianNoised(keys=["x"], prob=1.0), RandGaussianNoised(keys=["x"], prob=1.0)
    a.set_random_state(1)
    b.set_random_state(2)
    assert chain.fingerprint([a]) == chain.fingerprint([b])


def test_a_process_given_what_another_found_fingerprints_alike_without_reading_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head = chain.split(_chain())[0]
    want = chain.fingerprint(head)
    found = chain.runtime_attrs_found()
    assert "monai.transforms.spatial.dictionary:Spacingd" in found
    monkeypatch.setattr(chain, "_RUNTIME", {})  # a fresh worker process
    monkeypatch.setattr(chain, "_GIVEN", {})

    def no_sources(cls: type) -> frozenset[str]:
        raise AssertionError(f"{cls.__qualname__}: read its source")

    monkeypatch.setattr(chain, "_source_runtime_attrs", no_sources)
    chain.take_runtime_attrs(found)
    assert chain.fingerprint(head) == want
    with pytest.raises(AssertionError, match="RandFlipd: read its source"):  # a class nobody gave: its source
        chain.fingerprint([RandFlipd(keys=["image"])])


@pytest.mark.slow
def test_fingerprint_same_in_another_process() -> None:
    code = (
        "from monai.transforms import LoadImaged, EnsureChannelFirstd, Spacingd\n"
        "from loaders.cache import chain\n"
        "print(chain.fingerprint([LoadImaged(keys=['image']), EnsureChannelFirstd(keys=['image']),"
        " Spacingd(keys=['image'], pixdim=(1.0, 1.0, 1.0))]))\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    head = [
        LoadImaged(keys=["image"]),
        EnsureChannelFirstd(keys=["image"]),
        Spacingd(keys=["image"], pixdim=(1.0,) * 3),
    ]
    assert other == chain.fingerprint(head)


def test_describe() -> None:
    assert chain.describe(chain.split(_chain())[1]) == [
        "RandFlipd(keys=('image',))",
        "ScaleIntensityd(keys=('image',))",
    ]


def test_import_is_light() -> None:
    code = "import sys, loaders.cache.chain; print(sorted(m for m in ('monai', 'torch', 'dask') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_user_code_fingerprint_ignores_module_name(tmp_path: Path) -> None:
    """prep runs PIPELINE.py under a generated module name; training imports it by its own: same fingerprint."""
    import runpy

    code = (
        "from monai.transforms import Compose, MapTransform, LoadImaged\n"
        "class Double(MapTransform):\n"
        "    def __call__(self, d):\n"
        "        return {k: v * 2 for k, v in d.items()}\n"
        "def ident(d):\n"
        "    return d\n"
        "transform = Compose([LoadImaged(keys=['image']), Double(keys=['image']), ident])\n"
    )
    path = tmp_path / "my_pipeline.py"
    path.write_text(code)
    a = runpy.run_path(str(path), run_name="blockprep_pipeline_x")["transform"]
    b = runpy.run_path(str(path), run_name="my_pipeline")["transform"]
    assert chain.fingerprint(chain.split(a)[0]) == chain.fingerprint(chain.split(b)[0])
    edited = tmp_path / "my_pipeline_edited.py"  # a new file: linecache would serve the old text of `path`
    edited.write_text(code.replace("v * 2", "v * 3"))
    c = runpy.run_path(str(edited), run_name="my_pipeline")["transform"]
    assert chain.fingerprint(chain.split(c)[0]) != chain.fingerprint(chain.split(b)[0])


def test_head_ends_at_a_plain_callable_like_persistent_dataset() -> None:
    """A function or lambda may draw random numbers: MONAI's PersistentDataset never caches it, nor do we."""
    from monai.transforms import Lambdad

    jitter = lambda d: d  # noqa: E731
    transforms = [LoadImaged(keys=["image"]), Lambdad(keys=["image"], func=abs), jitter, ScaleIntensityd(keys="image")]
    head, tail = chain.split(transforms)
    assert [type(t).__name__ for t in head] == ["LoadImaged", "Lambdad"]  # Lambdad is a MONAI Transform
    assert tail[0] is jitter and len(tail) == 2
    reason = chain.split_reason(transforms)
    assert "transform 2 (<lambda>)" in reason and "not a MONAI Transform" in reason
    assert "random" in chain.split_reason(_chain()) and "RandFlipd" in chain.split_reason(_chain())
    assert "whole chain" in chain.split_reason([ScaleIntensityd(keys="image")])


def test_one_of_in_a_list_stays_one_random_transform() -> None:
    from monai.transforms import OneOf

    choice = OneOf([ScaleIntensityd(keys="image"), ScaleIntensityd(keys="image", minv=-1.0)])
    head, tail = chain.split([LoadImaged(keys=["image"]), [choice]])
    assert len(head) == 1 and tail == [choice]  # not flattened into both alternatives applied in turn


def test_fingerprint_unchanged_by_use(tmp_path: Path) -> None:
    """MONAI's NibabelReader gains `filenames` once it has read an image: use, not configuration."""
    import nibabel as nib
    import numpy as np
    from monai.data import NibabelReader

    path = tmp_path / "a.nii.gz"
    nib.save(nib.Nifti1Image(np.arange(512, dtype=np.float32).reshape(8, 8, 8), np.eye(4)), path)
    for reader in (None, NibabelReader()):
        head = [
            LoadImaged(keys=["image"], reader=reader),
            EnsureChannelFirstd(keys=["image"]),
            Spacingd(keys=["image"], pixdim=(2.0,) * 3),
        ]
        before = chain.fingerprint(head)
        Compose(head)({"image": str(path)})
        if reader is not None and hasattr(reader, "filenames"):  # MONAI 1.4's reader keeps no file names
            assert reader.filenames  # the state the old fingerprint hashed is there
        assert chain.fingerprint(head) == before
    canonical = [LoadImaged(keys=["image"], reader=NibabelReader(as_closest_canonical=True))]
    assert chain.fingerprint(canonical) != chain.fingerprint([LoadImaged(keys=["image"], reader=NibabelReader())])


def test_user_transform_state_set_by_call_is_not_configuration(tmp_path: Path) -> None:
    import runpy

    path = tmp_path / "p.py"
    path.write_text(
        "from monai.transforms import MapTransform\n"
        "class Scale(MapTransform):\n"
        "    def __init__(self, keys, factor):\n"
        "        super().__init__(keys)\n"
        "        self.factor = factor\n"
        "        self.calls = 0\n"
        "    def __call__(self, d):\n"
        "        self.last_shape = d['x'].shape\n"
        "        self.calls += 1\n"
        "        return {k: v * self.factor for k, v in d.items()}\n"
    )
    scale = runpy.run_path(str(path))["Scale"]
    a, b = scale(keys=["x"], factor=2), scale(keys=["x"], factor=2)
    a({"x": __import__("numpy").ones(3)})
    assert "last_shape" in vars(a) and chain._runtime_attrs(scale) == {"last_shape"}
    # a counter the constructor sets stays configuration: an unclear case refuses, it never hides a change
    assert chain.fingerprint([a]) != chain.fingerprint([b])
    a.calls = 0
    assert chain.fingerprint([a]) == chain.fingerprint([b])
    assert chain.fingerprint([scale(keys=["x"], factor=3)]) != chain.fingerprint([b])


def test_version_rule_cpu_cache_read_on_gpu_node() -> None:
    made = {"monai": "1.6.1", "torch": "2.13.0+cpu", "numpy": "2.3.1", "blockprep": "0.1.0"}
    refuse, warn = chain.compare_versions(made, {**made, "torch": "2.13.0+cu130"})
    assert refuse == [] and warn == ["torch 2.13.0+cpu -> 2.13.0+cu130"]
    refuse, warn = chain.compare_versions(made, {**made, "torch": "2.13.2+cu130", "monai": "1.6.3"})
    assert refuse == [] and len(warn) == 2
    refuse, _ = chain.compare_versions(made, {**made, "monai": "1.7.0"})
    assert refuse == ["monai 1.6.1 -> 1.7.0"]
    refuse, _ = chain.compare_versions(made, {**made, "torch": "2.14.0+cpu", "numpy": "3.0.0"})
    assert refuse == ["numpy 2.3.1 -> 3.0.0", "torch 2.13.0+cpu -> 2.14.0+cpu"]
    assert chain.compare_versions({}, made)[0]  # a cache that recorded no versions is refused


def test_check_versions_refuses_or_warns() -> None:
    here = chain.versions()
    chain.check_versions(here, "cache")  # no warning (warnings are errors in this suite)
    base, _, build = here["torch"].partition("+")
    other = f"{base}+{'cu130' if build != 'cu130' else 'cpu'}"
    with pytest.warns(chain.VersionWarning, match=re.escape(f"torch {other} -> {here['torch']}")):
        chain.check_versions({**here, "torch": other}, "cache")
    major, minor = here["monai"].split(".")[:2]
    with pytest.raises(StaleError, match=r"monai .*re-run `prep cache --force`"):
        chain.check_versions({**here, "monai": f"{major}.{int(minor) + 1}.0"}, "cache")


def test_fingerprint_tells_torch_dtypes_and_devices_apart() -> None:
    """Objects without __dict__ (torch.dtype, torch.device) are configuration too."""
    import torch
    from monai.transforms import CastToTyped, EnsureTyped

    for cls in (EnsureTyped, CastToTyped):
        half, single = cls(keys=["x"], dtype=torch.float16), cls(keys=["x"], dtype=torch.float32)
        assert chain.fingerprint([half]) != chain.fingerprint([single])
        assert chain.fingerprint([half]) == chain.fingerprint([cls(keys=["x"], dtype=torch.float16)])
    on_cpu, on_meta = EnsureTyped(keys=["x"], device="cpu"), EnsureTyped(keys=["x"], device=torch.device("meta"))
    assert chain.fingerprint([on_cpu]) != chain.fingerprint([on_meta])


def test_fingerprint_sees_partial_arguments() -> None:
    import functools

    import numpy as np
    from monai.transforms import Lambdad

    def clipped(top: float) -> Lambdad:
        return Lambdad(keys=["x"], func=functools.partial(np.clip, a_min=0.0, a_max=top))

    assert chain.fingerprint([clipped(1.0)]) != chain.fingerprint([clipped(2.0)])
    assert chain.fingerprint([clipped(1.0)]) == chain.fingerprint([clipped(1.0)])


def test_fingerprint_holds_lazy_resampling_only_where_it_is_on() -> None:
    """Compose(lazy=True) changes the head's output (one fused resample); eager chains keep old fingerprints."""
    head = chain.split(_chain())[0]
    eager = Compose(list(_chain().transforms))
    lazy = Compose(list(_chain().transforms), lazy=True)
    nearest = Compose(list(_chain().transforms), lazy=True, overrides={"image": {"mode": "nearest"}})
    assert chain.fingerprint(head, chain.compose_options(eager)) == chain.fingerprint(head)
    prints = {chain.fingerprint(head, chain.compose_options(c)) for c in (eager, lazy, nearest)}
    assert len(prints) == 3
    manifest = {"fingerprint": chain.fingerprint(head), "versions": chain.versions()}
    with pytest.raises(StaleError, match="different pipeline head"):
        chain.check_fingerprint(lazy, manifest, "cache/manifest.json")
