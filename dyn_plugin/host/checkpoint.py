"""The loader's position beside a host checkpoint: one file name, one way to write and read it.

JSON, not a pickle: the position (epoch, step, what identifies the plan) is small, readable and
safe to load. Written to a unique temporary file and moved into place (``dyn_plugin.atomic``), so a
crash mid-write leaves the previous file whole.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..atomic import write_json_atomic
from ..jsonfile import read_json

LOADER_STATE = "dyn_plugin_loader.json"


def loader_state_path(directory: str | os.PathLike) -> str:
    """Where a checkpoint folder keeps the loader's position."""
    return os.path.join(directory, LOADER_STATE)


def write_loader_state(directory: str | os.PathLike, state: Mapping[str, Any]) -> str:
    """Write ``state`` (``DynLoader.state_dict()``) into ``directory`` atomically; returns the path.
    The folder is created if the host has not made it (DeepSpeed makes it on some ranks only)."""
    os.makedirs(directory, exist_ok=True)
    path = loader_state_path(directory)
    write_json_atomic(path, dict(state))  # a reader sees the old file or the new one, never half of one
    return path


def read_loader_state(directory: str | os.PathLike) -> dict[str, Any]:
    """The loader position saved in ``directory`` (FileNotFoundError when there is none; ValueError naming
    the file when it is not a JSON object)."""
    path = loader_state_path(directory)
    state = read_json(path, "loader position")
    if not isinstance(state, dict):
        raise ValueError(f"loader position {path} holds {type(state).__name__}, not the loader's state (an object)")
    return state
