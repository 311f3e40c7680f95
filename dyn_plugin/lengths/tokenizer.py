"""The tokenizer that turns text into lengths: a byte-level BPE trained on the machine itself.

Downloading a tokenizer is not an option on air-gapped clusters, so a byte-level BPE (vocab 8192)
is trained on the fly with ``tokenizers`` on the stdlib source and the pydoc topics, in
sorted-path order, and cached under ``~/.cache/dyn_plugin/`` keyed by a hash of its settings and
its training text.

Its training text is the stdlib, so the tokenizer depends on the Python version and lengths
computed on another machine differ slightly; ``lengths.load_lengths`` reads bundled copies that
are the same everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from dyn_plugin.atomic import atomic_path
from dyn_plugin.lengths.corpus import pydoc_topics, stdlib_texts

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2
SPECIAL_TOKENS = ["<|endoftext|>"]
# Bump when the training corpus or trainer setup changes, so old cached tokenizers are not reused.
TOKENIZER_RECIPE = 1

# Texts per `encode_batch` call: large enough to keep its threads busy, small enough that the
# progress bar moves.
ENCODE_CHUNK = 256


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
    """Everything the trained tokenizer depends on besides its text; part of its cache key."""
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
    with atomic_path(path) as tmp:  # concurrent runs never read a half-written file
        tokenizer.save(tmp)
    return tokenizer


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """Short hash of the whole tokenizer, to tell two trainings apart and to name one in manifests."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


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
