import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyn_plugin.plan.steps.instructions import (
    BackwardPass,
    ExecutionPlan,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PlannedMicroBatch,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    build_execution_plans,
    check_plans,
    plan_from_json,
    plan_to_json,
)
from dyn_plugin.plan.steps.schedule import choose_schedule, one_f_one_b
from dyn_plugin.plan.steps.types import LinkSpec, MicroBatch

HIDDEN = 16


def mb(seq_lens, stages, layout="padded"):
    rows, row_len = (len(seq_lens), max(seq_lens)) if layout == "padded" else (1, sum(seq_lens))
    return MicroBatch(
        sample_ids=tuple(range(len(seq_lens))),
        seq_lens=tuple(seq_lens),
        layout=layout,
        recompute="selective",
        forward_ms=(1.0,) * stages,
        backward_ms=(2.0,) * stages,
        stored_bytes=(0.0,) * stages,
        peak_bytes=(0.0,) * stages,
        activation_bytes=0.0,
        shape=(rows, row_len),
    )


def two_stage_plans():
    mbs = [mb([4, 6], 2), mb([3], 2, layout="packed")]
    return build_execution_plans(mbs, one_f_one_b(2, 2), column=1, stage_ranks=[5, 9], hidden_size=HIDDEN)


def test_two_stage_plans_spell_out_every_step():
    first, last = two_stage_plans()
    act0, act1 = ((2, 6, HIDDEN),), ((1, 3, HIDDEN),)
    assert first.instructions == (
        LoadMicroBatch(0, 0, 0, ((2, 6),)),
        ForwardPass(0, 0, 0, act0),
        SendActivation(0, 0, 0, act0, peer=9),
        LoadMicroBatch(0, 1, 1, ((1, 3),)),
        ForwardPass(0, 1, 1, act1),
        SendActivation(0, 1, 1, act1, peer=9, batch_next=True),  # one batch: stage 1 sends grad 0 meanwhile
        RecvGrad(0, 0, 0, act0, peer=9),
        BackwardPass(0, 0, 0, ()),
        RecvGrad(0, 1, 1, act1, peer=9),
        BackwardPass(0, 1, 1, ()),
        ReduceGrads(0),
        OptimizerStep(0),
    )
    assert last.instructions == (
        RecvActivation(1, 0, 0, act0, peer=5),
        LoadMicroBatch(1, 0, 0, ((2, 6),)),  # the last stage loads the labels
        ForwardPass(1, 0, 0, ((),)),
        BackwardPass(1, 0, 0, act0),
        SendGrad(1, 0, 0, act0, peer=5, batch_next=True),  # the mirror image of stage 0's batch
        RecvActivation(1, 1, 0, act1, peer=5),
        LoadMicroBatch(1, 1, 0, ((1, 3),)),
        ForwardPass(1, 1, 0, ((),)),
        BackwardPass(1, 1, 0, act1),
        SendGrad(1, 1, 0, act1, peer=5),
        ReduceGrads(1),
        OptimizerStep(1),
    )
    assert (first.rank, first.column, first.stage, first.num_stages, first.num_buffers) == (5, 1, 0, 2, 2)
    assert (last.rank, last.num_buffers) == (9, 1)
    assert first.micro_batches[1] == PlannedMicroBatch(
        sample_ids=(0,),
        seq_lens=(3,),
        layout="packed",
        recompute="selective",
        shape=(1, 3),
        checkpointed=(),
        sp=1,
        group=1,
    )
    check_plans([first, last], rendezvous=True)


def test_buffers_reuse_the_lowest_free_slot():
    m, k = 6, 4
    plans = build_execution_plans(
        [mb([8], k)] * m, one_f_one_b(m, k), column=0, stage_ranks=range(k), hidden_size=HIDDEN
    )
    assert [p.num_buffers for p in plans] == [4, 3, 2, 1]
    forwards = [i.buffer for i in plans[1].instructions if isinstance(i, ForwardPass)]
    assert forwards == [0, 1, 2, 0, 1, 2]  # stage 1 runs F0 F1 F2 B0 F3 B1 F4 B2 F5 ...
    for plan in plans:
        by_mb = {}
        for i in plan.instructions:
            if i.mb is not None:
                by_mb.setdefault(i.mb, set()).add(i.buffer)
        assert all(len(b) == 1 for b in by_mb.values())  # one slot per micro-batch throughout


def test_instructions_are_frozen_and_typed():
    f = ForwardPass(0, 1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.mb = 2
    assert f != BackwardPass(0, 1, 0)


def test_json_is_plain_and_versioned():
    plan = two_stage_plans()[1]
    doc = json.loads(plan_to_json(plan))
    assert (doc["schema"], doc["version"]) == ("dyn_plugin.execution_plan", 6)
    assert doc["instructions"][0] == {
        "op": "RecvActivation",
        "stage": 1,
        "mb": 0,
        "buffer": 0,
        "shapes": [[2, 6, HIDDEN]],
        "peer": 5,
        "batch_next": False,
    }
    assert doc["instructions"][4]["batch_next"] is True
    assert plan_from_json(plan_to_json(plan)) == plan


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": 4}, "expected schema 'dyn_plugin.execution_plan' version 5 or 6"),
        ({"schema": "other"}, "version 5 or 6"),
    ],
)
def test_json_rejects_other_versions(change, message):
    doc = {**json.loads(plan_to_json(two_stage_plans()[0])), **change}
    with pytest.raises(ValueError, match=message):
        plan_from_json(json.dumps(doc))


def test_a_version_5_plan_reads_as_one_without_split_backwards():
    plan = two_stage_plans()[0]
    doc = {**json.loads(plan_to_json(plan)), "version": 5}
    assert plan_from_json(json.dumps(doc)) == plan


def test_json_rejects_unknown_ops():
    doc = json.loads(plan_to_json(two_stage_plans()[0]))
    doc["instructions"][2]["op"] = "SendActivationStart"
    with pytest.raises(ValueError, match="SendActivationStart"):
        plan_from_json(json.dumps(doc))


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 4),
    lens=st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=3), min_size=1, max_size=6),
    layout=st.sampled_from(["padded", "packed"]),
    data=st.data(),
)
def test_built_plans_round_trip_and_check(k, lens, layout, data):
    order = data.draw(st.permutations(range(len(lens))))
    ranks = data.draw(st.lists(st.integers(0, 99), min_size=k, max_size=k, unique=True))
    plans = build_execution_plans(
        [mb(x, k, layout) for x in lens],
        one_f_one_b(len(lens), k, order=order),
        column=3,
        stage_ranks=ranks,
        hidden_size=HIDDEN,
    )
    check_plans(plans)
    for plan in plans:
        assert plan_from_json(plan_to_json(plan)) == plan


def replace(plan: ExecutionPlan, index: int, new=None) -> ExecutionPlan:
    """``plan`` with instruction ``index`` replaced by ``new``, or dropped."""
    ins = list(plan.instructions)
    ins[index : index + 1] = [] if new is None else [new]
    return dataclasses.replace(plan, instructions=tuple(ins))


def swap(plan: ExecutionPlan, a: int, b: int) -> ExecutionPlan:
    ins = list(plan.instructions)
    ins[a], ins[b] = ins[b], ins[a]
    return dataclasses.replace(plan, instructions=tuple(ins))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda f, l: [f, replace(l, 0)], r"1 sends but 0 receives|rank 9 receives micro-batch 1"),
        (lambda f, l: [f, replace(l, 0, RecvActivation(1, 0, 0, ((2, 7, HIDDEN),), peer=5))], "shapes"),
        (lambda f, l: [f, swap(l, 0, 5)], "message 0: rank 5 sends micro-batch 0 .* rank 9 receives micro-batch 1"),
        (
            lambda f, l: [f, replace(l, 4, SendGrad(1, 0, 0, ((2, 6, HIDDEN),), peer=7))],
            "names rank 7, which has no plan",
        ),
        (lambda f, l: [f, replace(l, 1)], r"LoadMicroBatch of micro-batches \[0\]"),
        (
            lambda f, l: [replace(f, 4, ForwardPass(0, 1, 1, ((1, 3, HIDDEN),), batch_next=True)), l],
            "instruction 4 ForwardPass of micro-batch 1 is batched with the next",
        ),
        (
            lambda f, l: [replace(f, 8, RecvGrad(0, 1, 1, ((1, 3, HIDDEN),), peer=9, batch_next=True)), l],
            "instruction 8 RecvGrad of micro-batch 1 is batched with the next",
        ),
        (lambda f, l: [replace(f, 8, ForwardPass(0, 1, 1, ((1, 3, HIDDEN),))), l], "ForwardPass of micro-batches"),
        (lambda f, l: [swap(f, 1, 7), l], "BackwardPass of micro-batch 0 before its ForwardPass"),
        (lambda f, l: [replace(f, 11), l], "OptimizerStep"),
        (lambda f, l: [f, dataclasses.replace(l, rank=5)], "share a rank"),
    ],
)
def test_check_plans_catches_corruption(corrupt, message):
    first, last = two_stage_plans()
    with pytest.raises(ValueError, match=message):
        check_plans(corrupt(first, last))


def unbatched(plan: ExecutionPlan) -> ExecutionPlan:
    """The plan as the engine used to run it: every send on its own, relying on buffering."""
    return dataclasses.replace(
        plan, instructions=tuple(dataclasses.replace(i, batch_next=False) for i in plan.instructions)
    )


def test_rendezvous_finds_the_deadlock_that_buffered_sends_hide():
    # Stage 0 sends activation 1 while stage 1 sends gradient 0 back: each send waits for a
    # receive its peer only posts after its own send, which NCCL does not buffer.
    plans = [unbatched(p) for p in two_stage_plans()]
    check_plans(plans)
    with pytest.raises(
        ValueError,
        match=r"rank 5 \(stage 0\) waits forever at instruction 5 SendActivation of "
        r"micro-batch 1 with peer rank 9, which is blocked at its instruction 4 "
        r"SendGrad of micro-batch 0",
    ):
        check_plans(plans, rendezvous=True)


def test_rendezvous_waits_for_every_replica_in_the_gradient_reduction():
    one = build_execution_plans([mb([5], 1)], one_f_one_b(1, 1), column=0, stage_ranks=[0], hidden_size=HIDDEN)[0]
    other = dataclasses.replace(one, rank=1, column=1)
    check_plans([one, other], rendezvous=True)
    # rank 1 receives before its reduction a message that rank 0 only sends after its own
    early = (SendActivation(0, 0, 0, ((1, 5, HIDDEN),), peer=1),)
    late_recv = (RecvActivation(0, 0, 0, ((1, 5, HIDDEN),), peer=0),)
    ins0 = one.instructions[:-2] + one.instructions[-2:-1] + early + one.instructions[-1:]
    ins1 = other.instructions[:-2] + late_recv + other.instructions[-2:]
    check_plans([dataclasses.replace(one, instructions=ins0), dataclasses.replace(other, instructions=ins1)])
    with pytest.raises(
        ValueError,
        match=r"rank 0 \(stage 0\) waits forever at instruction 3 ReduceGrads of "
        r"micro-batch None with peer rank 1, which is blocked at its instruction 3 "
        r"RecvActivation of micro-batch 0",
    ):
        check_plans(
            [dataclasses.replace(one, instructions=ins0), dataclasses.replace(other, instructions=ins1)],
            rendezvous=True,
        )


def random_mb(data, k):
    lens = data.draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
    layout = data.draw(st.sampled_from(["padded", "packed"]))
    m = mb(lens, k, layout)
    costs = st.lists(st.floats(0.1, 10.0), min_size=k, max_size=k).map(tuple)
    stored = data.draw(st.lists(st.floats(1.0, 100.0), min_size=k, max_size=k).map(tuple))
    return dataclasses.replace(
        m, forward_ms=data.draw(costs), backward_ms=data.draw(costs), stored_bytes=stored, peak_bytes=stored
    )


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 4), dp=st.integers(1, 2), policy=st.sampled_from(["1f1b", "adaptive"]), data=st.data())
def test_every_schedule_the_planner_builds_runs_without_buffering(k, dp, policy, data):
    plans = []
    for replica in range(dp):
        mbs = [random_mb(data, k) for _ in range(data.draw(st.integers(1, 9)))]
        # budgets from "one micro-batch in flight" to "all": the adaptive search caps stages between
        budget = [data.draw(st.floats(max(m.stored_bytes[s] for m in mbs) * 2, 2000.0)) for s in range(k)]
        schedule, _ = choose_schedule(
            mbs, LinkSpec(10.0), memory_budget=budget, policy=policy, candidates=2, seed=data.draw(st.integers(0, 5))
        )
        plans += build_execution_plans(
            mbs, schedule, column=replica, stage_ranks=[s * dp + replica for s in range(k)], hidden_size=HIDDEN
        )
    check_plans(plans, rendezvous=True)


def test_a_stage_warms_up_at_most_one_more_than_its_successor():
    # stage 1 holds one micro-batch: it takes two activations before it must send a gradient
    # back, so stage 0 may not send a third first (it would wait for a receive that never comes)
    schedule = one_f_one_b(5, 4, max_in_flight=(4, 1, 1, 1))
    assert [
        sum(1 for op in ops[: ops.index(next(o for o in ops if o.kind == "B"))]) - 1 for ops in schedule.stages
    ] == [1, 0, 0, 0]
    plans = build_execution_plans([mb([4], 4)] * 5, schedule, column=0, stage_ranks=range(4), hidden_size=HIDDEN)
    check_plans(plans, rendezvous=True)


def test_rendezvous_replays_a_sequence_parallel_group_as_collectives():
    # columns 0 and 1 form one group of 2 at both stages: each micro-batch's forward and backward
    # is an attention collective of the stage's two columns, so they must run the same order
    mbs = [dataclasses.replace(mb([4, 6], 2), sp=2), dataclasses.replace(mb([8], 2), sp=2)]

    def column(c, order):
        return build_execution_plans(
            mbs, one_f_one_b(2, 2, order=order), column=c, stage_ranks=[c, 2 + c], hidden_size=HIDDEN, group=0
        )

    assert column(0, [0, 1])[0].instructions[1].shapes == ((2, 3, HIDDEN),)  # each rank's half of the rows
    check_plans(column(0, [0, 1]) + column(1, [0, 1]), rendezvous=True)
    # each column alone pairs its transfers (buffered or not); together the group's collectives cross
    crossed = column(0, [0, 1]) + column(1, [1, 0])
    check_plans(crossed)
    with pytest.raises(
        ValueError,
        match=r"rank 0 \(stage 0\) waits forever at instruction 1 ForwardPass of "
        r"micro-batch 0 with peer rank 1, which is blocked at its instruction 1 "
        r"ForwardPass of micro-batch 1",
    ):
        check_plans(crossed, rendezvous=True)
    with pytest.raises(ValueError, match=r"group of columns \[0, 1\], but some of them have no plan at stage 0"):
        check_plans(column(0, [0, 1]), rendezvous=True)
