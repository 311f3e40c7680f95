"""The OSDP search: prices per the contract's semantics, the knapsack against brute force and its
C++ twin, the search with the planner, the bad budgets, the plan file."""

import itertools
import json
import math
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.cost.native import core
from dyn_plugin.cost.sharding import HOST_KINDS, Links, price, unit_compute
from dyn_plugin.cost.update import UpdateCost
from dyn_plugin.plan.sharding.knapsack import solve
from dyn_plugin.plan.sharding.search import (
    BASELINES,
    choice_columns,
    search_sharding,
    select,
    shard_sizes,
    smallest,
    typical_step,
    uniform_plan,
)
from dyn_plugin.plan.sharding.shard_plan import MB, SCHEMA, VERSION, Choice, ShardPlan, ShardUnit
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.runtime.planning import PlanningContext

H, VOCAB = 256, 4096
RNG = np.random.default_rng(0)
LENGTHS = [int(x) for x in np.minimum(RNG.lognormal(5.5, 1.0, 48).astype(int) + 1, 1024)]


def config(
    budget_mb: float | None = None,
    *,
    layers: int = 2,
    nodes: int = 1,
    per_node: int = 4,
    inter: float = 12.5,
    **sharding,
) -> DynPluginConfig:
    return DynPluginConfig.model_validate(
        {
            "cost_model": {
                "kind": "analytic",
                "dtype": "fp32",
                "model": {
                    "hidden_size": H,
                    "num_layers": layers,
                    "num_heads": 4,
                    "ffn_hidden_size": 4 * H,
                    "vocab_size": VOCAB,
                    "gated_mlp": False,
                },
            },
            "microbatching": {"global_tokens": 8192, "max_seq_len": 1024},
            "cluster": {
                "devices_per_node": per_node,
                "num_nodes": nodes,
                "intra_node_gb_per_s": 5.0,
                "inter_node_gb_per_s": inter,
                "device": {"memory_mb": 4000, "peak_tflops": 2.0},
            },
            "sharding": {"memory_budget_mb": budget_mb, **sharding},
        }
    )


def gpt_units(layers: int, h: int = H, vocab: int = VOCAB, tied: bool = False) -> list[ShardUnit]:
    """A GPT's units as models.shard_units lists them: embedding, attention + MLP per layer, an
    untied head (a linear layer, so it can split), the root with the norms."""
    units = [ShardUnit("wte", vocab * h, "embedding")]
    for i in range(layers):
        units += [
            ShardUnit(f"h.{i}.attn", 4 * h * h + 4 * h, "layer", i),
            ShardUnit(f"h.{i}.mlp", 8 * h * h + 5 * h, "layer", i),
        ]
    if not tied:
        units.append(ShardUnit("lm_head", vocab * h, "head", -1, vocab))
    return units + [ShardUnit("", 4 * h * layers + 2 * h, "other")]


# ---------------------------------------------------------------- knapsack


def brute_force(w, t, cap, opens, reserve):
    """(least time, its weight) over every combination; (inf, None) when none fits."""
    best = (math.inf, None)
    for combo in itertools.product(range(w.shape[1]), repeat=len(w)):
        rows = range(len(w))
        if any(not t[i, c] < math.inf for i, c in zip(rows, combo)):
            continue
        weight = sum(int(w[i, c]) for i, c in zip(rows, combo))
        weight += max((int(reserve[i]) for i, c in zip(rows, combo) if opens[i, c]), default=0)
        time_ = sum(t[i, c] for i, c in zip(rows, combo))
        if weight <= cap and time_ < best[0] - 1e-12:
            best = (time_, weight)
    return best


def random_instance(seed: int, items: int, choices: int, cap: int):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 10, (items, choices))
    t = rng.integers(0, 50, (items, choices)).astype(float) / 7  # ties happen
    t[rng.random((items, choices)) < 0.15] = np.inf
    opens = rng.random((items, choices)) < 0.5
    reserve = rng.integers(0, 6, items)
    return w, t, cap, opens, reserve


@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 40))
@settings(max_examples=120, deadline=None)
def test_knapsack_equals_brute_force(seed, items, choices, cap):
    w, t, cap, opens, reserve = random_instance(seed, items, choices, cap)
    got = solve(w, t, cap, opens=opens, reserve=reserve, native=False)
    want, _ = brute_force(w, t, cap, opens, reserve)
    if want == math.inf:
        assert got is None
        return
    assert got.time == pytest.approx(want, rel=1e-12, abs=1e-12)
    rows = np.arange(items)
    used = w[rows, got.choice].sum() + max((reserve[i] for i in rows if opens[i, got.choice[i]]), default=0)
    assert used == got.weight <= cap and np.isfinite(t[rows, got.choice]).all()
    assert t[rows, got.choice].sum() == pytest.approx(got.time, abs=1e-12)
    # the frontier: the best time within each capacity
    for m in range(cap + 1):
        assert got.frontier[m] == pytest.approx(brute_force(w, t, m, opens, reserve)[0], rel=1e-12, abs=1e-12)


def test_knapsack_brute_force_on_eight_items():
    for seed in range(3):
        w, t, cap, opens, reserve = random_instance(100 + seed, 8, 3, 30)
        got = solve(w, t, cap, opens=opens, reserve=reserve, native=False)
        assert got.time == pytest.approx(brute_force(w, t, cap, opens, reserve)[0], rel=1e-12)


@pytest.mark.native  # tests/conftest.py: skipped without the extension, failed under `make test`
@given(st.integers(0, 10**6), st.integers(1, 12), st.integers(1, 8), st.integers(0, 300))
@settings(max_examples=150, deadline=None)
def test_knapsack_native_equals_python_exactly(seed, items, choices, cap):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 60, (items, choices))
    t = rng.random((items, choices)) * rng.choice([1e-3, 1.0, 1e3])  # arbitrary floats: sums must agree bit for bit
    t[rng.random((items, choices)) < 0.1] = np.inf
    opens, reserve = rng.random((items, choices)) < 0.5, rng.integers(0, 40, items)
    py = solve(w, t, cap, opens=opens, reserve=reserve, native=False)
    cc = solve(w, t, cap, opens=opens, reserve=reserve, native=True)
    assert (py is None) == (cc is None)
    if py is not None:
        assert py.choice.tolist() == cc.choice.tolist() and py.weight == cc.weight
        assert np.array_equal(py.frontier, cc.frontier)


def test_knapsack_rejects_bad_input():
    with pytest.raises(ValueError, match="must both be"):
        solve(np.zeros((2, 2)), np.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="non-negative"):
        solve(-np.ones((1, 1)), np.zeros((1, 1)), 4)
    if core is not None:
        with pytest.raises(ValueError, match="descending reserve"):
            core.knapsack(np.zeros((2, 1), np.int64), np.zeros((2, 1)), np.zeros((2, 1), np.uint8), np.array([1, 2]), 4)


# ---------------------------------------------------------------- prices


LINES = UpdateCost(allreduce=(0.5, 1e-6), allgather=(0.2, 2e-6), reducescatter=(0.3, 3e-6), ranks=2)


def ring(line, nbytes, n, passes):
    """The measured line among 2 ranks, scaled by the ring factor to n (written out, not imported)."""
    return 0.0 if n <= 1 else line[0] + line[1] * nbytes * (passes * (n - 1) / n) / (passes * 0.5)


def test_memory_and_communication_per_choice_follow_the_contract():
    world, n, m = 8, 4, 3  # hybrid: 2 replicas of 4
    units = [ShardUnit("", 100, "other"), ShardUnit("a", 1000, "layer", 0), ShardUnit("b", 4000, "layer", 0, 8)]
    cols = [
        Choice("replicate"),
        Choice("keep"),
        Choice("grad_op"),
        Choice("full"),
        Choice("reshard", reshard_to=2),
        Choice("split", slices=4, sharded=1),
        Choice("split", slices=3, sharded=2),
    ]
    links = Links(LINES, devices_per_node=8, intra_gb_per_s=1.0, inter_gb_per_s=1.0, latency_us=0.0)
    zero = np.zeros((3, m))
    for host in ("fsdp2", "fsdp1"):
        hc = [c for c in cols if c.kind in HOST_KINDS[host]]
        pr = price(
            units,
            hc,
            dtype="fp32",
            world=world,
            shard_size=n,
            forward_ms=zero,
            backward_ms=zero,
            links=links,
            overlap=1.0,
            host=host,
        )
        p, g, o = 4, 4, 8  # fp32
        pgo = p + g + o
        for i, u in enumerate(units):
            P = u.params
            ag, ag2 = ring(LINES.allgather, P * p, n, 1), ring(LINES.allgather, P * p, 2, 1)
            red = ring(LINES.reducescatter, P * g, n, 1) + ring(LINES.allreduce, P * g / n, world // n, 2)
            ar = ring(LINES.allreduce, P * g, world, 2)
            per_step = host == "fsdp2"
            # FSDP2's replicate (a shard group of one) still copies its parameters into an unsharded buffer
            memory = {
                "replicate": P * pgo + (P * p if host == "fsdp2" else 0),
                "keep": P * pgo / n + P * (p + g),
                "grad_op": P * pgo / n + P * p,
                "full": P * pgo / n,
                "reshard(2)": P * pgo / n + P * p / 2,
                "split(1/4)": 1 / 4 * P * pgo / n + 3 / 4 * (P * pgo / n + P * (p + g)),
                "split(2/3)": 2 / 3 * P * pgo / n + 1 / 3 * (P * pgo / n + P * (p + g)),
            }
            comm = {
                "replicate": ar if per_step else m * ar,
                "keep": ag + red if per_step else m * (ag + red),
                "grad_op": m * (ag + red),
                "full": m * (2 * ag + red),
                "reshard(2)": m * (ag + ag2 + red),
            }

            def slices(k, s, Pk=P):
                q = Pk / k
                full = m * (
                    2 * ring(LINES.allgather, q * p, n, 1)
                    + ring(LINES.reducescatter, q * g, n, 1)
                    + ring(LINES.allreduce, q * g / n, 2, 2)
                )
                keep_ = (
                    ring(LINES.allgather, q * p, n, 1)
                    + ring(LINES.reducescatter, q * g, n, 1)
                    + ring(LINES.allreduce, q * g / n, 2, 2)
                )
                return s * full + (k - s) * (keep_ if per_step else m * keep_)

            comm["split(1/4)"], comm["split(2/3)"] = slices(4, 1), slices(3, 2)
            for j, c in enumerate(hc):
                allowed = c.kind != "split" or (u.linear_out and u.linear_out % c.slices == 0)
                assert pr.allowed[i, j] == bool(allowed), (host, u.name, c.label)
                assert pr.memory_bytes[i, j] == pytest.approx(memory[c.label]), (host, u.name, c.label)
                assert pr.comm_ms[i, j] == pytest.approx(comm[c.label]), (host, u.name, c.label)
                # nothing to hide behind: all of it is exposed
                assert pr.exposed_ms[i, j] == pytest.approx(comm[c.label])
            assert pr.reserve_bytes[i] == P * (2 * p + g)
        assert pr.opens.tolist() == [c.kind in ("full", "reshard", "split") for c in hc]


def test_exposed_is_what_the_neighbours_compute_cannot_hide():
    units = [ShardUnit("", 0, "other"), ShardUnit("a", 2_000_000, "layer", 0), ShardUnit("b", 2_000_000, "layer", 0)]
    links = Links(LINES, 8, 1.0, 1.0, 0.0)
    fwd = np.array([[0.0, 0.0], [1.0, 30.0], [2.0, 3.0]])  # [unit, micro-batch]
    bwd = 2 * fwd
    cols = [Choice("keep"), Choice("full")]
    for overlap in (0.5, 1.0):
        pr = price(
            units,
            cols,
            dtype="fp32",
            world=4,
            shard_size=4,
            forward_ms=fwd,
            backward_ms=bwd,
            links=links,
            overlap=overlap,
        )
        ag, rs = ring(LINES.allgather, 8e6, 4, 1), ring(LINES.reducescatter, 8e6, 4, 1)
        h = overlap
        # unit a: gathers beside the root's forward (none) and b's backward, reductions beside the root's backward
        keep_a = ag + rs  # gathered before micro-batch 0, reduced after micro-batch 1: nothing hides them
        full_a = sum(ag + max(0, ag - h * bwd[2, j]) + rs for j in range(2))
        # unit b: forward gathers beside a's forward, backward gathers beside nothing, reductions beside a's backward
        keep_b = max(0, ag - h * fwd[1, 0]) + max(0, rs - h * bwd[1, 1])
        full_b = sum(max(0, ag - h * fwd[1, j]) + ag + max(0, rs - h * bwd[1, j]) for j in range(2))
        assert pr.exposed_ms[1].tolist() == pytest.approx([keep_a, full_a])
        assert pr.exposed_ms[2].tolist() == pytest.approx([keep_b, full_b])
        assert (pr.exposed_ms <= pr.comm_ms + 1e-12).all()


def test_unit_compute_shares_the_layer_by_parameters():
    units = gpt_units(2, tied=True)
    comp = {"embedding": ([1.0], [2.0]), "layer": ([12.0], [24.0]), "head": ([5.0], [10.0])}
    fwd, bwd = unit_compute(units, comp)
    a, m = units[1].params, units[2].params
    assert fwd[1, 0] == pytest.approx(12 * a / (a + m)) and bwd[2, 0] == pytest.approx(24 * m / (a + m))
    assert fwd[0, 0] == 1.0 and fwd[-1, 0] == 5.0  # tied head: the root runs it
    fwd, _ = unit_compute(gpt_units(2), comp)
    assert fwd[-2, 0] == 5.0 and fwd[-1, 0] == 0.0


def test_collectives_priced_from_measured_lines_or_the_links():
    cost = UpdateCost.fit(None, [(1e6, 1.0), (4e6, 2.5)], 2, [(1e6, 0.6), (4e6, 1.2)], [(1e6, 0.8), (4e6, 2.0)])
    assert cost.allgather == pytest.approx((0.4, 2e-7)) and cost.reducescatter == pytest.approx((0.4, 4e-7))
    assert cost.allgather_ms(4e6, 2, 1.0) == pytest.approx(1.2)
    assert cost.allgather_ms(4e6, 4, 1.0) == pytest.approx(0.4 + 0.8 * 1.5)  # (n-1)/n: 3/4 over 1/2
    assert cost.reducescatter_ms(4e6, 1, 1.0) == 0.0
    assert UpdateCost.from_dict(cost.to_dict()) == cost
    old = {"optimizer": None, "allreduce": [0.5, 1e-6], "ranks": 2}  # a profile v3 update section
    assert UpdateCost.from_dict(old).allgather is None
    assert json.loads(json.dumps(UpdateCost.from_dict(old).to_dict())) == old  # written back as it was
    links = UpdateCost()
    assert links.allgather_ms(1e9, 4, 100.0, latency_us=10.0) == pytest.approx(7.5 + 0.03)  # 3/4 GB + 3 steps
    assert links.allreduce_ms(1e9, 4, 100.0, latency_us=10.0) == pytest.approx(15.0 + 0.06)
    intra = Links(links, devices_per_node=4, intra_gb_per_s=100.0, inter_gb_per_s=10.0, latency_us=0.0)
    assert intra.allgather_ms(1e9, 4, 4) == pytest.approx(7.5) and intra.allgather_ms(1e9, 4, 8) == pytest.approx(75.0)


# ---------------------------------------------------------------- the search


def small_typical(budget_mb=600, layers=1):
    cfg = config(budget_mb, layers=layers)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    return cfg, cost, typical_step(LENGTHS, cost, cfg, world=4, state_bytes=20 * MB)


def test_select_equals_brute_force_on_a_small_model():
    """One layer: embedding, attention, MLP, a head that splits, the root: every combination of
    the search's choices (5 units, 11 choices), memory rounded up as the search rounds it."""
    cfg, cost, typ = small_typical()
    units = gpt_units(1)
    order = [len(units) - 1] + list(range(len(units) - 1))  # forward order: the root first
    ordered = [units[i] for i in order]
    cols = choice_columns(cfg, "fsdp2", 4)
    assert [c.label for c in cols] == [
        "replicate",
        "keep",
        "grad_op",
        "full",
        "reshard(2)",
        "split(1/2)",
        "split(1/3)",
        "split(2/3)",
        "split(1/4)",
        "split(2/4)",
        "split(3/4)",
    ]
    fwd, bwd = unit_compute(ordered, typ.component_ms)
    pr = price(
        ordered,
        cols,
        dtype="fp32",
        world=4,
        shard_size=4,
        forward_ms=fwd,
        backward_ms=bwd,
        links=Links.of(cfg.cluster, cost.update),
        overlap=0.7,
    )
    full_states = smallest(pr)[0]
    for budget in (full_states * 1.05, full_states * 1.6, full_states * 3, pr.memory_bytes.max() * 6):
        unit = budget / 512
        w = np.where(pr.allowed, np.ceil(pr.memory_bytes / unit), 0).astype(int)
        t = np.where(pr.allowed, pr.exposed_ms + pr.optimizer_ms, np.inf)
        reserve = np.ceil(pr.reserve_bytes / unit).astype(int)
        want, _ = brute_force(w, t, 512, np.broadcast_to(pr.opens, w.shape), reserve)
        for native in (False, True) if core is not None else (False,):
            got = select(pr, budget, resolution=512, native=native)
            chosen = t[np.arange(len(w)), got.choice]
            assert chosen.sum() == pytest.approx(want, rel=1e-12), (budget, native)
            opened = pr.opens[list(got.choice)]
            held = pr.memory_bytes[np.arange(len(w)), got.choice].sum()
            held += pr.reserve_bytes[opened].max() if opened.any() else 0
            assert held <= budget


def test_frontier_is_monotone_and_less_memory_means_more_sharding():
    cfg, cost, typ = small_typical(layers=4)
    units = gpt_units(4)
    ordered = [units[-1]] + units[:-1]
    cols = choice_columns(cfg, "fsdp2", 4)
    fwd, bwd = unit_compute(ordered, typ.component_ms)
    pr = price(
        ordered,
        cols,
        dtype="fp32",
        world=4,
        shard_size=4,
        forward_ms=fwd,
        backward_ms=bwd,
        links=Links.of(cfg.cluster, cost.update),
        overlap=1.0,
    )
    least = smallest(pr)[0]
    budgets = [pr.memory_bytes[:, 0].sum() * 1.01, least * 3, least * 2, least * 1.3, least * 1.01]
    times, sharded = [], []
    for b in budgets:
        sel = select(pr, b)
        f = sel.frontier[np.isfinite(sel.frontier)]
        assert (np.diff(f) <= 0).all()  # more memory never costs time
        times.append(float(pr.time_ms[np.arange(len(ordered)), sel.choice].sum()))
        sharded.append(
            sum(cols[c].kind not in ("replicate", "keep") for c, u in zip(sel.choice, ordered) if u.params > H)
        )
    assert times == sorted(times) and times[0] < times[-1]
    # at the least memory every unit but the root (its norms: a few KB) gathers on use
    assert sharded == sorted(sharded) and sharded[0] < sharded[-1] == len(ordered) - 1
    assert select(pr, least * 0.99) is None


def test_search_plan_fits_roundtrips_and_native_equals_python(tmp_path):
    cfg = config(130)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    units = gpt_units(2)
    plan = search_sharding(units, cost, cfg, world=4, lengths=LENGTHS, model="tiny-gpt")
    assert plan.peak_bytes <= 130 * MB and plan.memory_budget_bytes == 130 * MB
    assert len({u.choice.kind for u in plan.units}) > 1  # a budget where the choices differ per unit
    assert [u.name for u in plan.units] == [u.name for u in units] and plan.dtype == "fp32" and plan.host == "fsdp2"
    # the step it was priced on is the one training plans with its states
    typ = typical_step(LENGTHS, cost, cfg, world=4, state_bytes=plan.planning_state_bytes)
    assert (plan.micro_batches, plan.activation_bytes) == (typ.micro_batches, typ.activation_bytes)
    assert plan.step_ms == pytest.approx(plan.compute_ms + sum(u.exposed_ms for u in plan.units))
    mbs = [p for p, _ in plan.frontier]
    assert mbs == sorted(mbs) and all(m <= 130 for m in mbs) and plan.frontier
    assert [ms for _, ms in plan.frontier] == sorted((ms for _, ms in plan.frontier), reverse=True)
    if core is not None:
        assert search_sharding(units, cost, cfg, world=4, lengths=LENGTHS, model="tiny-gpt", native=False) == plan
    path = tmp_path / "shard.json"
    plan.save(path)
    assert ShardPlan.load(path) == plan and json.loads(path.read_text())["schema"] == "dyn_plugin.shard_plan"
    plan.check_units([u.name for u in units])
    with pytest.raises(ValueError, match=r"names modules this model does not have: 'h\.1\.attn', 'h\.1\.mlp'"):
        plan.check_units([u.name for u in gpt_units(1)])


def test_budget_below_the_smallest_plan_says_the_minimum():
    cost = build_cost_model(config().cost_model, config().cluster)
    units = gpt_units(2)
    with pytest.raises(ValueError, match=r"sharding\.memory_budget_mb") as err:
        search_sharding(units, cost, config(60), world=4, lengths=LENGTHS)
    need = int(re.search(r"to at least (\d+) MB", str(err.value)).group(1))
    assert need > 60
    plan = search_sharding(units, cost, config(need), world=4, lengths=LENGTHS)  # the minimum is enough
    assert plan.peak_bytes <= need * MB
    with pytest.raises(ValueError, match=r"sharding\.memory_budget_mb"):
        search_sharding(units, cost, config(need - 2), world=4, lengths=LENGTHS)


def test_baselines_priced_the_same_way():
    cfg = config(105)  # full_shard and shard_grad_op fit, no_shard does not
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    units = gpt_units(2)
    best = search_sharding(units, cost, cfg, world=4, lengths=LENGTHS)
    full = uniform_plan(units, cost, cfg, BASELINES["full_shard"], world=4, lengths=LENGTHS)
    assert {u.choice.kind for u in full.units} == {"full"} and full.peak_bytes <= 120 * MB
    assert best.step_ms <= full.step_ms + 1e-9  # the search may choose full everywhere, never worse
    grad_op = uniform_plan(units, cost, cfg, BASELINES["shard_grad_op"], world=4, lengths=LENGTHS)
    assert {u.choice.kind for u in grad_op.units} == {"grad_op"} and grad_op.state_bytes > full.state_bytes
    with pytest.raises(ValueError, match=r"every module replicate over 4 ranks does not fit: .*memory_budget_mb"):
        uniform_plan(units, cost, cfg, BASELINES["no_shard"], world=4, lengths=LENGTHS)


def test_hybrid_shard_size_tried_when_a_node_is_smaller_than_the_world():
    cfg = config(900, nodes=2, per_node=2, inter=0.05)  # a slow network between nodes
    assert shard_sizes(cfg, 4) == [4, 2]
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    plan = search_sharding(gpt_units(2), cost, cfg, world=4, lengths=LENGTHS)
    assert plan.shard_size == 2 and plan.replicas == 2
    forced = search_sharding(
        gpt_units(2), cost, config(900, nodes=2, per_node=2, inter=0.05, shard_size=4), world=4, lengths=LENGTHS
    )
    assert forced.shard_size == 4 and forced.step_ms > plan.step_ms
    with pytest.raises(ValueError, match="shard_size = 3 does not divide"):
        shard_sizes(config(shard_size=3), 4)


def test_hosts_choose_what_they_can_run():
    cfg = config(130)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    for host in ("fsdp1", "zero3"):
        plan = search_sharding(gpt_units(2), cost, cfg, world=4, lengths=LENGTHS, host=host)
        assert {u.choice.kind for u in plan.units} <= set(HOST_KINDS[host]) and plan.host == host
    assert "reshard" not in {c.kind for c in choice_columns(cfg, "fsdp1", 4)}
    with pytest.raises(ValueError, match="nothing zero3 runs"):
        choice_columns(config(choices=["keep"]), "zero3", 4)


def test_planner_takes_the_plans_model_states():
    cfg = config(500)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    spec = planner_spec(cost, cfg, dp=4, zero_stage=3, state_bytes=120 * MB)
    assert spec.memory[0].budget == 380 * MB and spec.equal_counts and spec.same_recompute
    # modules gather in step on every rank whatever the ZeRO stage says
    assert planner_spec(cost, cfg, dp=4, state_bytes=120 * MB).same_recompute
    with pytest.raises(ValueError, match="none is left for activations"):
        planner_spec(cost, cfg, dp=4, zero_stage=3, state_bytes=500 * MB)
    staged = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"stages": 2})})
    with pytest.raises(ValueError, match="pipeline.stages = 1"):
        planner_spec(cost, staged, dp=2, zero_stage=3, state_bytes=120 * MB)
    ctx = PlanningContext(cfg, cost, np.asarray(LENGTHS), 4, 1, 3, state_bytes=120 * MB)
    again = PlanningContext.from_json(ctx.to_json())
    assert again.state_bytes == 120 * MB and again.spec.memory == ctx.spec.memory


def test_search_on_48_layers_is_fast():
    """98 units (tied embedding) and an untied head that can split: pricing and the knapsack per
    shard size well under a second (about 10 ms each with the extension; see the report)."""
    cfg = DynPluginConfig.model_validate(
        {
            "cost_model": {
                "kind": "analytic",
                "dtype": "bf16",
                "model": {
                    "hidden_size": 1600,
                    "num_layers": 48,
                    "num_heads": 25,
                    "ffn_hidden_size": 6400,
                    "vocab_size": 50257,
                    "gated_mlp": False,
                },
            },
            "microbatching": {"global_tokens": 32768, "max_seq_len": 1024},
            "cluster": {"devices_per_node": 8, "num_nodes": 2, "device": {"memory_mb": 16000, "peak_tflops": 300}},
            "sharding": {"memory_budget_mb": 6000},
        }
    )
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    units = gpt_units(48, h=1600, vocab=50257)
    assert len(units) == 99
    typ = typical_step(LENGTHS * 4, cost, cfg, world=16, state_bytes=4000 * MB)  # both shard sizes fit beside it
    ordered = [units[-1]] + units[:-1]
    fwd, bwd = unit_compute(ordered, typ.component_ms)
    for n in shard_sizes(cfg, 16):
        cols = choice_columns(cfg, "fsdp2", n)
        t0 = time.perf_counter()
        pr = price(
            ordered,
            cols,
            dtype="bf16",
            world=16,
            shard_size=n,
            forward_ms=fwd,
            backward_ms=bwd,
            links=Links.of(cfg.cluster, cost.update),
        )
        sel = select(pr, 6000 * MB - typ.activation_bytes)
        assert time.perf_counter() - t0 < 1.0 and sel is not None


def test_the_plan_leaves_room_for_the_runs_longest_sequence():
    """The typical batch is one global batch; a later one may hold a longer sequence. The plan
    leaves the planner room for the run's longest sequence alone, so every later step plans."""
    from dyn_plugin.plan.methods.planner import plan_step

    cfg = config(130)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    short = [min(n, 200) for n in LENGTHS]
    plan = search_sharding(gpt_units(2), cost, cfg, world=4, lengths=short, longest=1024)
    assert plan.peak_bytes <= 130 * MB
    spec = planner_spec(cost, cfg, dp=4, zero_stage=3, state_bytes=plan.planning_state_bytes)
    step = plan_step([1024, 5, 5, 5], spec)  # the longest sequence of the run, in a later step
    assert max(mb.peak_bytes[0] for mb in step.micro_batches) + plan.state_bytes <= 130 * MB
    # told only of the typical batch, the search takes the room the longest sequence needs
    tight = search_sharding(gpt_units(2), cost, cfg, world=4, lengths=short)
    with pytest.raises(ValueError, match="length 1024.* does not fit"):
        plan_step([1024, 5, 5, 5], planner_spec(cost, cfg, dp=4, zero_stage=3, state_bytes=tight.planning_state_bytes))


def test_a_run_searches_on_lengths_capped_as_the_loader_caps_them():
    from dyn_plugin.runtime.sharding import resolve_shard_plan

    cfg = config(130)
    cost = build_cost_model(cfg.cost_model, cfg.cluster)
    long = LENGTHS + [5000, 3000, 7000]  # beyond microbatching.max_seq_len = 1024
    with pytest.raises(ValueError, match="exceeds microbatching.max_seq_len = 1024"):
        resolve_shard_plan(gpt_units(2), cfg, cost, long, world=4, host="fsdp2")
    cut = cfg.model_copy(update={"microbatching": cfg.microbatching.model_copy(update={"truncate": True})})
    plan = resolve_shard_plan(gpt_units(2), cut, cost, long, world=4, host="fsdp2")
    assert plan == resolve_shard_plan(gpt_units(2), cut, cost, np.minimum(long, 1024), world=4, host="fsdp2")


@pytest.mark.parametrize(
    "content, cause",
    [
        ("{not json", "is not valid JSON"),
        (json.dumps({"schema": SCHEMA, "version": VERSION, "units": [{"name": "layers.0"}]}), "missing key 'choice'"),
    ],
)
def test_a_corrupt_plan_file_fails_every_rank_alike(tmp_path, content, cause):
    """Rank 0 resolves the plan; any failure there is broadcast, so no rank waits for a plan forever."""
    from ranks import run

    path = tmp_path / "plan.json"
    path.write_text(content)
    codes, logs = run("shard_plan_worker.py", path, timeout=120)
    assert codes == [3, 3], logs
    said = [
        next(line.split(": ", 1)[1] for line in log.splitlines() if line.startswith(f"rank {r} raised"))
        for r, log in enumerate(logs)
    ]
    assert said[0] == said[1], said
    assert (
        f"rank 0 could not resolve the sharding plan: ValueError: sharding plan {path} is unreadable "
        f"(ValueError: sharding plan {path} "
        in said[0]
        and cause in said[0]
    )
