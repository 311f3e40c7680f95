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
    # stdlib-only helpers at the bottom: bounds on counts and amounts, JSON files read with their name in errors,
    # files written whole or not at all (atomic), the command line's argument types (for the CLI and the
    # benchmarks' own flags)
    "checks": set(),
    "cli_args": {"checks"},
    "jsonfile": set(),
    "atomic": set(),
    "version": set(),
    "config": {"checks", "jsonfile"},
    "child": set(),
    "lengths": {"checks", "jsonfile", "atomic"},
    "layout": {"config"},  # RankLayout.from_config
    "device": set(),
    "cost": {"config", "checks", "jsonfile", "atomic", "version"},
    "plan": {"config", "lengths", "cost", "layout", "checks", "jsonfile", "atomic"},
    "store": {"config", "child"},
    "models": {"cost", "plan", "checks", "jsonfile"},
    "profiling": {"config", "cost", "models", "child", "device"},
    "runtime": {"config", "lengths", "cost", "plan", "store", "child", "layout", "device", "checks", "jsonfile"},
    "host": {"config", "cost", "plan", "runtime", "models", "layout", "device", "jsonfile", "atomic", "version"},
    # bench sits above the hosts: its training benchmarks (train_*.py) train through the FSDP entry,
    # DeepSpeed's and (in child processes only) Megatron's adapters, so it may import them
    "bench": {
        "config",
        "lengths",
        "cost",
        "plan",
        "store",
        "runtime",
        "models",
        "profiling",
        "fsdp",
        "host",
        "layout",
        "device",
        "atomic",
        "cli_args",
    },
    "fsdp": {
        "config",
        "lengths",
        "cost",
        "plan",
        "runtime",
        "models",
        "profiling",
        "store",
        "child",
        "host",
        "layout",
        "device",
    },
    "commands": {
        "config",
        "lengths",
        "cost",
        "plan",
        "store",
        "runtime",
        "profiling",
        "models",
        "bench",
        "layout",
        "checks",
        "jsonfile",
        "atomic",
        "cli_args",
    },
    "cli": {"commands"},
    "__main__": {"cli"},
    "__init__": {"cost", "version"},
}
PURE = ("checks", "cli_args", "jsonfile", "atomic", "version", "config", "lengths", "cost", "plan", "layout")
# the modules that may import megatron_patches: the Megatron training benchmark, which runs only as the
# ranks' main module, launched by name (``dynplugin bench train --host megatron``) in child processes, and
# the rank script of ``bench train --host megatron-lm``, launched by path in place of pretrain_gpt.py
MEGATRON_BENCH = (PKG / "bench" / "train_megatron.py", PKG / "bench" / "megatron_lm_rank.py")
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
    assert layer in ALLOWED, (
        f"{path}: new top-level module {layer!r}: give it a place in ALLOWED (and docs/architecture.md)"
    )
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "dyn_plugin":
            parts = name.split(".")
            if len(parts) == 1 or parts[1] == "_core":
                continue
            target = parts[1]
            assert target == layer or target in ALLOWED[layer], (
                f"{path.relative_to(ROOT)} imports {name}: layer {layer!r} may import only "
                f"{sorted(ALLOWED[layer]) or 'nothing'} of dyn_plugin"
            )
        # megatron_patches (the Megatron adapter) imports dyn_plugin, never the other way round: the
        # ``megatron`` command runs it by module name in a child process, and so does ``bench train
        # --host megatron`` with bench/train_megatron.py (no module imports that one), and ``--host megatron-lm``
        # with bench/megatron_lm_rank.py
        assert top != "megatron_patches" or path in MEGATRON_BENCH, (
            f"{path.relative_to(ROOT)} imports {name}: dyn_plugin must not import megatron_patches"
        )
        if layer in PURE:
            assert top not in FRAMEWORKS, f"{path.relative_to(ROOT)} imports {name}: {layer!r} must stay framework-free"


# plan/'s sub-packages, by mechanism, each importing only the ones listed (the pieces every
# mechanism shares sit in the core, ``steps``: a split strictly by paper would make a cycle)
PLAN = {
    "steps": set(),
    "assignment": {"steps"},
    "sequence_parallel": {"steps", "assignment"},
    "methods": {"steps", "assignment", "sequence_parallel"},
    "sharding": {"steps", "methods"},
    "strategies": {"steps", "assignment", "sequence_parallel"},
}
PLAN_MODULES = sorted((PKG / "plan").rglob("*.py"))


def test_plan_is_grouped_by_mechanism():
    flat = sorted(p.name for p in (PKG / "plan").glob("*.py") if p.name != "__init__.py")
    assert not flat, f"modules directly in dyn_plugin/plan/: {flat}; give each a sub-package in PLAN"
    packages = sorted(p.name for p in (PKG / "plan").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == sorted(PLAN), f"plan/'s sub-packages {packages} are not PLAN's {sorted(PLAN)}"


@pytest.mark.parametrize("path", PLAN_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plans_packages_import_one_way(path):
    parts = path.relative_to(PKG / "plan").parts
    if len(parts) == 1:
        return  # plan/__init__.py
    package = parts[0]
    for name in _imports(path):
        bits = name.split(".")
        if bits[:2] == ["dyn_plugin", "plan"] and len(bits) > 2 and bits[2] != package:
            assert bits[2] in PLAN[package], (
                f"{path.relative_to(ROOT)} imports {name}: plan.{package} may import only "
                f"{sorted(PLAN[package]) or 'nothing'} of plan's other packages"
            )


# The host adapters outside dyn_plugin. They sit above the core and beside each other: each may import
# any dyn_plugin layer below the hosts, never another host, nor what sits above them (benchmarks, CLI).
HOSTS = ("deepspeed_ext", "megatron_patches")
ABOVE_HOSTS = {"bench", "commands", "cli", "__main__"}
HOST_MODULES = sorted(p for host in HOSTS for p in (ROOT / host).rglob("*.py"))


@pytest.mark.parametrize("path", HOST_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hosts_import_the_core_and_not_each_other(path):
    host = path.relative_to(ROOT).parts[0]
    for name in _imports(path):
        parts = name.split(".")
        assert parts[0] not in set(HOSTS) - {host}, (
            f"{path.relative_to(ROOT)} imports {name}: hosts never import each other"
        )
        if parts[0] == "dyn_plugin" and len(parts) > 1:
            assert parts[1] not in ABOVE_HOSTS | {"fsdp"}, (
                f"{path.relative_to(ROOT)} imports {name}: a host may import the core below it, not the FSDP host, "
                "the benchmarks or the CLI"
            )


def test_only_the_benchmarks_import_deepspeed_ext():
    """The FSDP host and the core never reach into the DeepSpeed adapter; the benchmarks above both may."""
    for path in MODULES:
        if _layer(path) != "bench":
            assert not any(n.split(".")[0] == "deepspeed_ext" for n in _imports(path)), path


@pytest.mark.parametrize("host", ["deepspeed_ext", "megatron_patches", "dyn_plugin/fsdp"])
def test_every_host_runs_on_the_one_core(host):
    """What the hosts share (device, dtype, the token-mean step, recompute switches, the loader's checkpoint
    file) lives once in dyn_plugin.host: each host imports it rather than keeping its own copy."""
    names = {n for p in (ROOT / host).rglob("*.py") for n in _imports(p)}
    assert any(n.startswith("dyn_plugin.host") for n in names), f"{host} does not import dyn_plugin.host"


def test_no_module_imports_the_megatron_benchmark():
    """bench/train_megatron.py and bench/megatron_lm_rank.py import megatron_patches: they must stay a child's
    main module or script, imported by nobody (bench/train_megatron_lm.py, which imports neither, may be)."""
    for path in MODULES:
        for name in _imports(path):
            assert name != "dyn_plugin.bench.train_megatron" and not name.startswith(
                "dyn_plugin.bench.train_megatron."
            ), path
            assert not name.startswith("dyn_plugin.bench.megatron_lm_rank"), path


def test_the_check_sees_relative_imports():
    names = _imports(PKG / "plan" / "methods" / "baselines.py")
    assert "dyn_plugin.cost.model" in names and "dyn_plugin.plan.steps.assign" in names


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = ROOT, package: str = "dyn_plugin") -> dict[str, set[str]]:
    """Every module of ``package`` -> the modules of it that it imports (also inside functions), by
    name relative to the package: ``from .x import name`` counts as importing module ``x.name``
    where that is a module, else ``x``."""
    paths = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    known = set(paths) | {f"{package}._core"}  # the native extension, built or not
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        folder = path.relative_to(root).with_suffix("").parts[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(folder[: len(folder) - node.level + 1]) if node.level else ""
                mod = ".".join(x for x in (base, node.module) if x)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in known:  # `import a.b.c`: the deepest module that exists
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    short = {n: n.removeprefix(f"{package}.") if n != package else "__init__" for n in known}
    return {short[n]: {short[t] for t in ts} for n, ts in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[tuple[set[str], list[str]]]:
    """Each strongly connected set of two or more nodes, with one cycle through it (a path back to
    its start)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a step closes the cycle
            nxt = sorted(graph.get(path[-1], set()) & component)
            if start in nxt and len(path) > 1:
                break
            step = next((n for n in nxt if n not in seen), start)
            if step == start:
                break
            path.append(step)
            seen.add(step)
        out.append((component, path + [start]))
    return out


def import_cycles(root: Path = ROOT, package: str = "dyn_plugin") -> list[tuple[set[str], list[str]]]:
    """Cycles among the modules of each subpackage of ``package``, then among the subpackages."""
    graph = module_graph(root, package)

    def layer(m: str) -> str:
        return m.split(".")[0]

    inside = {m: {t for t in ts if layer(t) == layer(m)} for m, ts in graph.items()}
    between: dict[str, set[str]] = {}
    for m, ts in graph.items():
        between.setdefault(layer(m), set()).update(layer(t) for t in ts if layer(t) != layer(m))
    return _cycles(inside) + _cycles(between)


@pytest.mark.parametrize("package", ["dyn_plugin", *HOSTS])
def test_no_import_cycles(package):
    cycles = import_cycles(package=package)
    assert not cycles, "import cycles (every import counts, also those inside functions): " + "; ".join(
        " -> ".join(path) + (f" (and more among {', '.join(sorted(members))})" if len(members) > len(path) - 1 else "")
        for members, path in cycles
    )


def test_the_cycle_check_sees_function_level_imports():
    graph = {"plan.a": {"plan.b"}, "plan.b": {"plan.c"}, "plan.c": {"plan.a"}, "plan.d": {"plan.a"}}
    assert _cycles(graph) == [({"plan.a", "plan.b", "plan.c"}, ["plan.a", "plan.b", "plan.c", "plan.a"])]
    # planner.py runs groups.py's plan_groups, imported at the top; groups.py must never import it back
    assert "plan.sequence_parallel.groups" in module_graph()["plan.methods.planner"]
    # a function-level import (two_stage.py loads the ILP, and HiGHS, only where it is asked for)
    assert "plan.assignment.microbatch_ilp" in module_graph()["plan.assignment.two_stage"]


def test_names_are_imported_from_the_module_that_defines_them():
    """planner.py was split (spec.py, pricing.py, replicas.py, bounds.py, types.py) without re-exports:
    what it imports for its own use is not to be imported from it."""
    planner = PKG / "plan" / "methods" / "planner.py"
    body = ast.parse(planner.read_text()).body
    own = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    own |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    wrong = []
    for folder in ("dyn_plugin", "tests", "deepspeed_ext", "megatron_patches", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            package = path.relative_to(ROOT).parts[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = package[: len(package) - node.level + 1] if node.level else ()
                if ".".join(base + tuple((node.module or "").split("."))) == "dyn_plugin.plan.methods.planner":
                    wrong += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name not in own]
    assert not wrong, f"imported from plan/methods/planner.py, which does not define them: {wrong}"


# the packages the picture draws: dyn_plugin's (a top-level module counts as its own package) and the hosts' adapters
HOST_PACKAGES = ("deepspeed_ext", "megatron_patches")
PICTURE_BEGIN, PICTURE_END = "<!-- layers:begin -->", "<!-- layers:end -->"


def package_graph() -> dict[str, set[str]]:
    """Each package -> the packages it imports (every import, also inside functions); the entry
    points (``cli``, ``__main__``, ``__init__``) left out."""
    graph: dict[str, set[str]] = {}
    for folder in ("dyn_plugin", *HOST_PACKAGES):
        for path in (ROOT / folder).rglob("*.py"):
            source = _layer(path) if folder == "dyn_plugin" else folder
            if source in ("cli", "__main__", "__init__"):
                continue
            found = graph.setdefault(source, set())
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] == "dyn_plugin":  # alone: ``from dyn_plugin import _core``, the native extension
                    target = parts[1] if len(parts) > 1 else "_core"
                    if target not in (source, "_core", "__init__"):
                        found.add(target)
                elif parts[0] in HOST_PACKAGES and parts[0] != source:
                    found.add(parts[0])
    return graph


def layer_picture() -> str:
    """The layers as the imports make them, top first: a package's level is one above the highest
    it imports; beside each, the packages it imports directly, less those it reaches through another
    of them. docs/architecture.md holds it (regenerate: ``.venv/bin/python tests/test_layers.py``)."""
    graph = package_graph()
    level: dict[str, int] = {}

    def rank(p: str) -> int:
        if p not in level:
            level[p] = 1 + max((rank(q) for q in graph.get(p, ())), default=-1)
        return level[p]

    def reached(p: str) -> set[str]:
        return set().union(*({q} | reached(q) for q in graph.get(p, ())))

    for p in graph:
        rank(p)
    width = max(map(len, level)) + 1
    lines = []
    for n in sorted(set(level.values()), reverse=True):
        for i, p in enumerate(sorted(q for q in level if level[q] == n)):
            direct = graph.get(p, set())
            shown = sorted(q for q in direct if not any(q in reached(o) for o in direct - {q}))
            arrow = f"─> {', '.join(shown)}" if shown else "(no package of the plugin)"
            lines.append(f"{str(n) if i == 0 else '':>2}  {p:<{width}}{arrow}")
    return "\n".join(lines)


def test_the_architecture_picture_is_the_import_graph():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert PICTURE_BEGIN in text and PICTURE_END in text, f"docs/architecture.md lost its {PICTURE_BEGIN} block"
    block = (
        text.split(PICTURE_BEGIN, 1)[1].split(PICTURE_END, 1)[0].strip("\n").removeprefix("```\n").removesuffix("\n```")
    )
    assert block == layer_picture(), "regenerate it: .venv/bin/python tests/test_layers.py"


if __name__ == "__main__":
    print(layer_picture())
