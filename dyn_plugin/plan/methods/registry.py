"""The config's ``microbatching.method``: each name -> how a global batch is planned with it.

"dynapipe" is the plugin's planner (planner.py); every other name is a baseline (baselines.py's
``REGISTRY``, those without sequence parallelism), for side-by-side comparisons. The config's
Literal of method names is checked against ``METHODS`` (tests/test_config.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..steps.spec import PlannerSpec
from ..steps.types import StepPlan
from .baselines import BASELINES, REGISTRY
from .planner import plan_step

# name -> plan(lengths, *, spec, max_len)
METHODS: dict[str, Callable[..., StepPlan]] = {
    "dynapipe": lambda lengths, *, spec, max_len: plan_step(lengths, spec),
    **{name: REGISTRY[name].plan for name in BASELINES},
}


def plan_method(method: str, lengths: Sequence[int], *, spec: PlannerSpec, max_len: int) -> StepPlan:
    """The step plan of one global batch's ``lengths`` by ``method`` (``max_len``: the longest sequence accepted)."""
    if method not in METHODS:
        raise ValueError(f"unknown microbatching.method {method!r}; known: {', '.join(METHODS)}")
    return METHODS[method](lengths, spec=spec, max_len=max_len)
