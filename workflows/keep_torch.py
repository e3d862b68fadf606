"""Print pip constraints that keep this Python's torch as it is (HPC containers, CUDA/ROCm site builds).

    python workflows/keep_torch.py > keep-torch.txt && pip install -c keep-torch.txt -e .

torch is pinned to the installed version (local and pre-release builds such as `2.3.0a0+gitd2f9472`
included), so pip may add packages but never replace it; MONAI is pinned to the newest release line whose
wheel metadata admits that torch, so pip does not backtrack through MONAI releases that would need a newer
one. Runs with the standard library and pip only: it is used before blockprep is installed.
"""

from __future__ import annotations

import sys

# (torch below this, MONAI line), newest first, from the `Requires-Dist: torch` of MONAI's wheels:
# 1.6.x needs torch>=2.8.0; 1.5.1 and 1.5.2 torch>=2.4.1 (1.5.0 also <2.7); 1.4.0 torch>=1.9.
MONAI_FOR_TORCH = (("2.4.1", "monai>=1.4,<1.5"), ("2.8.0", "monai>=1.5.1,<1.6"))


def _version(text: str) -> object:
    try:
        from packaging.version import Version
    except ImportError:  # pip always carries its own copy
        from pip._vendor.packaging.version import Version  # type: ignore[no-redef,assignment]
    return Version(text)


def monai_for(torch_version: str) -> str | None:
    """The MONAI requirement for `torch_version`, or None when any MONAI blockprep accepts fits."""
    installed = _version(torch_version)
    for below, monai in MONAI_FOR_TORCH:
        if installed < _version(below):  # type: ignore[operator]
            return monai
    return None


def constraints(torch_version: str) -> list[str]:
    """Constraint lines: torch exactly as installed, MONAI to a line that supports it."""
    lines = [f"torch=={torch_version}"]
    monai = monai_for(torch_version)
    if monai:
        lines.append(monai)
    return lines


def installed_torch() -> str:
    """torch's version as pip sees it, from its package metadata (PyPI's 2.3.1 says `2.3.1` where
    torch.__version__ says `2.3.1+cu121`); exits with the reason when pip cannot see one."""
    import importlib.metadata as md

    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        pass
    try:
        import torch
    except ImportError:
        msg = "keep_torch: this Python has no torch to keep; install it first (or use `make install`)"
        raise SystemExit(msg) from None
    raise SystemExit(
        f"keep_torch: torch {torch.__version__} imports from {torch.__file__} but has no package metadata pip can "
        "see, so pip would install a second torch; install blockprep with `pip install --no-deps` there instead"
    )


def main() -> int:
    print("\n".join(constraints(installed_torch())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
