"""Measures the family x path matrix of issue 23 and renders it as the README's table.

Each path (DeepSpeed ZeRO-1 and ZeRO-3 data parallel, the pipeline at 2 stages, Ulysses and ring
sequence parallelism over groups of 2, FSDP2 and FSDP1 with a sharding plan) is one launch of
``family_matrix_worker.py`` on 2 gloo CPU ranks, which trains every family in turn and compares it
with the unmodified model run document by document (see the worker for how a cell is judged).
A worker that dies or hangs loses one cell (a crash) and is relaunched on the families after it.
tests/test_family_matrix.py asserts the matrix has no wrong or crashing cell, and that README.md
holds ``render(matrix)`` between the markers below; regenerate that table with

    PYTHONPATH=. .venv/bin/python tests/family_matrix.py --write-readme

(``--json FILE`` also keeps every cell's numbers; ``--paths ds-zero1 fsdp2`` / ``--families ...``
measure a part of the matrix, without touching the README).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from family_matrix_worker import CELL_LIMIT, FAMILIES, PATHS  # noqa: E402
from ranks import free_port  # noqa: E402

README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
WORLD = 2
PARALLEL = 2  # paths measured at once (each 2 ranks): their ranks wait on each other's collectives


def _launch(path: str, out: str, families: list[str], log: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        }
        with open(f"{log}.rank{r}", "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "family_matrix_worker.py"), path, out, *families],
                    env=env,
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: ended with everything it started
                )
            )
    return procs


def _end(procs: list[subprocess.Popen]) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in procs]


def _tail(log: str, lines: int = 6) -> str:
    try:
        with open(f"{log}.rank0", errors="replace") as f:
            return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])
    except OSError:
        return ""


def measure_path(path: str, families: list[str], workdir: str) -> dict[str, dict]:
    """Every family's cell on ``path``: one launch, relaunched after a cell that killed the worker."""
    cells: dict[str, dict] = {}
    launch = 0
    while left := [f for f in families if f not in cells]:
        out, log = os.path.join(workdir, f"{path}-{launch}.json"), os.path.join(workdir, f"{path}-{launch}.log")
        procs = _launch(path, out, left, log)
        deadline = time.monotonic() + (CELL_LIMIT + 30) * len(left) + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if procs[0].poll() is not None:  # rank 0 is gone: the others have no one to finish with
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.2)
        codes = _end(procs)
        record = {"cells": {}, "running": None}
        if os.path.exists(out):
            with open(out) as f:
                record = json.load(f)
        progress = set(record["cells"]) - set(cells)
        cells.update(record["cells"])
        running = record.get("running")
        if running is None and not progress:  # died before its first cell: blame that cell, go on
            running = left[0]
        if running is not None and running not in cells:
            cells[running] = {
                "status": "crash",
                "message": f"the worker died in this cell (exit codes {codes}): {_tail(log)}",
                "phase": "unknown",
            }
        launch += 1
    return cells


def measure(paths=PATHS, families=None, parallel: int = PARALLEL) -> dict:
    """The matrix: {"paths", "families", "cells": {family: {path: cell}}, "seconds": {path: s}}."""
    families = list(families or FAMILIES)
    with tempfile.TemporaryDirectory(prefix="family-matrix-") as workdir:

        def one(path):
            t0 = time.perf_counter()
            return path, measure_path(path, families, workdir), time.perf_counter() - t0

        with ThreadPoolExecutor(parallel) as pool:
            done = list(pool.map(one, paths))
    return {
        "paths": list(paths),
        "families": families,
        "cells": {f: {path: cells[f] for path, cells, _ in done} for f in families},
        "seconds": {path: round(s, 1) for path, _, s in done},
    }


def short(cell: dict) -> str:
    """A cell as the README shows it: ``exact``, or ``refused: <the message's first clause>``."""
    status = cell["status"]
    if status == "exact":
        return "exact"
    reason = cell.get("message", "").split(";")[0].strip()
    if len(reason) > 120:
        reason = reason[:117].rstrip() + "..."
    return f"{status}: {reason}".replace("|", "\\|").replace("\n", " ")


def render(matrix: dict) -> str:
    """The matrix as a markdown table: a row per family, a column per path."""
    paths = matrix["paths"]
    lines = [
        "| family | " + " | ".join(f"`{p}`" for p in paths) + " |",
        "|---|" + "---|" * len(paths),
    ]
    for family in matrix["families"]:
        lines.append(f"| {family} | " + " | ".join(short(matrix["cells"][family][p]) for p in paths) + " |")
    return "\n".join(lines)


def readme_block(text: str) -> str | None:
    """What README.md holds between the markers (None without them)."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_readme(matrix: dict) -> None:
    with open(README) as f:
        text = f.read()
    block = f"{BEGIN}\n{render(matrix)}\n{END}"
    if readme_block(text) is None:
        text = text.rstrip("\n") + "\n\n## Supported model families\n\n" + block + "\n"
    else:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    with open(README, "w") as f:
        f.write(text)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="measure the family x path matrix (issue 23)")
    parser.add_argument("--write-readme", action="store_true", help="write the table into README.md")
    parser.add_argument("--json", help="write the measured matrix (every cell's numbers) here")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    m = measure(args.paths, args.families)
    print(render(m))
    print(f"measured in {time.perf_counter() - t0:.0f} s: {m['seconds']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    if args.write_readme:
        if args.paths != list(PATHS) or args.families != list(FAMILIES):
            parser.error("--write-readme needs the whole matrix (no --paths / --families)")
        write_readme(m)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
