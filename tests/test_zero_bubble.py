"""Zero-bubble schedules for variable micro-batches (plan/steps/zero_bubble.py): backwards split
into I (the input's gradient, sent upstream) and W (the weights' gradient, placed in the waits),
as the simulator runs them, the planner prices and picks them, the plans compile, and which hosts
run them (DeepSpeed's pipeline, exactly: tests/test_deepspeed_ext.py; the split itself:
dyn_plugin/models/split_backward.py, below)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.config import ConfigError, DynPluginConfig
from dyn_plugin.cost.bundled import load_bundled
from dyn_plugin.cost.profile import cost_model_from_profile
from dyn_plugin.host import support
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.methods.planner import execution_plans, plan_step
from dyn_plugin.plan.steps.bounds import ideal_ms
from dyn_plugin.plan.steps.instructions import build_execution_plans, check_plans
from dyn_plugin.plan.steps.pricing import make_micro_batch
from dyn_plugin.plan.steps.schedule import choose_schedule, one_f_one_b
from dyn_plugin.plan.steps.simulator import memory_steps, simulate
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.plan.steps.trace import chrome_trace
from dyn_plugin.plan.steps.types import LinkSpec, MicroBatch, Op, Schedule
from dyn_plugin.plan.steps.zero_bubble import _deferred, fill_waits, split_backward
from dyn_plugin.runtime.sampler import global_batches

LINK = LinkSpec(gb_per_s=25.0)


def mb(fwd, stages, *, weight=None, stored=1.0, deferred=None):
    """Forward ``fwd`` and backward twice that on every stage, a third of the backward W."""
    return MicroBatch(
        sample_ids=(0,),
        seq_lens=(8,),
        layout="packed",
        recompute="none",
        forward_ms=(fwd,) * stages,
        backward_ms=(2 * fwd,) * stages,
        stored_bytes=(stored,) * stages,
        peak_bytes=(stored,) * stages,
        activation_bytes=1e3,
        shape=(1, 8),
        weight_ms=(2 * fwd / 3 if weight is None else weight,) * stages,
        deferred_bytes=((stored if deferred is None else deferred),) * stages,
    )


def ops(stage):
    return " ".join(f"{op.kind}{op.mb}" for op in stage)


def test_the_gradient_goes_upstream_after_i_not_after_the_whole_backward():
    two = [mb(3.0, 2)]
    whole = simulate(two, one_f_one_b(1, 2), LINK, record=True)
    split = Schedule("zero_bubble", (0,), ((Op("F", 0), Op("I", 0), Op("W", 0)), (Op("F", 0), Op("I", 0), Op("W", 0))))
    result = simulate(two, split, LINK, record=True)
    sent = {e[0]: e[3] for e in result.events if e[1] == "send-bwd"}
    sent_whole = {e[0]: e[3] for e in whole.events if e[1] == "send-bwd"}
    assert sent[1] == pytest.approx(sent_whole[1] - 2.0)  # I is the backward less its W (2 ms)
    assert result.makespan_ms < whole.makespan_ms  # stage 0's work starts sooner; the total work is the same
    assert {e[2][0] for e in result.events if e[1] == "compute"} == {"F", "I", "W"}


def test_a_deferred_w_holds_its_bytes_in_place_of_the_stored_ones_until_it_runs():
    mbs = [mb(1.0, 1, stored=10.0, deferred=4.0), mb(1.0, 1, stored=10.0, deferred=4.0)]
    stage = [Op("F", 0), Op("I", 0), Op("F", 1), Op("I", 1), Op("W", 0), Op("W", 1)]
    after = [a for _, a in memory_steps(mbs, stage, 0)]
    assert after == [10.0, 4.0, 14.0, 8.0, 4.0, 0.0]


@pytest.mark.parametrize(
    "stage, message",
    [
        ([Op("F", 0), Op("W", 0), Op("I", 0)], "W0 comes before I0"),
        ([Op("F", 0), Op("B", 0), Op("I", 0), Op("W", 0)], "runs both B and I"),
        ([Op("F", 0), Op("I", 0)], "op W0 is missing"),
    ],
)
def test_a_split_schedule_that_cannot_run_is_refused(stage, message):
    with pytest.raises(ValueError, match=message):
        simulate([mb(1.0, 1)], Schedule("x", (0,), (tuple(stage),)), LINK)


def test_a_split_needs_the_micro_batch_priced_for_it():
    bare = replace(mb(1.0, 1), weight_ms=(), deferred_bytes=())
    with pytest.raises(ValueError, match="not priced"):
        simulate([bare], Schedule("x", (0,), ((Op("F", 0), Op("I", 0), Op("W", 0)),)), LINK)
    assert split_backward([bare], one_f_one_b(1, 1), LINK) is None


def test_deferral_keeps_the_f_and_i_order_and_caps_the_pending_ws():
    stage = one_f_one_b(4, 2).stages[1]
    assert ops(_deferred(stage, 0)) == "F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3"
    assert ops(_deferred(stage, 1)) == "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"
    assert ops(_deferred(stage, 4)) == "F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3"


def variable(times, stages):
    return [mb(t, stages) for t in times]


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(2, 4),
    times=st.lists(st.floats(0.5, 20.0), min_size=1, max_size=9),
    cap=st.integers(0, 9),
)
def test_filling_the_waits_never_lengthens_the_step(k, times, cap):
    mbs = variable(times, k)
    base = one_f_one_b(len(mbs), k)
    deferred = Schedule("zero_bubble", base.order, tuple(_deferred(ops, cap) for ops in base.stages))
    before = simulate(mbs, deferred, LINK)
    filled, result = fill_waits(mbs, deferred, LINK)
    assert result.makespan_ms <= before.makespan_ms * (1 + 1e-9)
    assert all(a <= b * (1 + 1e-9) for a, b in zip(result.peak_bytes, before.peak_bytes))  # W's only move earlier
    for original, moved in zip(deferred.stages, filled.stages):  # the F and I order is kept: sends still pair
        assert [o for o in original if o.kind != "W"] == [o for o in moved if o.kind != "W"]
    plans = build_execution_plans(mbs, filled, column=0, stage_ranks=list(range(k)), hidden_size=8)
    check_plans(plans, rendezvous=True)  # and the W's in between hang nothing under NCCL


@settings(max_examples=30, deadline=None)
@given(k=st.integers(2, 4), times=st.lists(st.floats(0.5, 20.0), min_size=2, max_size=8))
def test_a_split_schedule_fits_the_budget_its_unsplit_schedule_fits(k, times):
    mbs = variable(times, k)
    schedule, unsplit = choose_schedule(mbs, LINK, memory_budget=[3.0] * k)
    split, result = split_backward(mbs, schedule, LINK, [3.0] * k)
    assert max(result.peak_bytes) <= 3.0
    assert result.makespan_ms <= unsplit.makespan_ms * (1 + 1e-9)


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
    batches = [[int(lengths[i]) for i in b] for b in global_batches(lengths, 65536, 4, 0)]
    return spec, batches


def test_w_is_the_forwards_per_token_part_and_its_share_falls_as_sequences_grow(a100):
    spec, _ = a100
    short, long = (make_micro_batch([0], [n], spec=spec, layout="packed", recompute="none") for n in (512, 8192))
    for m in (short, long):
        assert all(0 < w < b for w, b in zip(m.weight_ms, m.backward_ms))
    assert long.weight_ms[1] / long.backward_ms[1] < short.weight_ms[1] / short.backward_ms[1]
    # held until W: each linear layer's input and output gradient, 16h values a token for GPT's 12h^2 weights
    layers = spec.stages[1].num_layers
    assert long.deferred_bytes[1] == pytest.approx(2 * 8192 * 16 * 4096 * layers, rel=0.01)
    plain = make_micro_batch([0], [512], spec=replace(spec, schedule="auto"), layout="packed", recompute="none")
    assert plain.weight_ms == () and plain.deferred_bytes == ()  # priced only when a schedule may split


def test_the_planner_fills_the_bubbles_within_memory(a100):
    spec, batches = a100
    for lengths in batches:
        plain = plan_step(lengths, replace(spec, schedule="auto"))
        split = plan_step(lengths, spec)
        assert split.iteration_ms < plain.iteration_ms
        assert {r.schedule.name for r in split.replicas} == {"zero_bubble"}
        for rep in split.replicas:
            assert all(p <= m.budget for p, m in zip(rep.sim.peak_bytes, spec.memory))
        assert split.iteration_ms / ideal_ms(lengths, spec) < 0.95 * plain.iteration_ms / ideal_ms(lengths, spec)


def test_removing_the_deferred_ws_loses_the_gain(a100):
    """The gain is the W's placement: the same split with each W right after its I, as an
    executor that ran them at once would, is slower than the plan."""
    spec, batches = a100
    plan = plan_step(batches[0], spec)
    rep = plan.replicas[0]
    undeferred = Schedule(
        "x", rep.schedule.order, tuple(_deferred([o for o in ops if o.kind != "W"], 0) for ops in rep.schedule.stages)
    )
    at_once = simulate(rep.micro_batches, Schedule("x", undeferred.order, tuple(
        tuple(Op("B", o.mb) if o.kind == "I" else o for o in ops) for ops in undeferred.stages
    )), spec.link)  # fmt: skip
    assert rep.sim.makespan_ms < 0.97 * at_once.makespan_ms
    trace = chrome_trace(simulate(rep.micro_batches, rep.schedule, spec.link, record=True), rep.micro_batches)
    assert {e["name"][0] for e in trace["traceEvents"] if e.get("cat") == "compute"} == {"F", "I", "W"}


def test_deepspeeds_pipeline_runs_a_split_in_fp32_and_bf16_and_megatron_without_sequence_groups():
    plugin = DynPluginConfig.model_validate({"pipeline": {"stages": 2, "schedule": "zero_bubble"}})
    support.check("DeepSpeed pipeline", support.Run(plugin, precision="fp32"))
    support.check("DeepSpeed pipeline", support.Run(plugin, zero_stage=1, precision="bf16"))
    with pytest.raises(ConfigError, match="pipeline.schedule 'zero_bubble' in fp16 on DeepSpeed pipeline: .*bf16"):
        support.check("DeepSpeed pipeline", support.Run(plugin, precision="fp16"))
    # DeepSpeed's bf16 optimizer cannot load a pipeline checkpoint it saved under ZeRO-0: refused before training
    with pytest.raises(
        ConfigError, match="bf16.enabled with zero_optimization.stage 0 on DeepSpeed pipeline: .*stage to 1"
    ):
        support.check("DeepSpeed pipeline", support.Run(plugin, zero_stage=0, precision="bf16"))
    support.check("DeepSpeed", support.Run(plugin, zero_stage=0, precision="bf16"))
    grouped = DynPluginConfig.model_validate(
        {"pipeline": {"stages": 2, "schedule": "zero_bubble"}, "sequence_parallel": {"enabled": True}}
    )
    for host in ("megatron-core", "Megatron-LM"):
        support.check(host, support.Run(plugin, precision="bf16"))  # the plugin's executor, any precision
        with pytest.raises(
            ConfigError, match="pipeline.schedule 'zero_bubble' on .*sequence_parallel.enabled to false"
        ):
            support.check(host, support.Run(grouped))


def test_split_plans_compile_to_instructions_that_run_under_nccl_and_read_back(a100):
    """Every rank's instructions of the planner's split plans: each micro-batch's BackwardInput
    then its BackwardWeight, the W's right after the exchange before them is posted, replayed with
    unbuffered sends (check_plans rendezvous) and read back from JSON."""
    from dyn_plugin.plan.steps.instructions import (
        BackwardInput,
        BackwardWeight,
        SendGrad,
        check_plans,
        plan_from_json,
        plan_to_json,
    )

    spec, batches = a100
    for lengths in batches:
        every = list(execution_plans(plan_step(lengths, spec), spec.hidden_size).values())
        check_plans(every, rendezvous=True)
        kinds = [type(i) for p in every for i in p.instructions]
        assert kinds.count(BackwardInput) == kinds.count(BackwardWeight) > 0
        for p in every:
            for n, ins in enumerate(p.instructions[:-1]):
                if isinstance(ins, SendGrad) and ins.batch_next:
                    assert not isinstance(p.instructions[n + 1], BackwardWeight)  # a send stays batched
            assert plan_from_json(plan_to_json(p)) == p


def test_a_split_plan_without_its_weight_gradients_is_refused(a100):
    from dyn_plugin.plan.steps.instructions import BackwardWeight, check_plans

    spec, batches = a100
    every = list(execution_plans(plan_step(batches[0], spec), spec.hidden_size).values())
    dropped = replace(
        every[0], instructions=tuple(i for i in every[0].instructions if not isinstance(i, BackwardWeight))
    )
    with pytest.raises(ValueError, match="without their BackwardWeight"):
        check_plans([dropped, *every[1:]])


def test_a_split_linear_layer_gives_the_whole_backwards_gradients_with_recompute():
    """The host side: I returns the input's gradient and no weight gradient (no accumulation hook
    fires), W the weights' through autograd (each hook once), equal to one whole backward, with
    the layers recomputed in backward too."""
    import torch
    import torch.utils.checkpoint as cp
    from torch import nn

    from dyn_plugin.models.split_backward import split_backward as split_of

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8, bias=False), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.down(torch.tanh(self.up(x))))

    for recompute in (False, True):
        torch.manual_seed(0)
        net, ref = nn.ModuleList([Block(), Block()]), nn.ModuleList([Block(), Block()])
        ref.load_state_dict(net.state_dict())

        def run(model, x):
            for block in model:
                x = cp.checkpoint(block, x, use_reentrant=False) if recompute else block(x)
            return x

        x, grad = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 5, 8)
        run(ref, x.detach().clone().requires_grad_()).backward(grad)
        fired = []
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
        split = split_of(net)
        with split.deferring("mb"):
            run(net, x).backward(grad)
        linear = {id(p) for m in split.linears for p in m.parameters()}
        assert x.grad is not None and all(p.grad is None for p in net.parameters() if id(p) in linear)
        assert {id(p) for p in fired} == {id(p) for p in net.parameters()} - linear
        split.weights("mb")
        assert len(fired) == len(list(net.parameters())) and not split.pending
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))

    class Scaled(nn.Linear):  # a linear layer with a forward of its own (as LoRA's) keeps it
        def forward(self, x):
            return 2 * super().forward(x)

    own = nn.Sequential(Scaled(4, 4), nn.Linear(4, 4))
    assert split_of(own).linears == [own[1]] and "forward" not in vars(own[0])
