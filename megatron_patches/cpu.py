"""What megatron-core needs to run without CUDA (tests and the CPU demo on gloo).

Applied only where CUDA is absent, so the same code runs on GPUs untouched: the current device
is the CPU, the "CUDA" RNG state Megatron forks for tensor-parallel dropout and initialisation is
the CPU generator's, the buffers a few modules allocate on "cuda" by name are allocated on the CPU,
and ``torch.cuda.synchronize`` (p2p shape exchange) is a no-op.
"""

from __future__ import annotations

import functools
import types

import torch

from .registry import Patch


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


def _cpu_device(*_args, **_kwargs):
    return "cpu"


def _get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    # torch.manual_seed would call torch.cuda.manual_seed_all, i.e. back here
    torch.default_generator.manual_seed(int(seed))


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_torch(module: types.ModuleType) -> types.ModuleType:
    """``torch`` as one megatron-core module sees it: tensors it creates on "cuda" are made on the CPU."""
    shim = types.ModuleType("torch")
    shim.__dict__.update(module.__dict__)

    def on_cpu(make):
        @functools.wraps(make)
        def made(*args, device=None, **kwargs):
            return make(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return made

    for name in ("zeros", "ones", "empty", "tensor", "full"):
        setattr(shim, name, on_cpu(getattr(module, name)))
    return shim


# modules that allocate on device="cuda" by name: the schedules' token counter, the optimizer's
# loss-scale and overflow buffers, the gradient norm (and its local fallback for apex's kernel)
_CUDA_BY_NAME = ("pipeline_parallel.schedules", "optimizer.optimizer", "optimizer.clip_grads", "utils")


def cpu_patches() -> list[Patch]:
    core = "megatron.core"
    return [
        Patch("cpu.current_device", "torch.cuda.current_device", lambda _: _cpu_device, when=_no_cuda),
        Patch("cpu.synchronize", "torch.cuda.synchronize", lambda _: lambda *a, **k: None, when=_no_cuda),
        Patch("cpu.get_rng_state", "torch.cuda.get_rng_state", lambda _: _get_rng_state, when=_no_cuda),
        Patch("cpu.set_rng_state", "torch.cuda.set_rng_state", lambda _: _set_rng_state, when=_no_cuda),
        Patch("cpu.manual_seed", "torch.cuda.manual_seed", lambda _: _manual_seed, when=_no_cuda),
        Patch(
            "cpu.megatron_get_rng_state",
            f"{core}.tensor_parallel.random._get_cuda_rng_state",
            lambda _: _get_rng_state,
            when=_no_cuda,
        ),
        Patch(
            "cpu.megatron_set_rng_state",
            f"{core}.tensor_parallel.random._set_cuda_rng_state",
            lambda _: _set_rng_state,
            when=_no_cuda,
        ),
        Patch(
            "cpu.causal_mask",
            f"{core}.transformer.utils.get_default_causal_mask",
            lambda _: _causal_mask,
            when=_no_cuda,
        ),
    ] + [
        Patch(f"cpu.torch_in.{m}", f"{core}.{m}.torch", _cpu_torch, when=_no_cuda, aliases=False) for m in _CUDA_BY_NAME
    ]
