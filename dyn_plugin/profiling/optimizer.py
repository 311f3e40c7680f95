"""One optimizer step, measured: the cost model's update term (``dyn_plugin.cost.update``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .device import Target


def measure_optimizer(models: Sequence, repeats: int = 5, target: "Target | None" = None) -> list[tuple[float, float]]:
    """(parameters, ms) of one AdamW step over each model's parameters (minimum of ``repeats``).

    An fp32 model's weights move (by lr 1e-6): measure after the timings. A half-precision
    model is stepped through fp32 copies of its weights on its device, as mixed-precision
    training (DeepSpeed's bf16/fp16 optimizers) steps fp32 master weights."""
    import torch

    points = []
    for model in models:
        params = [p for p in model.parameters() if p.requires_grad]
        if params[0].dtype != torch.float32:
            params = [p.detach().float().requires_grad_() for p in params]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-6)
        opt.step()  # the first step allocates the moments
        best = np.inf
        for _ in range(repeats):
            if target is not None:
                target.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if target is not None:
                target.synchronize()  # the step's kernels, not their launch
            best = min(best, (time.perf_counter() - t0) * 1e3)
        for p in params:
            p.grad = None
        points.append((float(sum(p.numel() for p in params)), float(best)))
    return points
