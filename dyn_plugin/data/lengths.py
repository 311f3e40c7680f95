"""Real sequence-length distributions, measured offline from text every Python install ships.

Planners for variable-length training are only as good as the length distributions they are
tuned on, and synthetic ones (log-normal, uniform) miss the long tail that makes padding and
attention expensive. Downloading a data set and a tokenizer is not an option on air-gapped
clusters, so everything here comes from the machine itself:

- the text: the Python standard library (source, docstrings, ``pydoc`` topics) and, where the OS
  has them, ``/usr/share/doc`` and man pages;
- the tokenizer: a byte-level BPE (vocab 8192) trained on the fly with ``tokenizers`` on the
  stdlib source and the pydoc topics, in sorted-path order, and cached under
  ``~/.cache/dyn_plugin/`` keyed by a hash of its settings and its training text.

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

The tokenizer depends on the Python version (its training text is the stdlib), so lengths
computed on another machine differ slightly; ``load_lengths("code")`` reads the copies bundled
in ``bundled/`` instead, which are the same everywhere.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import logging
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

DISTRIBUTIONS: dict[str, str] = {
    "code": "one sample per Python standard-library source file (tests and site-packages excluded)",
    "prose": "Python docs (pydoc topics, stdlib docstrings) plus OS docs and man pages where present",
    "mixture": "FLAN-like multi-task mix: short Q/A and signatures, docstrings, functions, whole documents",
}

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2
SPECIAL_TOKENS = ["<|endoftext|>"]
# Bump when the training corpus or trainer setup changes, so old cached tokenizers are not reused.
TOKENIZER_RECIPE = 1

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

ENCODE_CHUNK = 256


# ---------------------------------------------------------------------------------------------
# Sources


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
                definitions.append(Definition(name, header, source, ast.get_docstring(child)))
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
        out += [
            d.strip() for d in [f.module_docstring, *(x.docstring for x in f.definitions)] if _nonempty(d)
        ]
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
            # A text macro (".SH NAME", ".B word"): keep its arguments.
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
                out.append(text)
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


def mixture_pools(
    files: Sequence[SourceFile], topics: Sequence[str], manuals: Sequence[str]
) -> dict[str, list[str]]:
    """The real text behind each mixture task (see ``MIXTURE_WEIGHTS``)."""
    defs = [d for f in files for d in f.definitions]
    return {
        "qa": [
            f"Q: What does {d.name} do?\nA: {_first_paragraph(d.docstring)}"
            for d in defs
            if _nonempty(d.docstring)
        ],
        "signature": [d.header.strip() for d in defs if _nonempty(d.header)],
        "docstring": docstrings(files),
        "definition": [d.source for d in defs if _nonempty(d.source)],
        "document": [f.text for f in files] + list(topics) + list(manuals),
    }


def sample_mixture(
    pools: dict[str, list[str]], size: int = MIXTURE_SIZE, seed: int = MIXTURE_SEED
) -> list[tuple[str, str]]:
    """Draw ``size`` (task, text) pairs: the task by ``MIXTURE_WEIGHTS``, the text uniformly.

    Texts are drawn without replacement within a task whenever its pool is large enough, so
    short tasks are not a handful of repeated samples.
    """
    tasks = list(MIXTURE_WEIGHTS)
    weights = np.array([MIXTURE_WEIGHTS[t] for t in tasks])
    rng = np.random.default_rng(seed)
    task_of = rng.choice(len(tasks), size=size, p=weights / weights.sum())
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
    """The texts behind a distribution, in ``compute_lengths`` order (for real token ids later)."""
    for _, text in labeled_documents(name):
        yield text


# ---------------------------------------------------------------------------------------------
# Tokenizer


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dyn_plugin"


def tokenizer_corpus() -> list[str]:
    """Training text: the stdlib source then the pydoc topics, in sorted order.

    Only Python's own files go in, never OS docs, so the tokenizer is the same on every machine
    with the same Python.
    """
    return [text for _, text in stdlib_texts()] + pydoc_topics()


def tokenizer_settings() -> dict:
    import tokenizers

    return {
        "model": "byte-level BPE",
        "vocab_size": VOCAB_SIZE,
        "min_frequency": MIN_FREQUENCY,
        "special_tokens": SPECIAL_TOKENS,
        "recipe": TOKENIZER_RECIPE,
        "tokenizers_version": tokenizers.__version__,
        "corpus": "stdlib *.py (sorted, tests and site-packages excluded) then pydoc topics (sorted)",
    }


def train_tokenizer(
    texts: Sequence[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = MIN_FREQUENCY
) -> Tokenizer:
    """Train a byte-level BPE; byte-level means any text encodes, with no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def _corpus_key(texts: Sequence[str], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for text in texts:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> Tokenizer:
    """The project's tokenizer (``tokenizers.Tokenizer``), trained once and then read from cache.

    The cache key hashes the settings and every training text, so a different Python (a
    different stdlib) gets its own tokenizer instead of a silently mismatched one.
    """
    from tokenizers import Tokenizer

    texts = tokenizer_corpus()
    path = cache_dir() / f"bpe-{VOCAB_SIZE}-{_corpus_key(texts, tokenizer_settings())}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    logger.info("training byte-level BPE (vocab %d) on %d stdlib texts", VOCAB_SIZE, len(texts))
    start = time.perf_counter()
    tokenizer = train_tokenizer(texts)
    logger.info("trained tokenizer in %.1f s, caching it at %s", time.perf_counter() - start, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)  # atomic, so concurrent runs never read a half-written file
    return tokenizer


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Lengths


def token_lengths(
    texts: Sequence[str], tokenizer: Tokenizer, *, progress: bool = False, desc: str = "tokenizing"
) -> np.ndarray:
    """Token count of each text (no special tokens: a sample's length is its own text)."""
    from tqdm import tqdm

    out = np.empty(len(texts), dtype=np.int64)
    with tqdm(total=len(texts), desc=desc, unit="doc", disable=not progress) as bar:
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            encodings = tokenizer.encode_batch(list(chunk), add_special_tokens=False)
            out[start : start + len(chunk)] = [len(e.ids) for e in encodings]
            bar.update(len(chunk))
    return out


def compute_lengths(name: str, *, progress: bool = True) -> np.ndarray:
    """Tokenize the real text of a distribution; slow (seconds to minutes), see ``load_lengths``."""
    texts = [text for _, text in labeled_documents(name)]
    lengths = token_lengths(texts, get_tokenizer(), progress=progress, desc=name)
    # Whitespace-only texts are filtered earlier, so this only trips on a tokenizer bug.
    bad = np.flatnonzero(lengths <= 0)
    if len(bad):
        raise RuntimeError(f"{name}: document {bad[0]} tokenized to 0 tokens")
    return lengths


def _bad_entry(lengths: np.ndarray, mask: np.ndarray, why: str) -> ValueError:
    i = int(np.flatnonzero(mask)[0])
    return ValueError(f"lengths[{i}] = {lengths[i].item()!r}: {why}")


def _is_integral(v) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and float(v).is_integer()


def validate_lengths(values) -> np.ndarray:
    """Check and convert to int64; errors name the first bad index so a bad file is quick to fix.

    Integral floats (``3.0``) pass: JSON writers and numpy float arrays produce them.
    """
    # Lists go through an object array so "7" or None are reported as themselves, not coerced.
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D list of ints, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("lengths is empty: need at least one sample")
    if arr.dtype.kind not in "iuf":
        for i, v in enumerate(arr.tolist()):
            if not _is_integral(v):
                raise ValueError(f"lengths[{i}] = {v!r}: lengths must be integers")
        arr = arr.astype(np.int64)
    if arr.dtype.kind == "f":
        nonint = ~np.isfinite(arr) | (arr != np.round(arr))
        if nonint.any():
            raise _bad_entry(arr, nonint, "lengths must be integers")
    if (arr <= 0).any():
        raise _bad_entry(arr, arr <= 0, "every sample needs at least one token")
    return arr.astype(np.int64)


def load_lengths(source: str | os.PathLike) -> np.ndarray:
    """A bundled distribution by name, or a ``.npy`` / ``.json`` file, validated, as int64."""
    if isinstance(source, str) and source in DISTRIBUTIONS:
        path = BUNDLED_DIR / f"{source}.npy"
        if not path.exists():
            raise FileNotFoundError(
                f"bundled {path} is missing; regenerate: dynplugin lengths --update-bundled"
            )
        return validate_lengths(np.load(path))
    path = Path(source)
    if path.suffix not in (".npy", ".json"):
        raise ValueError(
            f"{str(source)!r} is neither a bundled distribution ({', '.join(DISTRIBUTIONS)}) "
            "nor a path ending in .npy or .json"
        )
    if not path.exists():
        raise FileNotFoundError(f"lengths file {path} does not exist")
    if path.suffix == ".npy":
        return validate_lengths(np.load(path, allow_pickle=False))
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        if "lengths" not in data:
            raise ValueError(f'{path}: a JSON object needs a "lengths" list, found keys {sorted(data)}')
        data = data["lengths"]
    if not isinstance(data, list):
        raise ValueError(f'{path}: expected a JSON list of ints or an object with a "lengths" list')
    return validate_lengths(data)


def save_lengths(lengths, path: str | os.PathLike) -> Path:
    """Write ``.npy`` (compact, exact dtype) or ``.json`` (readable by anything) by suffix."""
    path = Path(path)
    lengths = validate_lengths(lengths)
    if path.suffix == ".npy":
        np.save(path, lengths)
    elif path.suffix == ".json":
        path.write_text(json.dumps({"lengths": lengths.tolist()}) + "\n")
    else:
        raise ValueError(f"cannot save lengths to {str(path)!r}: the path must end in .npy or .json")
    return path


def summarize(lengths) -> dict:
    """Count, total and quantiles; p99 and max matter most, they set the padding and attention cost."""
    lengths = validate_lengths(lengths)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "count": int(lengths.size),
        "total_tokens": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "min": int(lengths.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(lengths.max()),
    }


def format_summary(name: str, summary: dict) -> str:
    cols = ["count", "mean", "p50", "p90", "p99", "max"]
    header = f"{'distribution':<14}" + "".join(f"{c:>10}" for c in cols)
    row = f"{name:<14}" + "".join(f"{summary[c]:>10,.0f}" for c in cols)
    return f"{header}\n{row}"


# ---------------------------------------------------------------------------------------------
# Bundled copies


def update_bundled(directory: Path = BUNDLED_DIR, *, progress: bool = True) -> dict:
    """Recompute every distribution into ``directory`` with a manifest saying how it was made."""
    directory.mkdir(parents=True, exist_ok=True)
    # Train afresh (seconds) to record the cost and to check training is deterministic: the
    # cached tokenizer may come from an earlier run.
    start = time.perf_counter()
    tokenizer = train_tokenizer(tokenizer_corpus())
    train_s = time.perf_counter() - start
    if tokenizer_digest(tokenizer) != tokenizer_digest(get_tokenizer()):
        logger.warning("retrained tokenizer differs from the cached one; using the fresh one")
    manifest = {
        "generated_by": "dynplugin lengths --update-bundled",
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "tokenizer": {**tokenizer_settings(), "sha256_16": tokenizer_digest(tokenizer)},
        "tokenizer_train_s": round(train_s, 1),
        "excluded_dirs": sorted(SKIP_DIRS),
        "mixture": {"size": MIXTURE_SIZE, "seed": MIXTURE_SEED, "weights": MIXTURE_WEIGHTS},
        "os_docs": {
            "included_when_present": [
                "/usr/share/doc/*/{copyright,README*,changelog.Debian*}",
                "/usr/share/man/man[1-8]",
            ],
            "man_pages_per_family": MAN_PAGES_PER_FAMILY,
            "note": "OS docs depend on the machine; these copies are what this machine had. "
            "prose uses all of them, mixture only the man pages",
        },
        "distributions": {},
    }
    for name in DISTRIBUTIONS:
        t0 = time.perf_counter()
        labeled = labeled_documents(name)
        lengths = token_lengths([t for _, t in labeled], tokenizer, progress=progress, desc=name)
        sources: dict[str, int] = {}
        for source, _ in labeled:
            sources[source] = sources.get(source, 0) + 1
        # The smallest dtype that fits keeps the files at tens of KB; load_lengths widens to int64.
        dtype = np.uint16 if lengths.max() < 2**16 else np.uint32
        np.save(directory / f"{name}.npy", lengths.astype(dtype))
        manifest["distributions"][name] = {
            "description": DISTRIBUTIONS[name],
            "sources": sources,
            "dtype": np.dtype(dtype).name,
            "compute_s": round(time.perf_counter() - t0, 1),
            "summary": summarize(lengths),
        }
        logger.info("%s: %d samples", name, len(lengths))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
