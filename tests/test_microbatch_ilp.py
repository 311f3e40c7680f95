"""Stage 2 as an integer program (plan/assignment/microbatch_ilp.py): exact on tiny inputs, never worse than
the DP or an LPT greedy, every sequence once, memory respected, the same answer in every process."""

import hashlib
import json
import math
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import load_bundled
from dyn_plugin.cost.profile import cost_model_from_profile
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.assignment.microbatch_ilp import _Model, dp_groups, ilp_partition, lpt_groups, pipeline_time_ms
from dyn_plugin.plan.steps.microbatch import InfeasibleError
from dyn_plugin.plan.steps.pricing import make_micro_batch, usable
from dyn_plugin.plan.steps.spec import planner_spec

ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def spec_for(pp: int, sp: int, tp: int = 1):
    """GPT-6.7B on the measured A100 tables, one pipeline of a 64-GPU cluster (ZeRO-1)."""
    cost = replace(
        cost_model_from_profile(load_bundled("a100-gpt-6.7b")), allow_extrapolation=True, num_heads=32, num_kv_heads=32
    )
    cfg = DynPluginConfig.model_validate(
        {
            "pipeline": {"stages": pp},
            "microbatching": {"max_seq_len": 32768, "layout": "packed"},
            "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4, 8]},
            "cluster": {"devices_per_node": 8, "device": {"memory_mb": 36000, "memory_fraction": 1.0}},
        }
    )
    return replace(planner_spec(cost, cfg, dp=64 // (tp * pp), zero_stage=1, tp=tp), dp=1, sp_sizes=(sp,))


@lru_cache(maxsize=None)
def mixture() -> np.ndarray:
    return np.minimum(load_lengths("mixture"), 32768)


@lru_cache(maxsize=None)
def longest_alone(pp: int, sp: int) -> int:
    """The longest sequence that fits one micro-batch of the pipeline on its own (to 64 tokens)."""
    lo, hi = 64, 65536
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if math.isfinite(pipeline_time_ms([[0]], [mid], spec_for(pp, sp))) else (lo, mid)
    return lo


def draw(n: int, seed: int, pp: int, sp: int) -> list[int]:
    """The mixture's tail (256 tokens and up) that fits the pipeline: micro-batches of a few sequences."""
    pool = mixture()[(mixture() >= 256) & (mixture() <= longest_alone(pp, sp))]
    return [int(x) for x in np.random.default_rng(seed).choice(pool, n)]


def uniform(n: int, seed: int, pp: int, sp: int) -> list[int]:
    """Lengths from an eighth of the longest that fits alone up to it: every grouping question is open."""
    top = longest_alone(pp, sp)
    return [int(x) for x in np.random.default_rng(seed).integers(top // 8, top, n)]


def set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


def check_valid(res, lens, spec):
    sp = spec.sp_sizes[0]
    assert sorted(i for g in res.groups for i in g) == list(range(len(lens)))
    assert len(res.recompute) == len(res.groups)
    for g, rc in zip(res.groups, res.recompute):
        assert usable(make_micro_batch(g, lens, spec=spec, layout="packed", recompute=rc, sp=sp), spec)
    assert res.objective_ms == pytest.approx(pipeline_time_ms(res.groups, lens, spec, res.recompute), rel=1e-12)


@pytest.mark.parametrize("pp,sp", [(1, 1), (3, 1), (1, 2)])
def test_equals_brute_force_on_tiny_inputs(pp, sp):
    spec = spec_for(pp, sp)
    for seed in range(3):
        lens = uniform(6 if pp == 1 else 5, seed, pp, sp)
        brute = min(pipeline_time_ms(p, lens, spec) for p in set_partitions(list(range(len(lens)))))
        res = ilp_partition(lens, spec, counts=range(1, len(lens) + 1), node_limit=100_000)
        check_valid(res, lens, spec)
        assert res.status == "optimal"
        # the program leaves out the padding document (< sp tokens) from the time: near-ties may differ by that
        assert res.objective_ms == pytest.approx(brute, rel=1e-5), (lens, res)


@pytest.mark.parametrize("pp,sp,n", [(1, 1, 12), (4, 1, 16), (4, 4, 20), (2, 2, 16)])
def test_never_worse_than_dp_or_lpt(pp, sp, n):
    spec = spec_for(pp, sp)
    for seed in range(3):
        lens = draw(n, 100 + seed, pp, sp)
        inc = dp_groups(lens, spec)
        res = ilp_partition(lens, spec, incumbent=inc)
        check_valid(res, lens, spec)
        dp_ms = pipeline_time_ms(inc, lens, spec)
        assert res.objective_ms <= dp_ms * (1 + 1e-12)
        assert res.incumbent_ms <= dp_ms * (1 + 1e-12)
        c = len(inc)
        for count in range(max(1, c - 1), min(n, c + 1) + 1):  # the default counts
            lpt = lpt_groups(lens, spec, count)
            if lpt is not None:
                assert sorted(i for g in lpt for i in g) == list(range(n))
                assert res.objective_ms <= pipeline_time_ms(lpt, lens, spec) * (1 + 1e-12)


def test_counts_are_respected():
    spec = spec_for(2, 1)
    lens = draw(10, 7, 2, 1)
    for counts in ([3], [2, 5]):
        res = ilp_partition(lens, spec, counts=counts)
        check_valid(res, lens, spec)
        assert len(res.groups) in counts


def test_a_spent_time_budget_keeps_the_start():
    spec = spec_for(4, 1)
    lens = draw(16, 11, 4, 1)
    inc = dp_groups(lens, spec)
    res = ilp_partition(lens, spec, incumbent=inc, time_limit_s=0.0)
    check_valid(res, lens, spec)
    assert res.status in ("incumbent", "time_limit", "optimal")
    assert res.objective_ms <= pipeline_time_ms(inc, lens, spec) * (1 + 1e-12)


def test_pipeline_time_of_an_oversized_group_is_infinite():
    spec = spec_for(1, 1)
    lens = [longest_alone(1, 1)] * 3
    assert pipeline_time_ms([[0, 1, 2]], lens, spec) == math.inf
    assert math.isfinite(pipeline_time_ms([[0], [1], [2]], lens, spec))


def test_a_sequence_too_long_raises():
    spec = spec_for(1, 1)
    with pytest.raises(InfeasibleError, match=r"sequence 1 \(length 400000\) does not fit"):
        ilp_partition([1000, 400_000, 2000], spec, incumbent=[[0], [1], [2]])


def test_one_pipeline_spec_required():
    with pytest.raises(ValueError, match="one sequence-parallel size"):
        ilp_partition([100, 200], replace(spec_for(1, 1), sp_sizes=(1, 2)), incumbent=[[0, 1]])


SOLVE = """
import hashlib, json, sys
sys.path.insert(0, {root!r})
from tests.test_microbatch_ilp import draw, spec_for
from dyn_plugin.plan.assignment.microbatch_ilp import ilp_partition
res = ilp_partition(draw(24, 5, 4, 2), spec_for(4, 2), node_limit=50)
print(hashlib.sha256(json.dumps([res.groups, res.recompute, res.status]).encode()).hexdigest())
"""


def test_same_result_in_every_process():
    code = SOLVE.format(root=str(ROOT))
    digests = [
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        for _ in range(2)
    ]
    res = ilp_partition(draw(24, 5, 4, 2), spec_for(4, 2), node_limit=50)
    here = hashlib.sha256(json.dumps([res.groups, res.recompute, res.status]).encode()).hexdigest()
    assert digests == [here, here]


@pytest.mark.parametrize("pp,sp", [(4, 1), (8, 2), (2, 4)])
def test_memory_rows_never_accept_what_does_not_fit(pp, sp):
    """The program's memory rows against exact pricing, short micro-batches to long: a banded
    activation-memory fit (one line per measured length) needs a row per band; the last band's
    line alone would accept many short micro-batches that run out of memory."""
    spec = spec_for(pp, sp)
    model = _Model(spec)
    rng = np.random.default_rng(0)
    top = longest_alone(pp, sp)
    accepted = 0
    for _ in range(300):
        length = int(rng.integers(16, top + 1))
        lens = [length] * int(rng.integers(1, max(2, 4 * top // length)))
        tokens, squares = sum(lens), sum(x * x for x in lens)
        for r, rc in enumerate(spec.recomputes):
            if model.fits(r, tokens, squares, length):
                accepted += 1
                mb = make_micro_batch(list(range(len(lens))), lens, spec=spec, layout="packed", recompute=rc, sp=sp)
                assert usable(mb, spec), (lens[:1], len(lens), rc)
    assert accepted > 100  # the rows are safe without refusing everything
