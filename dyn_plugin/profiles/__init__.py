"""Profiles shipped with the plugin.

``a100-gpt-6.7b``: per-layer costs of a GPT 6.7B-class model measured on A100 40GB GPUs
(the DynaPipe artifact's tables, imported with ``dynplugin profile import``), so plans and
benchmarks can speak of a real GPU cluster from a machine without one.
"""
from __future__ import annotations

from pathlib import Path

from ..cost.profile import Profile, load_profile

DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.json"))


def load_bundled(name: str) -> Profile:
    path = DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no bundled profile {name!r}; bundled: {', '.join(names())}")
    return load_profile(path)
