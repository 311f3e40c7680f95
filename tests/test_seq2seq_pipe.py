"""Encoder-decoder (T5) pipelines: execution plans whose links carry what Megatron's T5 pipeline
sends (instructions.link_shapes, checked against the cost model's link bytes), the T5 split into
an encoder stage and a decoder stage (deepspeed_ext.seq2seq_pipe), and a tiny T5 trained through
``deepspeed_ext.initialize`` on gloo ranks, exact against the unmodified model
(tests/ds_t5_pipe_worker.py): pp=2 (an encoder stage, a decoder stage), pp=4 (two a side: the
decoder links carry two tensors, the position bias tables tied) and pp=2 x dp=2 (the pp=2 runs are marked slow)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import PairStage, import_t5_tables
from dyn_plugin.plan.methods.planner import execution_plans
from dyn_plugin.plan.steps.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    check_plans,
    plan_from_json,
    plan_to_json,
)
from dyn_plugin.plan.steps.pair_planner import plan_pairs
from dyn_plugin.plan.steps.pair_spec import pair_planner_spec
from ranks import run

COST = import_t5_tables(MEASURED_DIR / "a100-t5-11b.json")
EXACT = 1e-6  # fp32, against the unmodified model on the whole global batch


def pair_plans(pp: int, dp: int):
    cfg = DynPluginConfig.model_validate(
        # two stages hold T5 11B's states only on a device larger than an A100's
        {"pipeline": {"stages": pp}, "cluster": {"device": {"memory_mb": 72000 * 8 // pp, "memory_fraction": 1.0}}}
    )
    spec = pair_planner_spec(COST, cfg, dp=dp, zero_stage=1, tp=1, split_rank=2 if pp == 4 else None)
    rng = np.random.default_rng(0)
    inputs, targets = rng.integers(8, 1500, 64).tolist(), rng.integers(4, 600, 64).tolist()
    plan = plan_pairs(inputs, targets, spec)
    return spec, plan, execution_plans(plan, COST.hidden_size, split_rank=spec.split_rank)


def test_pair_links_carry_the_encoder_output_past_the_split():
    """pp = 4 split at 2: encoder links one [n, Se, H] tensor (the last the encoder output), decoder
    links [n, Sd, H] and [n, Se, H]; the same bytes the planner simulated; gradients back in the
    same shapes; stages 0, 2 (split) and 3 load; the plans run unbuffered (rendezvous)."""
    spec, plan, plans = pair_plans(4, 2)
    h = COST.hidden_size
    assert spec.split_rank == 2 and len(plans) == 8
    for (column, stage), ep in plans.items():
        assert ep.split_rank == 2 and ep.loading_stages == (0, 2, 3)
        mbs = next(r for r in plan.replicas if column in r.columns).micro_batches
        for ins in ep.instructions:
            if ins.mb is None:
                continue
            mb = mbs[ins.mb]
            (n, se), sd = mb.shape, mb.target_shape[1]
            out_link = ((n, se, h),) if stage < 2 else ((n, sd, h), (n, se, h))
            in_link = ((n, se, h),) if stage <= 2 else ((n, sd, h), (n, se, h))
            if isinstance(ins, (SendActivation, RecvGrad)) or (isinstance(ins, ForwardPass) and stage < 3):
                assert ins.shapes == out_link, (stage, ins)
                bytes_ = sum(math.prod(s) for s in ins.shapes) * COST.act_bytes
                assert bytes_ == pytest.approx(mb.link_bytes[stage])  # what the simulator sent
            elif isinstance(ins, (RecvActivation, SendGrad, BackwardPass)):
                assert ins.shapes == (in_link if stage else ()), (stage, ins)
            elif isinstance(ins, LoadMicroBatch):
                assert ins.shapes == (((n, se),) if stage == 0 else ((n, sd),)), (stage, ins)
    check_plans(list(plans.values()), rendezvous=True)
    one = next(iter(plans.values()))
    assert plan_from_json(plan_to_json(one)) == one  # split_rank travels with the plan


def test_a_plan_whose_split_stage_does_not_load_is_refused():
    _, _, plans = pair_plans(2, 1)
    split = plans[(0, 1)]
    broken = dataclasses.replace(
        split, instructions=tuple(i for i in split.instructions if not isinstance(i, LoadMicroBatch))
    )
    with pytest.raises(ValueError, match="LoadMicroBatch of micro-batches .* missing"):
        check_plans([plans[(0, 0)], broken])


def test_seq2seq_pipe_refuses_what_it_does_not_build():
    pytest.importorskip("deepspeed")
    from deepspeed_ext.seq2seq_pipe import seq2seq_pipe
    from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm

    model = build_seq2seq_lm(dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97))
    with pytest.raises(ValueError, match="the model has 2 and 2: price the pipeline with a cost model"):
        seq2seq_pipe(model, (PairStage(encoder_layers=24, embedding=True), PairStage(decoder_layers=24, last=True)))
    mixed = (PairStage(2, 1, embedding=True), PairStage(0, 1, last=True))
    with pytest.raises(ValueError, match="encoder stages then decoder stages, one kind of layer on each"):
        seq2seq_pipe(model, mixed)


# per stage of a replica, its transfers: (instruction, tensors it moves)
ENCODER_THEN_DECODER = [[["RecvGrad", 1], ["SendActivation", 1]], [["RecvActivation", 1], ["SendGrad", 1]]]
TWO_A_SIDE = [  # split 2: the decoder stages carry their hidden states and the encoder output
    [["RecvGrad", 1], ["SendActivation", 1]],
    [["RecvActivation", 1], ["RecvGrad", 1], ["SendActivation", 1], ["SendGrad", 1]],
    [["RecvActivation", 1], ["RecvGrad", 2], ["SendActivation", 2], ["SendGrad", 1]],
    [["RecvActivation", 2], ["SendGrad", 2]],
]


@pytest.mark.parametrize(
    "world, stages, links, tied, schedule",
    [
        # the embedding on both stages (pp4 covers its links and ties, within the suite's time)
        pytest.param(2, 2, ENCODER_THEN_DECODER, 1, "auto", marks=pytest.mark.slow),
        # the embedding on three stages, each side's position bias table on its two
        (4, 4, TWO_A_SIDE, 4, "auto"),
        pytest.param(4, 2, ENCODER_THEN_DECODER, 1, "auto", marks=pytest.mark.slow),
        # backwards split into I and W (the cross-attention's keys and values deferred on the decoder stage)
        (2, 2, ENCODER_THEN_DECODER, 1, "zero_bubble"),
    ],
    ids=["pp2", "pp4", "pp2xdp2", "pp2-zero-bubble"],
)
def test_deepspeed_trains_t5_in_an_encoder_then_decoder_pipeline_exactly(
    tmp_path, world, stages, links, tied, schedule
):
    out = tmp_path / "result.json"
    codes, logs = run("ds_t5_pipe_worker.py", out, stages, world=world, env={"T5_PIPE_SCHEDULE": schedule})
    assert codes == [0] * world, logs[0][-3000:] + logs[-1][-3000:]
    report = json.loads(out.read_text())
    assert [(c["zero"], c["recompute"]) for c in report["cases"]] == [(0, "none"), (1, "full")]
    for c in report["cases"]:
        assert c["stages"] == stages and c["dp"] == world // stages, c
        assert max(c["max_abs_diff"]) <= EXACT, c  # after every step, every parameter on both stages
        assert min(c["moved"]) > 1e-3, c  # the steps changed the parameters the check compares
        # every replica's stages; a tied parameter on each stage that holds it
        assert sum(c["params_local"]) == (c["params"] + tied) * c["dp"], c
        for loss, want in c["losses"]:
            assert loss == pytest.approx(want, rel=1e-6), c
        assert c["eval_loss"] == pytest.approx(c["losses"][0][1], rel=1e-6), c  # eval_batch: forwards only
        assert sorted(i for ids in c["trained"] for i in ids) == list(range(report["samples"])), c
        assert max(c["micro_batches"]) > 1, c  # micro-batches in flight on both stages
        assert c["recompute_ran"] == c["recompute"], c
        assert c["restored_diff"] == 0.0, c  # DeepSpeed's pipeline checkpoint of the stages round-trips
        assert c["links"] == [stage for stage in links for _ in range(c["dp"])], c  # ranks stage-major
        assert (c["split"] > 0) == (schedule == "zero_bubble"), c  # the first stage's backwards ran as I and W
