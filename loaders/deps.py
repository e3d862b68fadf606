"""Availability of optional packages, checked once and cached (no heavy import at `import loaders`)."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType

from loaders.errors import MissingDependencyError

# package -> the extra (or command) that provides it, for error messages
_EXTRAS = {
    "torch": "pip install torch",
    "kvikio": "pip install 'blockprep[gpu]'",
    "cupy": "pip install cupy-cuda12x",
    "nvidia.dali": "pip install 'blockprep[dali]'",
    "xnvme": "pip install 'blockprep[xnvme]' and libxnvme from your distro, conda-forge or source",
    "monai": "pip install monai",
}


@cache
def has(name: str) -> bool:
    """True when `name` can be imported (cached; imports it once to be sure it loads)."""
    try:
        return importlib.util.find_spec(name) is not None and require(name) is not None
    except (ImportError, ValueError, MissingDependencyError, OSError):
        return False


def require(name: str, purpose: str = "") -> ModuleType:
    """Import `name` or raise MissingDependencyError with the install command."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        hint = _EXTRAS.get(name, f"pip install {name}")
        what = f" for {purpose}" if purpose else ""
        raise MissingDependencyError(f"{name} is needed{what} but cannot be imported ({exc}); {hint}") from exc
    if module is None:  # sys.modules[name] = None blocks an import
        raise MissingDependencyError(f"{name} is needed but blocked; {_EXTRAS.get(name, 'pip install ' + name)}")
    return module


@cache
def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA (or ROCm) device."""
    if not has("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())
