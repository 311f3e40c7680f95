"""One optimizer step, measured: the cost model's update term (``dyn_plugin.cost.update``)."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np


def measure_optimizer(models: Sequence, repeats: int = 5) -> list[tuple[float, float]]:
    """(parameters, ms) of one AdamW step over each model's parameters (minimum of ``repeats``).

    The models' weights move (by lr 1e-6): measure after the timings."""
    import torch

    points = []
    for model in models:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-6)
        opt.step()  # the first step allocates the moments
        best = np.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            best = min(best, (time.perf_counter() - t0) * 1e3)
        for p in params:
            p.grad = None
        points.append((float(sum(p.numel() for p in params)), float(best)))
    return points
