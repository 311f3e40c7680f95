"""Data beside the repository (``../shared``: third-party checkouts such as Megatron-LM's scripts).

Nothing the suite needs to pass may live only there: data the tests read is shipped in the
repository. A test that does exercise such a checkout asks for it through ``shared_path`` (or
``megatron_lm``, Megatron-LM's scripts, built on it): where it is missing the test skips with a
reason saying so (a user's fresh clone still passes), and under ``DYN_PLUGIN_REQUIRE_SHARED=1``
(set by ``.ci/run``) that skip is a failure instead, so CI never passes a test it did not run.
tests/test_shared_paths.py fails where a test names the shared folder or its checkouts otherwise.
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


def megatron_lm() -> Path:
    """Megatron-LM's scripts (the folder of ``pretrain_gpt.py``): ``$MEGATRON_LM`` (a user's checkout),
    else ``third_party/megatron-lm`` in the shared folder, through ``shared_path`` (skipped where absent)."""
    named = os.environ.get("MEGATRON_LM")
    if not named:
        return shared_path("third_party", "megatron-lm", "pretrain_gpt.py").parent
    if not (Path(named) / "pretrain_gpt.py").is_file():
        pytest.fail(f"{named} has no pretrain_gpt.py ($MEGATRON_LM must name a Megatron-LM checkout)", pytrace=False)
    return Path(named)
