"""Data beside the repository (``../shared``: third-party checkouts such as Megatron-LM's scripts).

Nothing the suite needs to pass may live only there: data the tests read is shipped in the
repository. A test that does exercise such a checkout asks for it through ``shared_path``: where
it is missing the test skips with a reason saying so (a user's fresh clone still passes), and
under ``DYN_PLUGIN_REQUIRE_SHARED=1`` (set by ``.ci/run``) that skip is a failure instead, so CI
never passes a test it did not run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE = "DYN_PLUGIN_REQUIRE_SHARED"


def shared_root() -> Path:
    """``$DYN_PLUGIN_SHARED``, else the ``shared`` folder beside the repository."""
    return Path(os.environ.get("DYN_PLUGIN_SHARED") or Path(__file__).resolve().parents[2] / "shared")


def shared_path(*parts: str) -> Path:
    """The path under the shared folder; skips the test (fails it under ``$DYN_PLUGIN_REQUIRE_SHARED=1``)
    where it is missing."""
    path = shared_root().joinpath(*parts)
    if not path.exists():
        why = f"needs {path} (the shared folder beside the repository, or $DYN_PLUGIN_SHARED)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{why}; {REQUIRE}=1 (set by .ci/run) turns this skip into a failure", pytrace=False)
        pytest.skip(why)
    return path
