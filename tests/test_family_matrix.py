"""The model families users train, on every path of the plugin (issue 23): exact, or refused with a
message naming the feature before training; never silently wrong, never a crash. The matrix is
measured by tests/family_matrix.py (a few launches of tests/family_matrix_worker.py, all families
inside each); README.md's supported-families table must be its rendering, regenerated with

    PYTHONPATH=. .venv/bin/python tests/family_matrix.py --write-readme
"""

import json
import os

import pytest

from family_matrix import BEGIN, END, README, measure, readme_block, render
from family_matrix_worker import FAMILIES, PATHS


@pytest.fixture(scope="module")
def matrix():
    m = measure()
    keep = os.environ.get("FAMILY_MATRIX_JSON")
    if keep:
        with open(keep, "w") as f:
            json.dump(m, f, indent=1)
    return m


def test_every_cell_is_measured(matrix):
    assert set(matrix["cells"]) == set(FAMILIES)
    for family, row in matrix["cells"].items():
        assert set(row) == set(PATHS), family
        for path, cell in row.items():
            assert cell["status"] in ("exact", "refused", "wrong", "crash"), (family, path, cell)


def test_no_family_is_silently_wrong_or_crashes(matrix):
    """The issue's bar: every cell exact, or refused before training naming the feature."""
    bad = [
        f"{family} x {path}: {cell['status']}: {cell.get('message', '')}"
        for family, row in matrix["cells"].items()
        for path, cell in row.items()
        if cell["status"] in ("wrong", "crash")
    ]
    assert not bad, f"{len(bad)} cells wrong or crashing:\n" + "\n".join(bad)


def test_the_readme_table_is_the_matrix(matrix):
    with open(README) as f:
        block = readme_block(f.read())
    regenerate = "regenerate it: PYTHONPATH=. .venv/bin/python tests/family_matrix.py --write-readme"
    assert block is not None, f"README.md has no {BEGIN} ... {END} table; {regenerate}"
    assert block == render(matrix), f"README.md's family table is not the measured matrix; {regenerate}"


def test_render_is_a_table_of_short_reasons():
    m = {
        "paths": ["ds-zero1", "sp-ring"],
        "families": ["llama", "gemma2"],
        "cells": {
            "llama": {"ds-zero1": {"status": "exact"}, "sp-ring": {"status": "exact"}},
            "gemma2": {
                "ds-zero1": {"status": "exact"},
                "sp-ring": {"status": "refused", "message": "ring attention has no soft-cap | window; use ulysses"},
            },
        },
    }
    assert render(m).splitlines() == [
        "| family | `ds-zero1` | `sp-ring` |",
        "|---|---|---|",
        "| llama | exact | exact |",
        "| gemma2 | exact | refused: ring attention has no soft-cap \\| window |",
    ]
