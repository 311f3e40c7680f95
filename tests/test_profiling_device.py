"""The profiler's device and precision: which device and dtype it picks, and how it times and
weighs a step there (the CUDA side checked against stand-ins for the CUDA runtime)."""

import pytest
import torch

from dyn_plugin.profiling import device as dev
from dyn_plugin.profiling.device import (
    Target,
    cuda_allocator_memory,
    cuda_clock,
    live_memory,
    measures,
    resolve_target,
    wall_clock,
)


def test_defaults_follow_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_target() == Target(torch.device("cpu"), "fp32")
    assert resolve_target("cpu", "bf16") == Target(torch.device("cpu"), "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a host with two GPUs
    assert resolve_target() == Target(torch.device("cuda", 0), "bf16")
    assert resolve_target("cuda:1", "fp16") == Target(torch.device("cuda", 1), "fp16")
    with pytest.raises(ValueError, match="--device cuda:2: this host has 2 CUDA devices"):
        resolve_target("cuda:2")
    assert resolve_target("cpu") == Target(torch.device("cpu"), "fp32")


def test_unusable_device_or_dtype_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: .*sees no CUDA device; use --device cpu"):
        resolve_target("cuda")
    with pytest.raises(ValueError, match="not 'meta'; pass --device cpu or --device cuda"):
        resolve_target("meta")
    with pytest.raises(ValueError, match="--dtype fp8: allowed are fp32, bf16, fp16"):
        resolve_target("cpu", "fp8")


def test_cuda_tensors_are_timed_by_events_and_weighed_by_the_allocator():
    assert measures("cpu") == (wall_clock, live_memory)
    assert measures("cuda") == (cuda_clock, cuda_allocator_memory)


class FakeGpu:
    """The caching allocator's counters and event timestamps, driven by the test's 'kernels'."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.now = 1000, 1000, 0.0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = None

            def record(self) -> None:
                self.t = gpu.now

            def synchronize(self) -> None:
                assert self.t is not None

            def elapsed_time(self, other: "Event") -> float:
                return other.t - self.t

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: gpu.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: gpu.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(gpu, "peak", gpu.allocated))


def test_cuda_memory_is_stored_after_forward_and_peak_of_backward(monkeypatch):
    gpu = FakeGpu()
    gpu.install(monkeypatch)
    gpu.alloc(4000)  # a forward before the measured one left its high-water mark: not this step's

    def forward():
        gpu.alloc(300)  # activations kept for backward
        return "loss"

    def backward(loss):
        gpu.alloc(700)  # transient gradients of activations
        gpu.alloc(-900)

    gpu.alloc(-4000)
    assert cuda_allocator_memory(forward, backward) == (300.0, 1000.0)


def test_cuda_clock_times_each_phase_on_the_device(monkeypatch):
    gpu = FakeGpu()
    gpu.install(monkeypatch)

    def first():
        gpu.now += 12.5
        return 3

    def second(value):
        assert value == 3
        gpu.now += 40.0

    assert cuda_clock(first, second) == (12.5, 40.0)


def test_step_uses_the_measures_of_its_inputs_device(monkeypatch):
    from dyn_plugin.profiling.profiler import memory_of
    from dyn_plugin.profiling.workload import Inputs, timed_step

    calls = []
    monkeypatch.setitem(
        dev._MEASURES,
        "cpu",
        (lambda f, b: calls.append("clock") or (1.0, 2.0), lambda f, b: calls.append("memory") or (3.0, 4.0)),
    )
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert timed_step(None, Inputs(ids, ids)) == (1.0, 2.0)
    assert memory_of(None, Inputs(ids, ids)) == (3.0, 4.0)
    assert calls == ["clock", "memory"]


def test_profile_command_passes_device_and_dtype(monkeypatch, tmp_path, capsys):
    from dyn_plugin.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    assert "use --device cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--dtype", "fp64", "--out", str(tmp_path / "p.json")])
    assert "invalid choice: 'fp64'" in capsys.readouterr().err


def test_h100_profile_records_its_device_and_says_what_it_did_not_measure(capsys):
    """The profile measured on an H100 (benchmarks/gpu-2026-11-23): device, precision, and as one of
    2 ranks with a single GPU, an all-reduce left to the cluster link."""
    from pathlib import Path

    from dyn_plugin.commands.profile import print_summary
    from dyn_plugin.cost.profile import cost_model_from_profile, load_profile

    path = Path(__file__).parent.parent / "benchmarks" / "gpu-2026-11-23" / "profile.json"
    profile = load_profile(path)
    assert (profile.device.type, profile.device.dtype, profile.update.backend) == ("cuda", "bf16", "nccl")
    assert "H100" in profile.device.name and cost_model_from_profile(profile).dtype == "bf16"
    print_summary(profile.model_copy(update={"ranks": 2}))
    out = capsys.readouterr().out
    assert "measured on cuda (NVIDIA H100 80GB HBM3) in bf16" in out
    assert "all-reduce among 2 not measured (fewer cuda devices than ranks)" in out
