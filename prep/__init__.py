"""blockprep offline stages: synthetic data, block maps, prepared caches. The `prep` command lives in cli.py."""

from __future__ import annotations

from prep.errors import PrepError

__all__ = ["PrepError"]
