"""PreparedLoader's defaults follow the machine, and bad sizes and devices are one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaders.fast.loader import parse_bytes

torch = pytest.importorskip("torch")
pytest.importorskip("monai")


@pytest.mark.parametrize("bad", [-1, "-1", "1.2.3", True, 2.5, "lots"])
def test_sizes_are_refused_alike(bad: object) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(bad)  # type: ignore[arg-type]
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(0) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the defaults of a box without a GPU")
def test_defaults_on_a_cpu_box(tmp_path: Path) -> None:
    from loaders import PreparedLoader
    from prep.cache import prepare_cache
    from prep.pipeline import load_pipeline
    from prep.synth import mednist_like

    pipeline = Path(__file__).parents[2] / "workflows" / "pipelines" / "mednist.py"
    prepare_cache(mednist_like(tmp_path / "d", 4, size=16), pipeline, tmp_path / "c", workers=1)
    transform = load_pipeline(pipeline).transform
    loader = PreparedLoader(tmp_path / "c", transform, batch_size=2)
    assert loader.device.type == "cpu" and loader.budget == 0
    assert len(list(loader)) == 2
    with pytest.raises(ValueError, match="no CUDA GPU; pass device='cpu'"):
        PreparedLoader(tmp_path / "c", transform, batch_size=2, device="cuda:0")
