"""Moved to `prep.mapping` (walk, seed, verify); this name stays so existing imports keep working."""

from __future__ import annotations

from prep.mapping import *  # noqa: F403
from prep.mapping import __all__ as __all__
