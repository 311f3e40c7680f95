"""Profile under the load of the other ranks on the host.

Data-parallel ranks on one host share memory bandwidth and caches: a micro-batch measured alone
runs several percent faster than the same micro-batch in training beside other ranks (about 6%
with 2 ranks on 2 CPU cores). ``ShadowLoad`` runs ``count`` processes that train the same model
on the profile grid's micro-batches, in random order, for as long as the profiler measures, so
the profile is measured under the load training creates.

    python -m dyn_plugin.profiling.shadow --spec JSON --parent PID

is one such process.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict

READY = "ready"


class ShadowLoad:
    def __init__(self, model_cfg: dict, grid, *, count: int, threads: int | None, timeout_s: float = 300) -> None:
        spec = json.dumps({"model": model_cfg, "grid": asdict(grid), "threads": threads or 1})
        cmd = [sys.executable, "-m", "dyn_plugin.profiling.shadow", "--spec", spec, "--parent", str(os.getpid())]
        self.count, self.timeout_s, self._cmd = count, timeout_s, cmd
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "ShadowLoad":
        self.procs = [
            subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            for _ in range(self.count)
        ]
        deadline = time.monotonic() + self.timeout_s
        for p in self.procs:  # measuring starts once every shadow is busy
            ready, _, _ = select.select([p.stdout], [], [], max(deadline - time.monotonic(), 0))
            line = p.stdout.readline().strip() if ready else ""
            if line != READY:
                self.__exit__()
                why = f"exit code {p.poll()}" if ready else f"not ready after {self.timeout_s:g} s"
                raise RuntimeError(f"profiling load process {p.pid} did not start ({why})")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    from ..child import die_with_parent
    from ..models.hf import build_causal_lm, build_seq2seq_lm, hf_config
    from .allocator import stable_cpu_allocator
    from .workload import ProfileGrid, make_inputs, make_pair_inputs, micro_batch_lengths, timed_step

    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    spec = json.loads(args.spec)
    grid = ProfileGrid(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["grid"].items()})
    stable_cpu_allocator()
    torch.set_num_threads(spec["threads"])
    rng = np.random.default_rng(grid.seed + 1)
    if hf_config(spec["model"]).is_encoder_decoder:  # an encoder-decoder's profile (pairs.py): its pair grid
        model = build_seq2seq_lm(spec["model"]).train()
        vocab = model.config.vocab_size
        inputs = [make_pair_inputs([se] * n, [sd] * n, vocab, 8, rng) for se, sd, n in grid.pair_points()]
    else:
        model = build_causal_lm(spec["model"]).train()
        vocab = model.config.vocab_size
        inputs = [
            make_inputs(micro_batch_lengths(layout, s, n, rng), layout, vocab, 8, rng)
            for layout in grid.layouts
            for s, n in grid.points()
        ]
    timed_step(model, inputs[0])
    print(READY, flush=True)
    while os.getppid() == args.parent:
        timed_step(model, inputs[rng.integers(len(inputs))])
        model.zero_grad(set_to_none=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
