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


def main() -> int:
    try:
        import torch
    except ImportError:
        print("keep_torch: this Python has no torch to keep; install it first (or use `make install`)", file=sys.stderr)
        return 1
    print("\n".join(constraints(torch.__version__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
