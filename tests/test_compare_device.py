"""The training benchmark's device settings: DeepSpeed's precision section follows the profile's
dtype, and the planner's memory is the device's."""
import torch

from deepspeed_ext.compare import device_memory_mb, precision_section


def test_precision_section_follows_the_profile_dtype():
    assert precision_section("fp32") == {}  # the CPU demo's config stays as it was
    assert precision_section("bf16") == {"bf16": {"enabled": True}}
    assert precision_section("fp16") == {"fp16": {"enabled": True}}


def test_cuda_memory_is_the_gpus(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert device_memory_mb(torch.device("cuda", 0)) == 80 * 1024
    assert device_memory_mb(torch.device("cpu")) == 8000
