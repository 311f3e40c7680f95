"""Chrome-trace JSON of simulated pipelines, for Perfetto or chrome://tracing.

One process per data-parallel replica, one thread per stage and stream, memory as a counter per
stage, so a planned step can be compared with a profiler trace of the real one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ...atomic import write_json_atomic
from .simulator import STREAMS, memory_timeline
from .types import MicroBatch, SimResult

_MB_ID = re.compile(r"\d+")


def chrome_trace(result: SimResult, micro_batches: Sequence[MicroBatch], *, title: str = "", replica: int = 0) -> dict:
    """Trace of one replica from a ``simulate(..., record=True)`` result."""
    if not result.events:
        raise ValueError("the result has no events: simulate with record=True")
    pid = replica
    name = f"{title} replica {replica}" if title else f"replica {replica}"
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": replica}},
    ]
    stages = sorted({e[0] for e in result.events})
    for stage in stages:
        for stream in STREAMS:
            tid = _tid(stage, stream)
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"stage {stage} {stream}"}}
            )
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for stage, stream, op, start, end in result.events:
        mb = micro_batches[int(_MB_ID.search(op).group())]
        events.append(
            {
                "ph": "X",
                "name": op,
                "cat": stream,
                "pid": pid,
                "tid": _tid(stage, stream),
                "ts": start * 1e3,
                "dur": (end - start) * 1e3,
                "args": {
                    "sequences": len(mb.seq_lens),
                    "real_tokens": mb.real_tokens,
                    "shape": list(mb.shape),
                    "layout": mb.layout,
                    "recompute": mb.recompute,
                },
            }
        )
    for stage, time_ms, nbytes in memory_timeline(micro_batches, result):
        events.append(
            {
                "ph": "C",
                "name": f"stage {stage} activations",
                "pid": pid,
                "tid": _tid(stage, "compute"),
                "ts": time_ms * 1e3,
                "args": {"MiB": nbytes / 2**20},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, traces: list[dict]) -> None:
    """Write several replicas' traces (each from ``chrome_trace`` with its own ``replica``) as one file."""
    pids = [e["pid"] for t in traces for e in t["traceEvents"] if e.get("name") == "process_name"]
    if len(pids) != len(set(pids)):
        raise ValueError(f"traces share a replica id ({sorted(pids)}); give each its own replica=")
    merged = {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms"}
    write_json_atomic(path, merged)


def _tid(stage: int, stream: str) -> int:
    return stage * len(STREAMS) + STREAMS.index(stream)
