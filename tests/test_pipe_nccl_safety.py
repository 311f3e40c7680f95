"""What gloo forgives and NCCL does not: collectives on device tensors, no host read per
micro-batch, point-to-point exchanges that cannot wait on each other, the training dtype."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import deepspeed_ext
from dyn_plugin.plan.steps.instructions import (
    ExecutionPlan,
    LoadMicroBatch,
    OptimizerStep,
    PlannedMicroBatch,
    ReduceGrads,
)
from dyn_plugin.runtime.collate import collate
from dyn_plugin.runtime.loader import Step

# Every way a tensor's value reaches the host.
HOST_READS = ("item", "cpu", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


class FakeEngine:
    """A data-parallel DeepSpeed engine on the "meta" device: no tensor has a value to read."""

    device = torch.device("meta")

    def __init__(self):
        self.backwards = []
        self.module = torch.nn.Module()  # one decoder layer, for the recompute switch (no mode is set)
        self.module.layer = torch.nn.Module()
        self.module.layer.self_attn = torch.nn.Identity()

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        pass

    def __call__(self, *, input_ids, labels, use_cache, **_):
        assert input_ids.device == self.device and labels.device == self.device
        return SimpleNamespace(loss=torch.ones((), device=self.device, requires_grad=True) * 2.0)

    def backward(self, loss, scale_wrt_gas):
        self.backwards.append(loss)

    def step(self):
        pass


def _step(seq_lens_per_mb):
    descs = tuple(
        PlannedMicroBatch(
            sample_ids=tuple(range(len(lens))),
            seq_lens=tuple(lens),
            layout="padded",
            recompute="none",
            shape=(len(lens), max(lens)),
            checkpointed=(),
            sp=1,
            group=0,
        )
        for lens in seq_lens_per_mb
    )
    plan = ExecutionPlan(
        rank=0,
        column=0,
        stage=0,
        num_stages=1,
        num_buffers=1,
        micro_batches=descs,
        instructions=tuple(LoadMicroBatch(0, m, 0) for m in range(len(descs))) + (ReduceGrads(0), OptimizerStep(0)),
    )
    data = [torch.arange(1, 40)] * 8
    mbs = [collate(d.sample_ids, d.seq_lens, "padded", d.shape, data.__getitem__) for d in descs]
    return Step(0, 0, plan, mbs, [list(d.sample_ids) for d in descs], scored_tokens=50, digest="x", predicted_ms=0.0)


def test_train_step_keeps_collectives_on_the_device_and_reads_the_host_once(monkeypatch):
    reads, reduced = [], []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            reads.append(_name)
            # a meta tensor has no value: the one allowed read gets a stand-in
            return 0.0 if self.is_meta and _name == "__float__" else _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: reduced.append(t.device))
    engine = FakeEngine()
    deepspeed_ext.train_step(engine, _step([[5, 7], [12], [3, 4, 9]]))
    assert len(engine.backwards) == 3
    assert reduced == [torch.device("meta")]
    assert reads == ["__float__"], "one host read, for the returned loss, whatever the micro-batch count"


# within the suite's time: bf16 (a GPU run's precision); fp32 with the slow tests
@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_pipeline_engine_takes_a_data_iterator_and_evaluates_forward_only(tmp_path, dtype):
    import json

    from ranks import run

    out = tmp_path / "result.json"
    codes, logs = run("ds_pipe_eval_worker.py", out, dtype, world=2)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    r = json.loads(out.read_text())
    assert r["micro_batches"] > 1, r
    assert r["eval_left_params"] and r["train_moved_params"], r
    # the same step before any update: the forward-only loss is the training step's loss
    assert r["eval_loss"] == pytest.approx(r["train_loss"], rel=1e-6), r
    assert r["second_loss"] != r["train_loss"], r
    assert "data_iter must yield the loader's Steps" in r["refused"], r
    want = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    assert r["act_dtype"] == want and r["received_dtypes"] == [[want], [want]], r


LLAMA = SimpleNamespace(
    config=SimpleNamespace(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=100,
        model_type="llama",
        hidden_act="silu",  # a SwiGLU MLP, as a LlamaConfig says (cost/shape.py)
    )
)


def _loaded(ds: dict, cost_model: dict):
    from dyn_plugin.config import load_config

    return load_config({**ds, "dyn_plugin": {"cost_model": cost_model}})


@pytest.mark.parametrize(
    "ds, dtype", [({}, "fp32"), ({"bf16": {"enabled": True}}, "bf16"), ({"fp16": {"enabled": True}}, "fp16")]
)
def test_the_cost_model_prices_the_precision_deepspeed_trains_in(ds, dtype):
    cost = deepspeed_ext.engine.cost_model_for(_loaded(ds, {"kind": "analytic"}), LLAMA)
    assert cost.dtype == dtype
    fp32 = deepspeed_ext.engine.cost_model_for(_loaded({}, {"kind": "analytic"}), LLAMA)
    stored = [c.table("padded", "none", 1).fits["layer"]["stored_bytes"].coef for c in (cost, fp32)]
    assert (stored[0] == stored[1]) == (dtype == "fp32")  # activation bytes per element follow the dtype


@pytest.mark.parametrize(
    "ds, dtype, field",
    [
        ({"bf16": {"enabled": True}}, "fp32", "bf16.enabled is true"),
        ({}, "bf16", "neither bf16.enabled nor fp16.enabled is true"),
    ],
)
def test_a_cost_model_dtype_other_than_deepspeeds_is_refused(ds, dtype, field):
    with pytest.raises(
        ValueError,
        match=rf"dyn_plugin.cost_model.dtype is '{dtype}' but the DeepSpeed config .*"
        rf"\({field}\).*set it to",
    ):
        deepspeed_ext.engine.cost_model_for(_loaded(ds, {"kind": "analytic", "dtype": dtype}), LLAMA)


def test_a_profile_measured_in_another_precision_is_refused():
    profile = {"kind": "profile", "profile": "a100-gpt-6.7b"}  # measured in fp16
    assert deepspeed_ext.engine.cost_model_for(_loaded({"fp16": {"enabled": True}}, profile), LLAMA).dtype == "fp16"
    with pytest.raises(
        ValueError,
        match=r"'a100-gpt-6.7b' was measured in fp16 \(its model.dtype\), but "
        r"dyn_plugin.cost_model.dtype is 'bf16'",
    ):
        deepspeed_ext.engine.cost_model_for(_loaded({"bf16": {"enabled": True}}, profile), LLAMA)


def test_a_cost_model_argument_in_another_precision_is_refused_before_training():
    cost = deepspeed_ext.engine.cost_model_for(_loaded({"bf16": {"enabled": True}}, {"kind": "analytic"}), LLAMA)
    with pytest.raises(ValueError, match=r"cost_model argument's dtype is 'bf16' .* trains in fp32"):
        deepspeed_ext.initialize(model=LLAMA, config={"dyn_plugin": {}}, dataset=[], lengths=[], cost_model=cost)


def test_every_planned_step_is_replayed_without_buffering(monkeypatch):
    import dataclasses

    import numpy as np

    import dyn_plugin.plan.methods.planner as planner
    from dyn_plugin.config import load_config
    from dyn_plugin.cost.from_config import build_cost_model
    from dyn_plugin.runtime.planning import PlanningContext

    cfg = load_config(
        {
            "dyn_plugin": {
                "cost_model": {"kind": "profile", "profile": "a100-gpt-6.7b"},
                "pipeline": {"stages": 4},
                "cluster": {"device": {"memory_mb": 80000}},
                "microbatching": {"global_tokens": 16384},
            }
        }
    ).plugin
    lengths = np.random.default_rng(0).integers(16, 2048, size=400)
    ctx = PlanningContext(cfg, build_cost_model(cfg.cost_model, cfg.cluster), lengths, dp=2, pp=4)
    assert len(ctx.plan(0, 0)) == 8
    built = planner.build_execution_plans

    def unbatched(*a, **k):  # plans as the engine used to run them, trusting buffered sends
        return [
            dataclasses.replace(p, instructions=tuple(dataclasses.replace(i, batch_next=False) for i in p.instructions))
            for p in built(*a, **k)
        ]

    monkeypatch.setattr(planner, "build_execution_plans", unbatched)
    with pytest.raises(ValueError, match="rendezvous deadlock"):
        ctx.plan(0, 1)
