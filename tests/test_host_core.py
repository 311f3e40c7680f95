"""The host-neutral core: the rank layout, the checkpoint protocol, typed planned micro-batches."""

import json
import os
from pathlib import Path

import pytest

from dyn_plugin import atomic
from dyn_plugin.device import DTYPE_NAMES, DTYPES, dtype_name, local_rank, training_dtype
from dyn_plugin.host import checkpoint
from dyn_plugin.layout import RankLayout
from dyn_plugin.plan.steps.instructions import PlannedMicroBatch, build_execution_plans, plan_from_json, plan_to_json
from dyn_plugin.plan.steps.schedule import one_f_one_b
from dyn_plugin.plan.steps.types import MicroBatch


@pytest.mark.parametrize(
    "world,stages,tp", [(1, 1, 1), (4, 1, 1), (4, 2, 1), (6, 3, 1), (8, 4, 1), (3, 3, 1), (8, 2, 2), (12, 3, 2)]
)
def test_layout_numbers_ranks_stage_major_and_round_trips(world, stages, tp):
    layout = RankLayout(world, stages, tp)
    assert layout.columns * layout.stages * layout.tp == world
    for rank in range(world):
        stage, column, replica = layout.coords(rank)
        assert layout.rank_of(stage, column, replica) == rank == (stage * layout.columns + column) * tp + replica
    every = [(s, c, r) for s in range(stages) for c in range(layout.columns) for r in range(tp)]
    assert sorted(r for s, _, t in {(s, 0, t) for s, _, t in every} for r in layout.stage_ranks(s, replica=t)) == list(
        range(world)
    )
    assert sorted(r for c, t in {(c, t) for _, c, t in every} for r in layout.column_ranks(c, replica=t)) == list(
        range(world)
    )
    for c in range(layout.columns):
        assert [layout.coords(r) for r in layout.column_ranks(c)] == [(s, c, 0) for s in range(stages)]


def test_tensor_parallel_ranks_are_innermost_as_megatron_numbers_them():
    """Megatron's default order (tp, then dp, then pp): a cell's tensor-parallel ranks are neighbours."""
    layout = RankLayout.of(columns=2, stages=2, tp=2)
    assert layout.world == 8
    assert [layout.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert layout.stage_ranks(1, replica=1) == [5, 7]  # stage 1's data-parallel ranks of tensor-parallel rank 1
    assert layout.column_ranks(1) == [2, 6]
    with pytest.raises(ValueError, match=r"replica 2 is not in \[0, tp=2\)"):
        layout.rank_of(0, 0, 2)
    with pytest.raises(ValueError, match=r"pipeline\.stages = 3 does not divide the 4 cells \(8 ranks, tp 2\)"):
        RankLayout(8, 3, tp=2)


def test_the_layout_from_the_config_takes_its_stages_and_the_hosts_tp():
    from dyn_plugin.config import load_config

    plugin = load_config({"dyn_plugin": {"pipeline": {"stages": 2}}}).plugin
    assert RankLayout.from_config(8, plugin, tp=2) == RankLayout(8, stages=2, tp=2)
    with pytest.raises(ValueError, match=r"pipeline\.stages = 2 does not divide the 3"):
        RankLayout.from_config(3, plugin)


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


def _record(position: int) -> "checkpoint.Record":
    return checkpoint.Record(position, {"epoch": 0, "step": position}, {"world_size": 2})


def _save(root, tag: str, position: int, data: bytes = b"weights") -> None:
    with checkpoint.saving(root, tag, _record(position)) as save:
        (Path(save.directory) / "model.pt").write_bytes(data)  # the host's files


def test_a_checkpoint_is_whole_only_once_committed(tmp_path, monkeypatch, caplog):
    first, second = tmp_path / "step3", tmp_path / "step5"
    _save(tmp_path, "step3", 3)
    _save(tmp_path, "step5", 5)
    assert sorted(os.listdir(second)) == sorted(["model.pt", checkpoint.MARKER])  # no temporary file left
    assert checkpoint.agreed_newest(tmp_path).path == str(second)
    assert checkpoint.read(second).loader == {"epoch": 0, "step": 5}

    # a save killed between the host's files and the marker: the directory is skipped, named
    (tmp_path / "step7").mkdir()
    (tmp_path / "step7" / "model.pt").write_bytes(b"half")
    # a save into a re-used directory, killed before its commit: prepare took the old marker away,
    # so the old checkpoint's files, half replaced, never pass for it
    checkpoint.release(checkpoint.prepare(tmp_path, "step5", _record(5)))
    with caplog.at_level("WARNING"):
        assert checkpoint.agreed_newest(tmp_path).path == str(first)
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "step7 has no" in skipped
    assert os.listdir(second) == []  # the re-save cleared it, marker first

    # a crash while writing the marker leaves none: the checkpoint stays incomplete, not half-published
    def crash(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(checkpoint.CheckpointError, match="step5 was not saved: rank 0: writing the marker: .*No space"):
        _save(tmp_path, "step5", 5)
    monkeypatch.undo()
    assert os.listdir(second) == ["model.pt"]
    assert checkpoint.agreed_newest(tmp_path).path == str(first)
    assert checkpoint.agreed_newest(tmp_path / "elsewhere") is None
    with pytest.raises(RuntimeError, match="step5 is not whole: it has no dyn_plugin_checkpoint.json"):
        checkpoint.agreed_newest(tmp_path, "step5")  # named, an incomplete checkpoint is refused


def test_a_resume_says_what_changed_before_training():
    saved = {"config_sha256": "a", "world_size": 4, "stages": 1, "columns": 4, "tp": 1}
    assert checkpoint.differences(saved, dict(saved)) == []
    now = {**saved, "config_sha256": "b", "world_size": 2, "columns": 2}
    assert checkpoint.differences(saved, now) == [
        "the dyn_plugin config changed",
        "ranks: 4 -> 2",
        "data-parallel columns: 4 -> 2",
    ]


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


def test_restore_moves_the_loader_and_warns_of_what_changed(caplog):
    from dyn_plugin.runtime.loader import DynLoader
    from test_loader import make

    cfg, cm, lens, data = make()
    saved = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=3)
    next(iter(saved))
    record = checkpoint.Record.of(saved)
    same = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=3)
    with caplog.at_level("WARNING"):
        checkpoint.restore(same, checkpoint.Checkpoint("ckpt", record.position, record.loader, record.run))
    assert same.step == 1 and not caplog.records
    # where plans travel (the store, a password in its URL, the loader's settings) is not what they are
    travel = cfg.model_copy(
        update={
            "loader": cfg.loader.model_copy(update={"prefetch": 7}),
            "store": cfg.store.model_copy(update={"url": "redis://:hunter2@host:6379/0"}),
        }
    )
    assert checkpoint.run_identity(DynLoader(data, lengths=lens, config=travel, cost_model=cm, seed=3)) == record.run
    assert "hunter2" not in json.dumps(record.run)
    mb = cfg.microbatching.model_copy(update={"pad_multiple": cfg.microbatching.pad_multiple * 2})
    other_cfg = cfg.model_copy(update={"microbatching": mb})
    other = DynLoader(data, lengths=lens, config=other_cfg, cost_model=cm, seed=3)
    with caplog.at_level("WARNING"):
        checkpoint.restore(other, checkpoint.Checkpoint("ckpt", record.position, record.loader, record.run))
    assert other.step == 1 and "resuming from ckpt with the dyn_plugin config changed" in caplog.text
