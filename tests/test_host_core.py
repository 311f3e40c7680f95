"""The host-neutral core: the rank layout, the loader-position file, typed planned micro-batches."""

import json
import os

import pytest

from dyn_plugin import atomic
from dyn_plugin.device import DTYPE_NAMES, DTYPES, dtype_name, local_rank, training_dtype
from dyn_plugin.host import checkpoint
from dyn_plugin.layout import RankLayout
from dyn_plugin.plan.instructions import PlannedMicroBatch, build_execution_plans, plan_from_json, plan_to_json
from dyn_plugin.plan.schedule import one_f_one_b
from dyn_plugin.plan.types import MicroBatch


@pytest.mark.parametrize("world,stages", [(1, 1), (4, 1), (4, 2), (6, 3), (8, 4), (3, 3)])
def test_layout_numbers_ranks_stage_major_and_round_trips(world, stages):
    layout = RankLayout(world, stages)
    assert layout.columns * layout.stages == world
    for rank in range(world):
        stage, column = layout.coords(rank)
        assert layout.rank_of(stage, column) == rank == stage * layout.columns + column
    assert sorted(r for s in range(stages) for r in layout.stage_ranks(s)) == list(range(world))
    assert sorted(r for c in range(layout.columns) for r in layout.column_ranks(c)) == list(range(world))
    for c in range(layout.columns):
        assert [layout.coords(r) for r in layout.column_ranks(c)] == [(s, c) for s in range(stages)]


def test_layout_groups_and_rejections():
    layout = RankLayout.of(4, 2)
    assert (layout.world, layout.columns) == (8, 4)
    assert layout.stage_ranks(1, first=2, size=2) == [6, 7]  # a sequence-parallel pair at stage 1
    assert layout.column_ranks(3) == [3, 7]
    with pytest.raises(ValueError, match=r"dyn_plugin\.pipeline\.stages = 3 does not divide the 8 ranks"):
        RankLayout(8, 3)
    with pytest.raises(ValueError, match="outside the layout"):
        layout.rank_of(2, 0)
    with pytest.raises(ValueError, match="outside the 8 ranks"):
        layout.coords(8)
    with pytest.raises(ValueError):
        RankLayout(0)
    with pytest.raises(AttributeError):
        layout.world = 4  # frozen


def test_loader_state_round_trips_and_replaces_atomically(tmp_path, monkeypatch):
    state = {"version": 1, "epoch": 2, "step": 5, "seed": 7, "fingerprint": "abc"}
    directory = tmp_path / "step5"  # not made yet: the writer makes it
    path = checkpoint.write_loader_state(directory, state)
    assert path == os.path.join(directory, checkpoint.LOADER_STATE)
    assert checkpoint.read_loader_state(directory) == state
    assert os.listdir(directory) == [checkpoint.LOADER_STATE]  # no temporary file left behind

    # a crash while writing the new state leaves the old file whole
    def crash(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_loader_state(directory, {**state, "step": 6})
    monkeypatch.undo()
    assert checkpoint.read_loader_state(directory) == state
    assert os.listdir(directory) == [checkpoint.LOADER_STATE]  # the temporary file removed
    with pytest.raises(FileNotFoundError):
        checkpoint.read_loader_state(tmp_path / "elsewhere")


def test_device_helpers(monkeypatch):
    assert {DTYPE_NAMES[t]: n for n, t in DTYPES.items()} == {n: n for n in DTYPES}
    assert dtype_name(DTYPES["bf16"]) == "bf16" and dtype_name(object()) is None
    assert training_dtype({"bf16": {"enabled": True}}) == "bf16"
    assert training_dtype({"fp16": {"enabled": True}}) == "fp16"
    assert training_dtype({}) == "fp32"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3


def _plan():
    mbs = [
        MicroBatch(
            sample_ids=(i,),
            seq_lens=(n,),
            layout="packed",
            recompute="full",
            forward_ms=(1.0, 1.0),
            backward_ms=(2.0, 2.0),
            stored_bytes=(0.0, 0.0),
            peak_bytes=(0.0, 0.0),
            activation_bytes=0.0,
            shape=(1, n),
            checkpointed=(1, 2),
        )
        for i, n in enumerate((3, 5))
    ]
    return build_execution_plans(mbs, one_f_one_b(2, 2), column=1, stage_ranks=[1, 3], hidden_size=8)[0]


def test_planned_micro_batches_are_typed_and_round_trip():
    plan = _plan()
    mb = plan.micro_batches[1]
    assert isinstance(mb, PlannedMicroBatch)
    fields = (mb.sample_ids, mb.seq_lens, mb.shape, mb.checkpointed, mb.sp, mb.group)
    assert fields == ((1,), (5,), (1, 5), (1, 2), 1, 1)
    assert plan_from_json(plan_to_json(plan)) == plan
    with pytest.raises(AttributeError):
        _ = mb.seq_len  # a misspelled field fails where it is read
    with pytest.raises(AttributeError):
        mb.sp = 2  # frozen


def test_unknown_or_missing_micro_batch_fields_are_refused():
    doc = json.loads(plan_to_json(_plan()))
    doc["micro_batches"][0]["seq_len"] = [3]
    with pytest.raises(ValueError, match=r"unknown fields \['seq_len'\]"):
        plan_from_json(json.dumps(doc))
    doc = json.loads(plan_to_json(_plan()))
    del doc["micro_batches"][0]["group"]
    with pytest.raises(ValueError, match=r"missing fields \['group'\]"):
        plan_from_json(json.dumps(doc))
