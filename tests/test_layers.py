"""Imports point one way: lengths -> plan -> store -> runtime -> host adapters.

Each package of ``dyn_plugin`` may import only the layers listed for it (every import counts,
also those inside functions), and the planning layers import no framework and no torch, so
they run, test and scale without a device.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dyn_plugin"

# package -> the dyn_plugin packages it may import (besides itself)
ALLOWED = {
    "config": set(),
    "child": set(),
    "lengths": set(),
    "layout": set(),
    "cost": {"config", "profiles"},
    "profiles": {"cost"},
    "plan": {"config", "lengths", "cost", "layout"},
    "store": {"config", "child"},
    "models": {"cost", "plan"},
    "profiling": {"config", "cost", "models", "child", "host"},
    "runtime": {"config", "lengths", "cost", "plan", "store", "child", "layout"},
    "bench": {"config", "lengths", "cost", "profiles", "plan", "store", "runtime", "layout"},
    "host": {"config", "cost", "plan", "runtime", "models", "layout"},
    "fsdp": {"config", "lengths", "cost", "plan", "runtime", "models", "profiling", "store", "child", "host",
             "layout"},
    "commands": {"config", "lengths", "cost", "profiles", "plan", "store", "runtime", "profiling", "models", "bench"},
    "cli": {"commands"},
    "__main__": {"cli"},
    "__init__": {"cost"},
}
PURE = ("config", "lengths", "cost", "profiles", "plan", "layout")
FRAMEWORKS = ("torch", "deepspeed", "transformers", "megatron", "deepspeed_ext")


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # a module and a package's __init__ both resolve from their folder
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
                names |= {f"{mod}.{a.name}" for a in node.names} if not node.module else {mod}
            else:
                names.add(node.module)
    return names


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("").parts
    return rel[0]


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{path}: new top-level module {layer!r}: give it a place in ALLOWED (and docs/architecture.md)"
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "dyn_plugin":
            parts = name.split(".")
            if len(parts) == 1 or parts[1] == "_core":
                continue
            target = parts[1]
            assert target == layer or target in ALLOWED[layer], (
                f"{path.relative_to(ROOT)} imports {name}: layer {layer!r} may import only "
                f"{sorted(ALLOWED[layer]) or 'nothing'} of dyn_plugin")
        # megatron_patches (the Megatron adapter) imports dyn_plugin, never the other way round: the
        # ``megatron`` command runs it by module name in a child process
        assert top != "megatron_patches", (
            f"{path.relative_to(ROOT)} imports {name}: dyn_plugin must not import megatron_patches")
        if layer in PURE:
            assert top not in FRAMEWORKS, f"{path.relative_to(ROOT)} imports {name}: {layer!r} must stay framework-free"


def test_the_check_sees_relative_imports():
    names = _imports(PKG / "plan" / "baselines.py")
    assert "dyn_plugin.cost.model" in names and "dyn_plugin.plan.assign" in names
