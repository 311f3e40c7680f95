"""Profiles shipped with the plugin (data files in ``dyn_plugin/profiles/``).

``a100-gpt-6.7b``: per-layer costs of a GPT 6.7B-class model measured on A100 40GB GPUs
(the DynaPipe artifact's tables, imported with ``dynplugin profile import`` from
``profiles/measured/a100-gpt-6.7b.json``), so plans and benchmarks can speak of a real GPU
cluster from a machine without one. The profiles folder holds data only: the cost models read
it by path, so nothing there imports back into ``cost``.
"""

from __future__ import annotations

from pathlib import Path

from .profile import Profile, load_profile

DIR = Path(__file__).resolve().parents[1] / "profiles"
# the measured tables the bundled A100 profile was imported from (shipped: tests and plans need no
# checkout beside the repository)
MEASURED_DIR = DIR / "measured"
# encoder-decoder tables by name (the DynaPipe artifact's T5-11B on A100s, fp16): read as measured,
# by ``encoder_decoder.import_t5_tables``, not as profiles
PAIR_TABLES = {"a100-t5-11b": MEASURED_DIR / "a100-t5-11b.json"}


def names() -> list[str]:
    """The bundled profiles' names (file stems)."""
    return sorted(p.stem for p in DIR.glob("*.json"))


def load_bundled(name: str) -> Profile:
    """A bundled profile by name; a clear error listing the bundled names otherwise."""
    path = DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no bundled profile {name!r}; bundled: {', '.join(names())}")
    return load_profile(path)
