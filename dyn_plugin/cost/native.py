"""The optional C++ extension (csrc/), or None where it was not built."""

from __future__ import annotations

import functools
import hashlib
import logging
import os

from ..version import __version__

logger = logging.getLogger(__name__)

core = None
if os.environ.get("DYN_PLUGIN_FORCE_PYTHON") != "1":
    try:
        from dyn_plugin import _core as core  # type: ignore[no-redef]  # noqa: F401 (used by the twins)
    except ImportError as exc:  # not built: the pure-Python twins serve every call
        logger.info("dyn_plugin C++ extension not available (%s); using pure Python", exc)


@functools.cache
def build() -> str:
    """This process's planning code in words: the plugin's version, and the C++ extension it runs (its
    file's digest) or that it runs without one. Ranks compare it before they share plans: another
    version or extension build may plan otherwise."""
    if core is None:
        return f"dyn-plugin {__version__} without its C++ extension"
    with open(core.__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"dyn-plugin {__version__} with C++ extension {digest}"
