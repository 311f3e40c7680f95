"""The real text behind the length distributions, taken from what every Python install ships.

Downloading a data set is not an option on air-gapped clusters, so the text comes from the
machine itself: the Python standard library (source, docstrings, ``pydoc`` topics) and, where
the OS has them, ``/usr/share/doc`` and man pages.

Distributions (see ``DISTRIBUTIONS``):

- ``code``: one sample per ``*.py`` file of the stdlib (``sysconfig.get_paths()['stdlib']``),
  sorted by path. ``site-packages`` is not the stdlib; test directories (``test``, ``tests``,
  ``idle_test``) are left out because CPython's test suite holds deliberately broken and
  data-like files that say nothing about real code.
- ``prose``: one sample per pydoc topic, per docstring (module, class, function) of those files,
  and, optional bonus, per OS document: ``/usr/share/doc/<pkg>/{copyright,README*,changelog.Debian*}``
  and English man pages (sections 1-8, troff markup stripped). Upstream ``changelog.gz`` files are
  left out: they are mostly ``git log`` dumps, not documentation. OS documents are deduplicated
  (packages ship identical copyright files) and man pages are capped at
  ``MAN_PAGES_PER_FAMILY`` per command family, or one vendor's generated pages (16k ``gcloud_*``
  pages here) would be the whole distribution. They vary by machine: the manifest of the
  bundled copies records how many of each source went in.
- ``mixture``: a FLAN-like multi-task mixture of ``MIXTURE_SIZE`` samples drawn with seed
  ``MIXTURE_SEED`` from the tasks in ``MIXTURE_WEIGHTS``: short (Q/A pairs from docstrings,
  function signatures), short-to-medium (docstrings), medium (function and class source) and
  long (whole stdlib files, pydoc topics, man pages where present).

Documents that are empty or whitespace-only are skipped: zero-length samples are invalid
everywhere in this project.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import logging
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence, TypeVar

import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")

DISTRIBUTIONS: dict[str, str] = {
    "code": "one sample per Python standard-library source file (tests and site-packages excluded)",
    "prose": "Python docs (pydoc topics, stdlib docstrings) plus OS docs and man pages where present",
    "mixture": "FLAN-like multi-task mix: short Q/A and signatures, docstrings, functions, whole documents",
}

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
SKIP_DIRS = TEST_DIRS | {"site-packages", "dist-packages", "__pycache__"}
MAN_PAGES_PER_FAMILY = 8
MAN_SECTIONS = tuple(f"man{i}" for i in range(1, 9))
# Upstream `changelog.gz` files are left out: mostly `git log` dumps (tens of MB here) rather
# than documentation, and they would triple the time to tokenize `prose`.
DOC_FILE_PATTERNS = ("copyright", "README*", "changelog.Debian*")

MIXTURE_SIZE = 10_000
MIXTURE_SEED = 0
# Fractions of samples per task. Short tasks dominate by count, as in instruction-tuning mixtures;
# whole documents are rare but carry a large share of the tokens.
MIXTURE_WEIGHTS: dict[str, float] = {
    "qa": 0.25,  # "Q: What does json.dumps do?\nA: <first paragraph of its docstring>"
    "signature": 0.20,  # the `def ...:` header of a function, as written
    "docstring": 0.20,  # a whole docstring of a module, class or function
    "definition": 0.25,  # the source of one function or class
    "document": 0.10,  # a whole stdlib file, pydoc topic or man page
}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_paths(root: Path | None = None) -> list[Path]:
    """Stdlib ``*.py`` files in sorted order; sorting makes every derived array reproducible."""
    root = stdlib_dir() if root is None else root
    paths = []
    for directory, subdirs, files in os.walk(root):
        # Prune rather than filter: site-packages can be far larger than the stdlib itself.
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
        paths += [Path(directory) / f for f in files if f.endswith(".py")]
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str:
    # The stdlib is UTF-8; `replace` keeps a stray byte from aborting a whole run.
    return path.read_bytes().decode("utf-8", errors="replace")


def _nonempty(text: str | None) -> bool:
    return text is not None and text.strip() != ""


@dataclass(frozen=True)
class Definition:
    """A function or class of the stdlib, with the pieces the mixture tasks are cut from."""

    name: str  # dotted, e.g. "json.dumps" or "collections.OrderedDict.popitem"
    header: str  # `def ...:` / `class ...:` lines as written
    source: str
    docstring: str | None
    code: str  # ``source`` without its docstring: what a model reads or writes in the pair tasks


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str
    module_docstring: str | None
    definitions: tuple[Definition, ...]


def _module_name(relpath: str) -> str:
    name = relpath[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def parse_source(relpath: str, text: str) -> SourceFile:
    """Pull docstrings and definitions out of one file without importing it (imports run code)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        logger.warning("skipping definitions of %s: %s", relpath, e)
        return SourceFile(relpath, text, None, ())
    lines = text.splitlines(keepends=True)
    module = _module_name(relpath)
    definitions: list[Definition] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                # Decorators sit above `lineno`; the header ends where the body starts.
                header = "".join(lines[child.lineno - 1 : child.body[0].lineno - 1])
                if not header.strip():  # one-liners: `def f(): return 1`
                    header = lines[child.lineno - 1]
                source = "".join(lines[child.lineno - 1 : child.end_lineno])
                docstring = ast.get_docstring(child)
                code = source
                doc = child.body[0]
                # A docstring on the `def` line itself (`def f(): "doc"`) cannot be cut out by lines.
                if docstring is not None and doc.lineno > child.lineno:
                    code = "".join(lines[child.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : child.end_lineno])
                definitions.append(Definition(name, header, source, docstring, code))
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, module)
    return SourceFile(relpath, text, ast.get_docstring(tree), tuple(definitions))


@functools.lru_cache(maxsize=1)
def stdlib_texts() -> tuple[tuple[str, str], ...]:
    """(relative path, text) of the non-empty ``code_paths()``; many ``__init__.py`` are empty."""
    root = stdlib_dir()
    texts = ((path.relative_to(root).as_posix(), _read_text(path)) for path in code_paths(root))
    return tuple((relpath, text) for relpath, text in texts if _nonempty(text))


@functools.lru_cache(maxsize=1)
def stdlib_sources() -> tuple[SourceFile, ...]:
    """Parsed stdlib files (cached: ``prose`` and ``mixture`` both need them, parsing takes seconds)."""
    return tuple(parse_source(relpath, text) for relpath, text in stdlib_texts())


def pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics) if _nonempty(topics[key])]


def docstrings(files: Iterable[SourceFile]) -> list[str]:
    # strip(): `inspect.cleandoc` keeps a whitespace-only last line, which is indentation, not text.
    out = []
    for f in files:
        out += [d.strip() for d in [f.module_docstring, *(x.docstring for x in f.definitions)] if _nonempty(d)]
    return out


_TROFF_FONT = re.compile(r"\\f(\(..|\[[^\]]*\]|.)")
_TROFF_ESCAPE = re.compile(r"\\(\(..|\[[^\]]*\]|\*\(..|\*\[[^\]]*\]|\*.|[&|^%:cdu,/])")

# Requests that format or define things rather than carry text a reader sees.
_TROFF_NO_TEXT = frozenset(
    "ad als bp br ce de ds el fi ft hy ie if ig in ll na ne nf nh nr ns ps rm rr so sp ss ta ti tr vs"
    " PD RE RS IX".split()
)


def man_to_text(source: str) -> str | None:
    """Strip troff markup so a man page is counted as the text a reader sees, not as macros.

    Returns None for alias pages (``.so other.1``), which are references, not documents.
    """
    out = []
    in_block = False  # inside a macro definition (.de) or ignored block (.ig), which end at ".."
    for line in source.splitlines():
        if in_block:
            in_block = line.strip() != ".."
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            request = parts[0] if parts else ""
            if request == "so":
                return None
            in_block = request in ("de", "ig")
            if not parts or request.startswith('\\"') or request in _TROFF_NO_TEXT or len(parts) < 2:
                continue
            # A text macro (".SH NAME", ".B word"): its arguments are what the reader sees.
            line = parts[1].replace('"', "")
        line = _TROFF_FONT.sub("", line).replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
        out.append(_TROFF_ESCAPE.sub("", line))
    return "\n".join(out)


def _read_maybe_gz(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        logger.warning("skipping %s: %s", path, e)
        return None
    if b"\0" in data:  # binary, not documentation
        return None
    return data.decode("utf-8", errors="replace")


def _man_family(path: Path) -> str:
    return re.split(r"[-_.:]", path.name, maxsplit=1)[0]


def man_pages(root: Path = Path("/usr/share/man")) -> list[str]:
    """English man pages, at most ``MAN_PAGES_PER_FAMILY`` per family, in sorted order."""
    return [text for _, text in man_page_sources(root)]


def man_page_sources(root: Path = Path("/usr/share/man")) -> list[tuple[str, str]]:
    """(troff source, text) of each of ``man_pages``: the pair tasks cut pages at their ``.SH`` lines."""
    per_family: dict[str, int] = {}
    out = []
    for section in MAN_SECTIONS:
        directory = root / section
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.is_symlink() or not path.is_file():  # symlinks are aliases
                continue
            family = _man_family(path)
            if per_family.get(family, 0) >= MAN_PAGES_PER_FAMILY:
                continue
            source = _read_maybe_gz(path)
            text = man_to_text(source) if source is not None else None
            if _nonempty(text):
                per_family[family] = per_family.get(family, 0) + 1
                out.append((source, text))
    return out


def package_docs(root: Path = Path("/usr/share/doc")) -> list[str]:
    """``copyright``, ``README*`` and ``changelog.Debian*`` of each installed package, sorted."""
    if not root.is_dir():
        return []
    out = []
    for package in sorted(root.iterdir()):
        if package.is_symlink() or not package.is_dir():  # symlinked dirs duplicate another package
            continue
        paths = {p for pattern in DOC_FILE_PATTERNS for p in package.glob(pattern)}
        for path in sorted(paths):
            if path.is_file() and not path.is_symlink():
                text = _read_maybe_gz(path)
                if _nonempty(text):
                    out.append(text)
    return out


@functools.lru_cache(maxsize=1)
def os_documents() -> tuple[tuple[str, str], ...]:
    """(source, text) of OS documentation; empty on a machine that only has Python."""
    docs = [("usr_share_doc", t) for t in package_docs()] + [("man_pages", t) for t in man_pages()]
    seen: set[bytes] = set()
    out = []
    for source, text in docs:
        key = hashlib.sha1(text.encode()).digest()
        if key not in seen:
            seen.add(key)
            out.append((source, text))
    return tuple(out)


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n", 1)[0].strip()


def mixture_pools(files: Sequence[SourceFile], topics: Sequence[str], manuals: Sequence[str]) -> dict[str, list[str]]:
    """The real text behind each mixture task (see ``MIXTURE_WEIGHTS``)."""
    defs = [d for f in files for d in f.definitions]
    return {
        "qa": [
            f"Q: What does {d.name} do?\nA: {_first_paragraph(d.docstring)}" for d in defs if _nonempty(d.docstring)
        ],
        "signature": [d.header.strip() for d in defs if _nonempty(d.header)],
        "docstring": docstrings(files),
        "definition": [d.source for d in defs if _nonempty(d.source)],
        "document": [f.text for f in files] + list(topics) + list(manuals),
    }


def sample_mixture(
    pools: dict[str, list[T]],
    size: int = MIXTURE_SIZE,
    seed: int = MIXTURE_SEED,
    weights: dict[str, float] = MIXTURE_WEIGHTS,
) -> list[tuple[str, T]]:
    """Draw ``size`` (task, item) pairs: the task by ``weights``, the item uniformly from its pool.

    Items are drawn without replacement within a task whenever its pool is large enough, so
    short tasks are not a handful of repeated samples. An item is a text here, an (input,
    target) pair of texts for the pair tasks (``lengths.tasks``).
    """
    tasks = list(weights)
    p = np.array([weights[t] for t in tasks])
    rng = np.random.default_rng(seed)
    task_of = rng.choice(len(tasks), size=size, p=p / p.sum())
    picks = np.empty(size, dtype=np.int64)
    for i, task in enumerate(tasks):
        where = np.flatnonzero(task_of == i)
        n = len(pools[task])
        if len(where) == 0:
            continue
        if n == 0:
            raise ValueError(f"mixture task {task!r} has no source text")
        picks[where] = rng.choice(n, size=len(where), replace=len(where) > n)
    return [(tasks[t], pools[tasks[t]][p]) for t, p in zip(task_of, picks)]


def labeled_documents(name: str) -> list[tuple[str, str]]:
    """(source, text) pairs of a distribution; the source labels feed the bundled manifest."""
    if name == "code":
        return [("stdlib_files", text) for _, text in stdlib_texts()]
    if name == "prose":
        return (
            [("pydoc_topics", t) for t in pydoc_topics()]
            + [("docstrings", d) for d in docstrings(stdlib_sources())]
            + list(os_documents())
        )
    if name == "mixture":
        # Man pages only: /usr/share/doc holds multi-megabyte changelogs, not FLAN-style tasks.
        man = [t for source, t in os_documents() if source == "man_pages"]
        pools = mixture_pools(stdlib_sources(), pydoc_topics(), man)
        return sample_mixture(pools)
    raise ValueError(f"unknown distribution {name!r}; valid names: {', '.join(DISTRIBUTIONS)}")


def iter_documents(name: str) -> Iterator[str]:
    """The texts behind a distribution, in ``lengths.compute_lengths`` order (for real token ids later)."""
    for _, text in labeled_documents(name):
        yield text
