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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the defaults of a box without a GPU")
def test_torch_threads_set_the_training_threads_and_keep_the_read_thread_to_one(tmp_path: Path) -> None:
    """torch_threads=N on the CPU: the training thread's torch threads while an epoch is iterated (its own
    count back after), the read thread's transforms on one; None (the default) leaves both alone."""
    import os

    from loaders import PreparedLoader
    from loaders.errors import ArgumentTypeError
    from prep.cache import prepare_cache
    from prep.pipeline import load_pipeline
    from prep.synth import mednist_like

    pipeline = Path(__file__).parents[2] / "workflows" / "pipelines" / "mednist.py"
    prepare_cache(mednist_like(tmp_path / "d", 6, size=16), pipeline, tmp_path / "c", workers=1)
    transform = load_pipeline(pipeline).transform
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    for given, training, reader in (
        (None, before, None),
        (max(1, cores - 1), max(1, cores - 1), 1),
    ):
        loader = PreparedLoader(tmp_path / "c", transform, batch_size=2, torch_threads=given)
        seen: list[int] = []

        def finish(plan: object, seen: list[int] = seen, run: object = loader.assembly.finish) -> object:
            seen.append(torch.get_num_threads())
            return run(plan)  # type: ignore[operator]

        loader.assembly.finish = finish  # type: ignore[method-assign]
        during = [torch.get_num_threads() for _ in loader]
        assert during == [training] * 3 and torch.get_num_threads() == before
        assert seen and (reader is None or set(seen) == {reader})  # the read thread's own count
        loader.close()
    with pytest.raises(ArgumentTypeError, match="torch_threads"):
        PreparedLoader(tmp_path / "c", transform, batch_size=2, torch_threads="many")
