"""The optional C++ extension (csrc/), or None where it was not built."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

core = None
if os.environ.get("DYN_PLUGIN_FORCE_PYTHON") != "1":
    try:
        from dyn_plugin import _core as core  # type: ignore[no-redef]  # noqa: F401 (used by the twins)
    except ImportError as exc:  # not built: the pure-Python twins serve every call
        logger.info("dyn_plugin C++ extension not available (%s); using pure Python", exc)
