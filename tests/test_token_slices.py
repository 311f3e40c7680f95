"""Token slices of long sequences, simulated (``plan/steps/token_slices.py``): priced so that the
slices add up to the sequence, run in an order a stage can run them, never reported slower or
over memory, and on the A100 GPT-6.7B plans at 64k tokens a step, faster."""

from __future__ import annotations

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import load_bundled
from dyn_plugin.cost.profile import cost_model_from_profile
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.methods.planner import plan_step
from dyn_plugin.plan.steps.pricing import make_micro_batch
from dyn_plugin.plan.steps.simulator import simulate, stage_peak_bytes
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.plan.steps.token_slices import _expanded, slice_costs, sliced_replica, sliced_step_ms
from dyn_plugin.plan.steps.types import Op, Schedule
from dyn_plugin.runtime.sampler import global_batches


@pytest.fixture(scope="module")
def a100():
    cost = cost_model_from_profile(load_bundled("a100-gpt-6.7b"))
    cfg = DynPluginConfig.model_validate(
        {
            "pipeline": {"stages": 4, "schedule": "zero_bubble"},
            "cluster": {"devices_per_node": 8, "device": {"memory_mb": 72000, "memory_fraction": 1.0}},
        }
    )
    spec = planner_spec(cost, cfg, dp=2, zero_stage=1)
    lengths = np.minimum(load_lengths("code"), 8192)
    return spec, [[int(lengths[i]) for i in b] for b in global_batches(lengths, 65536, 6, 0)]


def test_slices_add_up_to_the_sequence(a100):
    """The slices' tokens, their attention pairs and their weight gradients' work are the sequence's;
    each slice's forward grows with the keys before it (causal attention over the earlier slices)."""
    spec, _ = a100
    whole = make_micro_batch([0], [6000], spec=spec, layout="packed", recompute="none")
    slices = slice_costs(whole, 4, spec)
    assert [s.seq_lens[0] for s in slices] == [1500] * 4 and all(s.sample_ids == (0,) for s in slices)
    forwards = [sum(s.forward_ms) for s in slices]
    assert forwards == sorted(forwards) and forwards[0] < forwards[-1]
    # the per-slice constants aside, the slices' forward is the sequence's
    assert sum(forwards) == pytest.approx(sum(whole.forward_ms), rel=0.1)
    assert sum(s.weight_ms[1] for s in slices) == pytest.approx(whole.weight_ms[1], rel=0.1)
    assert sum(s.stored_bytes[1] for s in slices) == pytest.approx(whole.stored_bytes[1], rel=0.1)
    with pytest.raises(ValueError, match="one sequence"):
        slice_costs(make_micro_batch([0, 1], [300, 200], spec=spec, layout="packed", recompute="none"), 2, spec)


def test_a_stage_runs_the_slices_forwards_in_order_and_their_backwards_reversed():
    schedule = Schedule("1f1b", (1, 0), ((Op("F", 1), Op("F", 0), Op("B", 1), Op("I", 0), Op("W", 0)),))
    out = _expanded(schedule, [3, 1])
    assert out.stages[0] == (
        Op("F", 3),
        Op("F", 0),
        Op("F", 1),
        Op("F", 2),
        Op("B", 3),
        Op("I", 2),
        Op("I", 1),
        Op("I", 0),
        Op("W", 2),
        Op("W", 1),
        Op("W", 0),
    )
    assert out.order == (3, 0, 1, 2)


def test_sliced_plans_are_never_slower_stay_within_memory_and_pay_at_64k(a100):
    spec, batches = a100
    speedups = []
    for lengths in batches:
        plan = plan_step(lengths, spec, native=True)
        ms, slices = sliced_step_ms(plan, spec)
        assert ms <= plan.iteration_ms * (1 + 1e-12) and len(slices) == len(plan.replicas)
        speedups.append(plan.iteration_ms / ms)
        for replica in plan.replicas:
            sim, k = sliced_replica(replica, spec)
            assert (k == 1) == (sim is replica.sim)
    assert np.mean(speedups) > 1.1, speedups  # 1.26x over 20 batches (BENCHMARKS.md)


def test_a_stage_holds_every_slice_until_the_backwards_unwind(a100):
    """All of a sequence's slices are in flight until their backwards unwind: a stage holds every
    slice's stored activations at once (the whole sequence's), with a slice's working memory on
    top instead of the whole sequence's; and the fill shrinks."""
    spec, _ = a100
    whole = make_micro_batch([0], [8192], spec=spec, layout="packed", recompute="selective")
    schedule = Schedule("1f1b", (0,), tuple((Op("F", 0), Op("B", 0)) for _ in range(spec.pp)))
    sliced = _expanded(schedule, [4])
    parts = slice_costs(whole, 4, spec)
    for s in range(spec.pp):
        held = stage_peak_bytes(parts, sliced.stages[s], s)
        assert sum(p.stored_bytes[s] for p in parts) <= held <= stage_peak_bytes([whole], schedule.stages[s], s)
    assert simulate(parts, sliced, spec.link).makespan_ms < simulate([whole], schedule, spec.link).makespan_ms
