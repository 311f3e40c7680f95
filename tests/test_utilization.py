"""What the training benchmark records on a GPU (dyn_plugin/bench/utilization.py): model FLOPs as
torchtitan counts them, utilisation against the GPU's dense peak, and the plan's predicted peak
memory per rank that the measured peak is set beside (issue 26)."""

import pytest
import torch
from torch import nn

from dyn_plugin.bench import utilization as u
from dyn_plugin.bench.train_common import report, summarize
from dyn_plugin.cost.shape import shape_from_config
from dyn_plugin.models.hf import build_causal_lm, load_model_config


def test_model_flops_are_six_per_weight_per_token_plus_attention_per_document():
    """Counted from the model's own linear layers: 6 FLOPs per weight per token (the head included),
    plus torchtitan's attention term over each document's own length."""
    config = load_model_config("tiny-llama")
    model = build_causal_lm(config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    shape, lengths = shape_from_config(model.config), [300, 5, 700]
    attention = 12 * shape.num_layers * shape.query_width * (300**2 + 5**2 + 700**2)
    assert u.model_flops(shape, lengths) == pytest.approx(6 * weights * 1005 + attention)


def test_utilisation_is_against_the_gpus_dense_peak(monkeypatch):
    assert u.peak_tflops(torch.device("cpu"), "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert u.peak_tflops(cuda, "bf16") == 989.4
    assert u.peak_tflops(cuda, "fp32") is None  # TF32 or not is the kernels' choice
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L4")
    assert u.peak_tflops(cuda, "bf16") is None
    assert u.mfu(989.4e12 * 0.4 * 2, 1000.0, 2, 989.4) == pytest.approx(0.4)
    assert u.mfu(1e12, 1000.0, 1, None) is None
    assert u.measured_peak_mb(torch.device("cpu")) is None


def _record(mode, ms, **gpu):
    return {"mode": mode, "step": 1, "measured_ms": ms, "predicted_ms": ms, "real_tokens": 100.0,
            "token_slots": 120.0, "loss": 1.0, "micro_batches": 2, **gpu}  # fmt: skip


def test_the_report_shows_gpu_figures_only_where_they_were_measured(tmp_path):
    cpu = summarize([_record("padded", 10.0), _record("dyn_plugin", 5.0)], ["padded", "dyn_plugin"], ["padded"], 1000)
    assert cpu[1]["mfu"] is None and "MFU" not in report(cpu, str(tmp_path), "", ["padded"])
    assert cpu[0]["budget_filled"] == pytest.approx(0.1)  # 100 real tokens of a budget of 1000
    gpu = [
        _record("dyn_plugin", 5.0, mfu=0.40, peak_mb_measured=1000.0, peak_mb_predicted=950.0),
        _record("dyn_plugin", 5.0, mfu=0.44, peak_mb_measured=1100.0, peak_mb_predicted=900.0),
    ]
    row = summarize(gpu, ["dyn_plugin"], [], 1000)[0]
    assert row["mfu"] == pytest.approx(0.42)
    assert (row["peak_mb_measured"], row["peak_mb_predicted"]) == (1100.0, 950.0)
    assert "| dyn_plugin | 42.0% | 1,100 | 950 | -13.6% |" in report([row], str(tmp_path), "", [])


def test_every_rank_is_handed_its_predicted_peak_within_the_device():
    """Each rank's step carries the plan's peak for its stage (simulated activations in flight plus
    the model states the stage holds), which the planner kept within the device's memory; the
    planner processes' store carries it too."""
    from dyn_plugin.runtime.planning import RankPlan
    from test_loader import loaders, make

    cfg, cm, lens, data = make(pp=2)
    steps = {k: next(iter(loader)) for k, loader in loaders(cfg, cm, lens, data, 2, 2).items()}
    context = next(iter(loaders(cfg, cm, lens, data, 2, 2).values())).context
    plan = context.plan_batch([int(lens[i]) for i in context.batches(0)[0]])
    for (column, stage), step in steps.items():
        rep = next(r for r in plan.replicas if r.first <= column < r.first + r.size)
        want = (rep.sim.peak_bytes[stage] + context.spec.memory[stage].states) / 2**20
        assert step.predicted_peak_mb == pytest.approx(want)
        assert context.spec.memory[stage].states / 2**20 < step.predicted_peak_mb <= cfg.cluster.device.memory_mb
    rank_plan = context.plan(0, 0)[(0, 1)]
    assert RankPlan.from_meta(rank_plan.to_meta()) == rank_plan
