"""Running a function in a forked child, as torch's DataLoader starts its workers on Linux."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest


def forked_exit(target: Callable[..., Any], args: tuple[Any, ...], what: str, seconds: float = 60) -> int | None:
    """`target(*args)` in a forked child: its exit code; the test fails (the child killed) when it is still
    running after `seconds`, saying it hung on `what`."""
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"the forked child hung on {what}")
    return child.exitcode
