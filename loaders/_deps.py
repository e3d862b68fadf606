"""Old private name of `loaders.deps` (kept so existing imports work); import `loaders.deps` instead."""

from loaders.deps import _EXTRAS, cuda_available, has, require

__all__ = ["_EXTRAS", "cuda_available", "has", "require"]
