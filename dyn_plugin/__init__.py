"""dyn-plugin: per-step planning for variable-length training inside DeepSpeed."""
from __future__ import annotations

__version__ = "0.1.0"


def native_available() -> bool:
    """Whether the C++ hot paths (csrc/) are built and in use."""
    from .cost.native import core

    return core is not None
