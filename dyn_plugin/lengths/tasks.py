"""Multi-task (input, target) text pairs for encoder-decoder (T5) training, from the machine's own text.

DynaPipe's largest gains are on multi-task T5 training, where each sample is an input and a
target whose lengths vary independently: a long input mapped to a short target (summaries) and a
short input to a long target (generation), mixed. The pairs here are cut from the same offline
text as ``corpus`` (stdlib definitions and docstrings, pydoc topics, man pages where present),
one pool per task, and mixed by ``TASK_WEIGHTS`` with ``corpus.sample_mixture``. Inputs start
with a T5-style task prefix (``"summarize: "``), as T5's multi-task mixtures do; the prefix is
part of what the encoder reads, so it counts in the input length.

Tasks (see ``TASKS``):

- ``summarize`` (long -> short): a function's code, its docstring cut out -> the docstring's
  first paragraph (CodeSearchNet-style code summarization);
- ``generate`` (short -> long): a function's ``def`` line(s) and the first line of its
  docstring -> its code without the docstring (HumanEval-style code generation);
- ``signature`` (long -> short): a function's or class's whole docstring -> its ``def``/``class``
  line(s);
- ``explain`` (short -> medium): "What does json.dumps do?" -> the first paragraph of its docstring;
- ``describe`` (short -> long): a man page's NAME line ("ls - list directory contents") -> its
  DESCRIPTION section;
- ``topic_qa`` (short -> long): the heading of a pydoc topic's section ('The "assert" statement')
  -> the section's text.

Functions are ``def`` definitions, methods included; classes only enter ``signature``. Pieces
that are empty or whitespace-only are left out, so no side of a pair is empty.
"""

from __future__ import annotations

import re
from typing import Sequence

from dyn_plugin.lengths.corpus import (
    Definition,
    SourceFile,
    _first_paragraph,
    _nonempty,
    man_page_sources,
    man_to_text,
    pydoc_topics,
    sample_mixture,
    stdlib_sources,
)

# Names of the bundled pair distributions, like ``corpus.DISTRIBUTIONS`` for lengths.
PAIR_DISTRIBUTIONS: dict[str, str] = {
    "tasks": "T5-style multi-task mix of (input, target) pairs: code summarization and generation, "
    "docstring -> signature, explanations, man-page descriptions, pydoc topic Q/A",
}

TASKS_SIZE = 10_000
TASKS_SEED = 0

TASKS: dict[str, str] = {
    "summarize": "function code without its docstring -> the docstring's first paragraph",
    "generate": "def line(s) + first docstring line -> function code without its docstring",
    "signature": "whole docstring of a function or class -> its def/class line(s)",
    "explain": "'What does <dotted name> do?' -> first paragraph of its docstring",
    "describe": "man page NAME line -> its DESCRIPTION section",
    "topic_qa": "heading of a pydoc topic section -> the section's text",
}
# Fractions of pairs per task: the code tasks dominate by count, as code and docs dominate the
# machine's text; about half the pairs map a short input to a longer target and half the reverse.
# topic_qa is rare because its pool is small (about 200 pydoc sections): more would repeat each many times.
TASK_WEIGHTS: dict[str, float] = {
    "summarize": 0.25,
    "generate": 0.20,
    "signature": 0.15,
    "explain": 0.15,
    "describe": 0.20,
    "topic_qa": 0.05,
}

# A man page's top-level section starts at `.SH NAME` (man) or `.Sh NAME` (mdoc).
_MAN_HEADING = re.compile(r"^\.S[Hh][ \t]+(.*)$")
# A pydoc topic heading is underlined by a line of one of these characters, as long as it.
_UNDERLINE = re.compile(r"([*=\-~^])\1{2,}")


def _is_function(d: Definition) -> bool:
    return not d.header.lstrip().startswith("class ")


def man_sections(source: str) -> dict[str, str]:
    """Top-level sections of a man page's troff source, as text (``corpus.man_to_text``): heading -> text.

    Cut at the ``.SH`` lines of the source, not in the text, where a heading cannot be told from
    an all-capital line of the body (errno names under ERRORS); a repeated heading adds to its section.
    """
    chunks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in source.splitlines():
        heading = _MAN_HEADING.match(line)
        if heading:
            current = chunks.setdefault(heading.group(1).replace('"', "").strip().upper(), [])
        elif current is not None:
            current.append(line)
    texts = {h: man_to_text("\n".join(lines)) for h, lines in chunks.items()}
    return {h: t.strip() for h, t in texts.items() if t is not None}


def topic_sections(topic: str) -> list[tuple[str, str]]:
    """(heading, text) of each section of a pydoc topic; a heading is a line underlined as long as it."""
    lines = topic.splitlines()
    starts = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip() and len(lines[i + 1]) == len(lines[i]) and _UNDERLINE.fullmatch(lines[i + 1])
    ]
    out = []
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        out.append((lines[i].strip(), "\n".join(lines[i + 2 : end]).strip()))
    return out


def task_pools(
    files: Sequence[SourceFile], topics: Sequence[str], manuals: Sequence[str]
) -> dict[str, list[tuple[str, str]]]:
    """The (input, target) text pairs behind each task of ``TASKS``; ``manuals`` are troff sources."""
    defs = [d for f in files for d in f.definitions if _nonempty(d.docstring)]
    # Functions whose code is more than its def line: `def f(self): """doc"""` leaves nothing to write.
    funcs = [d for d in defs if _is_function(d) and d.code.strip() != d.header.strip()]
    pages = [man_sections(m) for m in manuals]
    sections = [s for t in topics for s in topic_sections(t)]
    pools = {
        "summarize": [(f"summarize: {d.code}", _first_paragraph(d.docstring)) for d in funcs],
        "generate": [(f"generate: {d.header}{d.docstring.strip().splitlines()[0]}", d.code) for d in funcs],
        "signature": [(f"signature: {d.docstring.strip()}", d.header.strip()) for d in defs],
        "explain": [(f"explain: What does {d.name} do?", _first_paragraph(d.docstring)) for d in defs],
        "describe": [
            (f"describe: {' '.join(p['NAME'].split())}", p["DESCRIPTION"])
            for p in pages
            if _nonempty(p.get("NAME")) and _nonempty(p.get("DESCRIPTION"))
        ],
        "topic_qa": [(f"question: {heading}", text) for heading, text in sections if _nonempty(text)],
    }
    return {task: [(i, t) for i, t in pairs if _nonempty(i) and _nonempty(t)] for task, pairs in pools.items()}


def labeled_pairs(name: str) -> list[tuple[str, tuple[str, str]]]:
    """(task, (input text, target text)) of a pair distribution; the task labels feed the manifest."""
    if name == "tasks":
        # Each distinct page once (packages ship identical pages, ``corpus.os_documents`` drops them too).
        seen: set[str] = set()
        man = []
        for source, text in man_page_sources():
            if text not in seen:
                seen.add(text)
                man.append(source)
        pools = task_pools(stdlib_sources(), pydoc_topics(), man)
        return sample_mixture(pools, TASKS_SIZE, TASKS_SEED, TASK_WEIGHTS)
    raise ValueError(f"unknown pair distribution {name!r}; valid names: {', '.join(PAIR_DISTRIBUTIONS)}")
