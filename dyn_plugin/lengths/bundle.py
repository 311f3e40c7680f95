"""The bundled distributions: every length and pair distribution recomputed from the machine's text.

Maintainers run it (``dynplugin lengths --update-bundled``) after changing a corpus, a task or
the tokenizer; users read the bundled copies (``io.load_lengths``, ``pairs.load_pairs``), which are
the same everywhere. The manifest records how each was made: the Python and its stdlib, the
tokenizer's digest, the sources, seeds and weights, and the summaries the tests check.
"""

from __future__ import annotations

import logging
import platform
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np

from dyn_plugin.atomic import atomic_path, write_json_atomic
from dyn_plugin.lengths.corpus import (
    DISTRIBUTIONS,
    MAN_PAGES_PER_FAMILY,
    MIXTURE_SEED,
    MIXTURE_SIZE,
    MIXTURE_WEIGHTS,
    SKIP_DIRS,
    labeled_documents,
)
from dyn_plugin.lengths.io import BUNDLED_DIR, summarize
from dyn_plugin.lengths.pairs import SIDES, pair_lengths, summarize_pairs
from dyn_plugin.lengths.tasks import PAIR_DISTRIBUTIONS, TASK_WEIGHTS, TASKS, TASKS_SEED, TASKS_SIZE, labeled_pairs
from dyn_plugin.lengths.tokenizer import (
    get_tokenizer,
    token_lengths,
    tokenizer_corpus,
    tokenizer_digest,
    tokenizer_settings,
    train_tokenizer,
)

logger = logging.getLogger(__name__)


def update_bundled(directory: Path = BUNDLED_DIR, *, progress: bool = True) -> dict:
    """Recompute every distribution, lengths and pairs, into ``directory`` with a manifest saying how it was made."""
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
        "tasks": {
            "size": TASKS_SIZE,
            "seed": TASKS_SEED,
            "weights": TASK_WEIGHTS,
            "tasks": TASKS,
            "sources": "stdlib function/class definitions and docstrings (summarize, generate, signature, "
            "explain), man pages where present (describe), pydoc topics (topic_qa)",
        },
        "os_docs": {
            "included_when_present": [
                "/usr/share/doc/*/{copyright,README*,changelog.Debian*}",
                "/usr/share/man/man[1-8]",
            ],
            "man_pages_per_family": MAN_PAGES_PER_FAMILY,
            "note": "OS docs depend on the machine; these copies are what this machine had. "
            "prose uses all of them, mixture and tasks only the man pages",
        },
        "distributions": {},
        "pair_distributions": {},
    }
    for name in DISTRIBUTIONS:
        t0 = time.perf_counter()
        labeled = labeled_documents(name)
        lengths = token_lengths([t for _, t in labeled], tokenizer, progress=progress, desc=name)
        sources = dict(Counter(source for source, _ in labeled))
        # The smallest dtype that fits keeps the files at tens of KB; load_lengths widens to int64.
        dtype = np.uint16 if lengths.max() < 2**16 else np.uint32
        with atomic_path(directory / f"{name}.npy") as tmp:
            np.save(tmp, lengths.astype(dtype))
        manifest["distributions"][name] = {
            "description": DISTRIBUTIONS[name],
            "sources": sources,
            "dtype": np.dtype(dtype).name,
            "compute_s": round(time.perf_counter() - t0, 1),
            "summary": summarize(lengths),
        }
        logger.info("%s: %d samples", name, len(lengths))
    for name in PAIR_DISTRIBUTIONS:
        t0 = time.perf_counter()
        labeled = labeled_pairs(name)
        pairs = pair_lengths([p for _, p in labeled], tokenizer, progress=progress, desc=name)
        dtype = np.uint16 if pairs.max() < 2**16 else np.uint32
        with atomic_path(directory / f"{name}.npy") as tmp:
            np.save(tmp, pairs.astype(dtype))
        manifest["pair_distributions"][name] = {
            "description": PAIR_DISTRIBUTIONS[name],
            "shape": list(pairs.shape),
            "columns": list(SIDES),
            "sources": dict(Counter(task for task, _ in labeled)),
            "dtype": np.dtype(dtype).name,
            "compute_s": round(time.perf_counter() - t0, 1),
            "summary": summarize_pairs(pairs),
        }
        logger.info("%s: %d pairs", name, len(pairs))
    write_json_atomic(directory / "manifest.json", manifest, indent=2)
    return manifest
