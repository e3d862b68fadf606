"""Stop at a step boundary on a signal, save a checkpoint atomically, resume from it: for jobs that outlive a
SLURM time limit (`workflows/slurm/train.sbatch`: `#SBATCH --signal=B:USR1@120`, `--requeue`).

The batch script forwards SIGUSR1 to the training process; `StopRequest` turns it into a flag that the loop
reads after each step, so the checkpoint always holds a whole step: the model, the optimiser, the step, the
losses so far, torch's random state and the loader's state (`PreparedLoader.state_dict()`: epoch, place in
it and every random draw as of the last batch delivered). The trainer then exits with REQUEUE_EXIT, and the
script requeues the job; the next run loads the checkpoint and goes on with the batch after the last one
trained on.
"""

from __future__ import annotations

import io
import signal
import threading
from pathlib import Path
from typing import Any

REQUEUE_EXIT = 3  # the trainer saved a checkpoint on request and stopped before its last step: requeue it
FORMAT = "blockprep-train-checkpoint"
VERSION = 1


class StopRequest:
    """A flag that `signum` (SIGUSR1 by default) sets; installed at once, so a signal that arrives while the
    trainer is still importing does not kill it (the default action of SIGUSR1)."""

    def __init__(self, signum: int = signal.SIGUSR1) -> None:
        self.signum = signum
        self._event = threading.Event()
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        """True once the signal has arrived."""
        return self._event.is_set()

    def close(self) -> None:
        """Put the previous handler back."""
        signal.signal(self.signum, self._previous)


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write a checkpoint atomically: a temporary file in the same folder, fsync, rename over `path`, fsync the
    folder. A job killed meanwhile leaves the previous checkpoint whole (and at most a stray temporary file)."""
    import torch

    from loaders.cache.writing import atomic_write_bytes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **payload}, data)
    atomic_write_bytes(path, data.getvalue())


def load(path: Path, expect: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written by `save` (tensors and plain data only: nothing in it is executed), checked against
    the settings that must not change across a resume (`expect`); ValueError in one line otherwise."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("version") != VERSION:
        raise ValueError(f"{path}: not a checkpoint of this trainer (format {FORMAT} version {VERSION})")
    differ = [f"{k} {saved.get('settings', {}).get(k)!r} -> {v!r}" for k, v in expect.items()
              if saved.get("settings", {}).get(k) != v]  # fmt: skip
    if differ:
        raise ValueError(f"{path}: saved by a run with other settings ({'; '.join(differ)}); remove it to start over")
    return saved
