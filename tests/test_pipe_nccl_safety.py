"""What gloo forgives and NCCL does not: collectives on device tensors, no host read per
micro-batch, point-to-point exchanges that cannot wait on each other, the training dtype."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import deepspeed_ext
from dyn_plugin.plan.instructions import ExecutionPlan, LoadMicroBatch, OptimizerStep, ReduceGrads
from dyn_plugin.runtime.collate import collate
from dyn_plugin.runtime.loader import Step

# Every way a tensor's value reaches the host.
HOST_READS = ("item", "cpu", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


class FakeEngine:
    """A data-parallel DeepSpeed engine on the "meta" device: no tensor has a value to read."""

    device = torch.device("meta")

    def __init__(self):
        self.backwards = []
        self._dyn_plugin_recompute = SimpleNamespace(set=lambda mode: None)

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
    descs = tuple({"sample_ids": tuple(range(len(lens))), "seq_lens": tuple(lens), "layout": "padded",
                   "recompute": "none", "shape": (len(lens), max(lens))} for lens in seq_lens_per_mb)
    plan = ExecutionPlan(rank=0, replica=0, stage=0, num_stages=1, num_buffers=1, micro_batches=descs,
                         instructions=tuple(LoadMicroBatch(0, m, 0) for m in range(len(descs))) + (ReduceGrads(0), OptimizerStep(0)))
    data = [torch.arange(1, 40)] * 8
    mbs = [collate(d["sample_ids"], d["seq_lens"], "padded", d["shape"], data.__getitem__) for d in descs]
    return Step(0, 0, plan, mbs, [list(d["sample_ids"]) for d in descs], scored_tokens=50, digest="x", predicted_ms=0.0)


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
