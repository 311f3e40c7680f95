"""Every test that needs ``../shared`` asks for it through ``shared_data.shared_path`` (or
``shared_data.megatron_lm``, built on it), so that a clone without it skips with a reason and CI
(``DYN_PLUGIN_REQUIRE_SHARED=1``) fails instead. A static scan of tests/*.py (their code, not their
docstrings or comments) for the ways a test could reach the shared folder or Megatron-LM's scripts
around the helper:

- a string naming the shared folder or a checkout in it (``third_party``, ``/work/shared``,
  ``../shared``, a ``shared`` or ``megatron-lm`` path component) anywhere but in a ``shared_path(...)``
  call's arguments;
- reading ``$MEGATRON_LM`` or ``$DYN_PLUGIN_SHARED`` (only the helper reads them);
- a path to ``pretrain_gpt.py`` whose folder is neither the helper's answer nor a stand-in made
  under ``tmp_path``;
- ``bench train --host megatron-lm`` without ``--megatron-lm``: the command itself then falls back
  on ``../shared/third_party/megatron-lm`` (or refuses its absence first).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# the helper itself, and this scan (whose patterns name what they look for)
EXEMPT = {"shared_data.py", Path(__file__).name}
HELPERS = {"shared_path", "megatron_lm"}
STAND_INS = {"tmp_path", "tmp_path_factory"}  # a folder made by the test itself
ENV = {"MEGATRON_LM", "DYN_PLUGIN_SHARED"}
SCRIPT = "pretrain_gpt.py"
PATH_CALLS = {"join", "joinpath", "Path", "PurePath"}
SHARED = re.compile(r"third_party|/work/shared|\.\./shared|(^|[/\\])shared[/\\]|[/\\]shared$", re.I)
CHECKOUT = re.compile(r"(^|[/\\])megatron-lm([/\\]|$)", re.I)
HOST = re.compile(r"--host[ =]megatron-lm\b")
UNNAMED = (
    "runs --host megatron-lm without --megatron-lm (the command then uses ../shared, or refuses its absence first)"
)
FIX = (
    "take the path from tests/shared_data.py: shared_path('third_party', ...) for anything in ../shared, "
    "megatron_lm() for Megatron-LM's scripts (or pass --megatron-lm a stand-in under tmp_path where no "
    "checkout is needed); they skip with a reason where it is missing and fail under DYN_PLUGIN_REQUIRE_SHARED=1"
)


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _uses(node: ast.AST, names: set[str]) -> bool:
    """``node`` calls one of ``names`` or reads a variable named so."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _name(n.func) in names or isinstance(n, ast.Name) and n.id in names:
            return True
    return False


def violations(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: what`` for each way ``source`` reaches the shared folder around the helper."""
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []
    docstrings = {id(s.value) for s in ast.walk(tree) if isinstance(s, ast.Expr) and _text(s.value) is not None}
    in_helper = {id(a) for c in ast.walk(tree) if isinstance(c, ast.Call) and _name(c.func) in HELPERS for a in c.args}
    # what each variable is bound to anywhere in the file (the folder a script path is joined to)
    bound: dict[str, list[ast.AST]] = {}
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)]
        for t in targets:
            if isinstance(t, ast.Name) and getattr(n, "value", None) is not None:
                bound.setdefault(t.id, []).append(n.value)

    def from_helper_or_tmp(base: ast.AST, seen: frozenset[str] = frozenset()) -> bool:
        if _uses(base, HELPERS | STAND_INS):
            return True
        names = {n.id for n in ast.walk(base) if isinstance(n, ast.Name)} - seen
        return any(from_helper_or_tmp(v, seen | names) for name in names for v in bound.get(name, []))

    path_parts: set[int] = set()  # constants joined into a path: (base, part) pairs below
    joins: list[tuple[ast.AST, list[ast.AST], int]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            joins.append((n.right, [n.left], n.lineno))
            joins.append((n.left, [], n.lineno))
        elif isinstance(n, ast.Call) and _name(n.func) in PATH_CALLS:
            base = [n.func.value] if isinstance(n.func, ast.Attribute) and _name(n.func) == "joinpath" else []
            for i, a in enumerate(n.args):
                joins.append((a, base + n.args[:i], n.lineno))
    for part, bases, line in joins:
        text = _text(part)
        if text is None:
            continue
        path_parts.add(id(part))
        if text == SCRIPT and not any(from_helper_or_tmp(b) for b in bases):
            found.append((line, f"a path to {SCRIPT} not under megatron_lm()'s folder (or a stand-in under tmp_path)"))

    for n in ast.walk(tree):
        text = _text(n)
        if text is None or id(n) in docstrings or id(n) in in_helper:
            continue
        bare = id(n) in path_parts and text.lower() in {"shared", "megatron-lm"}
        if SHARED.search(text) or CHECKOUT.search(text) and ("/" in text or "\\" in text) or bare:
            found.append((n.lineno, f"{text!r} names the shared folder or a checkout in it"))

    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and _name(n.func) in {"get", "getenv", "pop"} and n.args:
            key = _text(n.args[0])
        elif isinstance(n, ast.Subscript) and _name(n.value) == "environ":
            key = _text(n.slice)
        if key in ENV:
            found.append((n.lineno, f"reads ${key} (only the helper does)"))

    # ``--host megatron-lm`` without ``--megatron-lm`` in the same function (or module)
    def functions(node: ast.AST) -> list[ast.AST]:
        return [n for n in ast.walk(node) if n is not node and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

    for scope in [tree, *functions(tree)]:
        inner = {id(x) for f in functions(scope) for x in ast.walk(f)}  # functions in it: scopes of their own
        nodes = [x for x in ast.walk(scope) if id(x) not in inner]
        texts = [(x.lineno, t) for x in nodes if (t := _text(x)) is not None and id(x) not in docstrings]
        if any("--megatron-lm" in t for _, t in texts):
            continue
        for x in nodes:
            if isinstance(x, ast.List | ast.Tuple):
                items = [_text(e) for e in x.elts]
                if any(a == "--host" and b == "megatron-lm" for a, b in zip(items, items[1:])):
                    found.append((x.lineno, UNNAMED))
        found += [(line, UNNAMED) for line, t in texts if HOST.search(t)]
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def test_no_test_reaches_the_shared_folder_around_the_helper():
    files = [f for f in sorted(TESTS.glob("*.py")) if f.name not in EXEMPT]
    bad = [v for f in files for v in violations(f.read_text(), f"tests/{f.name}")]
    assert not bad, "\n".join(bad) + f"\nfix: {FIX}"


def test_the_scan_finds_each_way_around_the_helper():
    bad = textwrap.dedent('''
        """Docstrings may say ../shared/third_party/megatron-lm."""
        import os
        from pathlib import Path
        ROOT = Path(__file__).parent
        MLM = ROOT.parent.parent / "shared" / "third_party" / "megatron-lm"
        SCRIPT = "/work/shared/third_party/megatron-lm/pretrain_gpt.py"
        def test_a(tmp_path):
            mlm = os.environ.get("MEGATRON_LM") or "x"
            return Path(mlm) / "pretrain_gpt.py"
        def test_b():
            cmd = ["dynplugin", "bench", "train", "--host", "megatron-lm", "--modes", "nope"]
            return os.environ["DYN_PLUGIN_SHARED"], os.path.join("/opt", "megatron-lm"), cmd
        def test_c():
            return "bench train --host megatron-lm --steps 1"
    ''')
    found = violations(bad, "bad.py")
    for line, what in [
        (6, "'shared' names"),
        (6, "'third_party' names"),
        (6, "'megatron-lm' names"),
        (7, "names the shared folder"),
        (9, "reads $MEGATRON_LM"),
        (10, "a path to pretrain_gpt.py"),
        (12, "without --megatron-lm"),
        (13, "reads $DYN_PLUGIN_SHARED"),
        (13, "'megatron-lm' names"),
        (15, "without --megatron-lm"),
    ]:
        assert any(v.startswith(f"bad.py:{line}: ") and what in v for v in found), (line, what, found)
    good = textwrap.dedent("""
        import os
        from shared_data import megatron_lm, shared_path
        def test_a(tmp_path):
            mlm = megatron_lm()
            data = shared_path("third_party", "megatron-lm", "data")
            stand_in = tmp_path / "stand-in"
            (stand_in / "pretrain_gpt.py").write_text("")
            cmd = ["bench", "train", "--host", "megatron-lm", "--megatron-lm", str(stand_in), "--modes", "megatron-lm"]
            argv = ["pretrain_gpt.py", "--num-layers", "2"]  # a script name, not a path
            return mlm / "pretrain_gpt.py", data, cmd, argv, os.environ.get("MEGATRON_LM_OUT")
        def test_b():
            return "bench train --host megatron-lm --megatron-lm /tmp/missing"
    """)
    assert violations(good, "good.py") == []
