"""What megatron-core needs to run without CUDA (tests and the CPU demo on gloo).

Applied only where CUDA is absent, so the same code runs on GPUs untouched: the current device
is the CPU, the "CUDA" RNG state Megatron forks for tensor-parallel dropout and initialisation is
the CPU generator's, the buffers a few modules allocate on "cuda" by name are allocated on the CPU,
and ``torch.cuda.synchronize`` (p2p shape exchange) is a no-op. Megatron-LM's own loop
(``megatron.training``, where installed) also gets: ``Tensor.cuda`` and ``Module.cuda`` leave
tensors and models where they are; its ``initialize`` sees one "CUDA" device (it asserts CUDA, and
builds the model-parallel groups and seeds the tensor-parallel RNG tracker only with a device);
its loop's "cuda" tensors are made on the CPU and its side streams are stand-ins; the legacy fused
kernels are not loaded (that runs ``nvcc -V``), the JIT warm-up on "cuda" tensors is skipped, and
the GPU architecture it asks under tensor parallelism is none (0).

Where triton is not installed (CPU builds of torch), ``stub_triton_kernels`` stands in for the one
megatron-core module Megatron-LM's ``megatron.training.initialize`` imports that needs triton at
import time (``batch_invariant_kernels``): its functions are there, and enabling the mode (Megatron-LM's
``--batch-invariant-mode``, GPU only) raises. A stub ``triton`` package on the path instead would be
found by torch itself (``torch._dynamo`` checks for triton), so the module is stubbed, not triton;
and processes Megatron-LM spawns get it too (``megatron_patches.spawned_main``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
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
_CUDA_BY_NAME = (
    "pipeline_parallel.schedules",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "utils",
    "rerun_state_machine",
)


BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def stub_triton_kernels() -> bool:
    """Put a stand-in for ``batch_invariant_kernels`` in ``sys.modules`` where triton is missing;
    returns whether it did."""
    if BATCH_INVARIANT in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    stub = types.ModuleType(BATCH_INVARIANT, "stand-in of dyn_plugin (megatron_patches.cpu): triton is not installed")

    def enable_batch_invariant_mode(*_args, **_kwargs):
        raise RuntimeError("batch-invariant mode needs triton (a CUDA build of torch); it is not installed")

    state = {"enabled": False}
    stub.enable_batch_invariant_mode = enable_batch_invariant_mode
    stub.set_batch_invariant_mode = lambda enabled=True, *a, **k: enabled and enable_batch_invariant_mode()
    stub.disable_batch_invariant_mode = lambda *a, **k: None
    stub.is_batch_invariant_mode_enabled = lambda: state["enabled"]
    stub.__all__ = [
        "set_batch_invariant_mode",
        "is_batch_invariant_mode_enabled",
        "disable_batch_invariant_mode",
        "enable_batch_invariant_mode",
    ]
    sys.modules[BATCH_INVARIANT] = stub
    return True


def _no_triton() -> bool:
    return importlib.util.find_spec("triton") is None


SPAWN_MAIN = "DYN_PLUGIN_SPAWN_MAIN"  # the script a spawned process runs as its main module


def _spawn_main(original):
    """Processes spawned by Megatron-LM (the queue manager of its checkpoint writer) first run the
    script as their main module, as ``__mp_main__``: ``pretrain_gpt.py`` imports
    ``megatron.training`` and so, without triton, needs the stand-in there too. They import
    ``megatron_patches.spawned_main`` instead, which puts it in place and then runs the script
    exactly as spawn would have."""

    @functools.wraps(original)
    def get_preparation_data(name):
        data = original(name)
        path = data.pop("init_main_from_path", None)
        if path is not None:
            os.environ[SPAWN_MAIN] = path  # inherited by the child
            data["init_main_from_name"] = "megatron_patches.spawned_main"
        return data

    return get_preparation_data


def _tensor_cuda(_original):
    def cuda(self, device=None, non_blocking=False, **_kwargs):
        return self

    return cuda


def _module_cuda(_original):
    def cuda(self, device=None):
        return self

    return cuda


class _Stream:
    """A CUDA stream where there is none: the work runs in order on the CPU anyway."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def wait_stream(self, _other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_cuda(cuda_module: types.ModuleType, one_device: bool) -> types.ModuleType:
    """``torch.cuda`` with stand-ins; every other name is read from the real module when used, so the
    other CPU patches of ``torch.cuda`` (current device, RNG state) are seen whatever their order."""
    cuda = types.ModuleType("torch.cuda")
    cuda.__getattr__ = lambda name: getattr(cuda_module, name)  # PEP 562: names not set here
    cuda.Stream = _Stream
    cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    cuda.current_stream = lambda *_a, **_k: _Stream()
    cuda.empty_cache = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *_a, **_k: 0)
    if one_device:
        cuda.is_available = lambda: True
        cuda.device_count = lambda: 1
        cuda.set_device = lambda *_a, **_k: None
    return cuda


def _cpu_torch_training(module: types.ModuleType) -> types.ModuleType:
    """``torch`` as Megatron-LM's training loop sees it: tensors made on "cuda" are made on the CPU,
    and its streams (``get_model`` wraps DDP in a side stream) and memory counters are stand-ins."""
    shim = _cpu_torch(module)
    shim.cuda = _cpu_cuda(module.cuda, one_device=False)
    return shim


def _cpu_torch_one_device(module: types.ModuleType) -> types.ModuleType:
    """``torch`` as Megatron-LM's ``initialize`` sees it: one "CUDA" device, the CPU. It asserts CUDA
    is there, and initialises the model-parallel groups and seeds the tensor-parallel RNG tracker only
    where ``torch.cuda.device_count() > 0``."""
    shim = _cpu_torch(module)
    shim.cuda = _cpu_cuda(module.cuda, one_device=True)
    return shim


# Megatron-LM's modules that do the same: its loop's counters and flags, its loss and norm reductions, the
# checkpoint iteration it agrees on when resuming
_TRAINING_CUDA_BY_NAME = ("training", "utils", "checkpointing")


def cpu_patches() -> list[Patch]:
    core = "megatron.core"
    training = "megatron.training"
    return (
        [
            # Megatron-LM's training loop moves its model, batches and counters with .cuda(): on the CPU they stay
            Patch("cpu.tensor_cuda", "torch.Tensor.cuda", _tensor_cuda, when=_no_cuda),
            Patch("cpu.module_cuda", "torch.nn.Module.cuda", _module_cuda, when=_no_cuda),
            Patch(
                "cpu.torch_in.training.initialize",
                f"{training}.initialize.torch",
                _cpu_torch_one_device,
                when=_no_cuda,
                optional=True,
                aliases=False,
            ),
            Patch(
                # Megatron-LM's initialize "loads" its legacy fused kernels unconditionally: it runs nvcc -V
                "cpu.fused_kernels",
                "megatron.legacy.fused_kernels.load",
                lambda _: lambda *a, **k: None,
                when=_no_cuda,
                optional=True,
            ),
            Patch(
                # it runs the bias-activation fusions on device="cuda" tensors once, to warm up their JIT
                "cpu.warmup_jit",
                f"{training}.initialize._warmup_jit_function",
                lambda _: lambda *a, **k: None,
                when=_no_cuda,
                optional=True,
            ),
            Patch(
                # validate_args asks the GPU's architecture under tensor parallelism; no GPU: before
                # every one (so Megatron-LM asks for CUDA_DEVICE_MAX_CONNECTIONS=1, as on Hopper)
                "cpu.device_arch",
                f"{training}.utils.get_device_arch_version",
                lambda _: lambda: 0,
                when=_no_cuda,
                optional=True,
            ),
            Patch(
                "cpu.spawn_main",
                "multiprocessing.spawn.get_preparation_data",
                _spawn_main,
                when=_no_triton,
                aliases=False,
            ),
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
        ]
        + [
            Patch(f"cpu.torch_in.{m}", f"{core}.{m}.torch", _cpu_torch, when=_no_cuda, aliases=False)
            for m in _CUDA_BY_NAME
        ]
        + [
            Patch(
                f"cpu.torch_in.training.{m}",
                f"{training}.{m}.torch",
                _cpu_torch_training,
                when=_no_cuda,
                aliases=False,
                optional=True,
            )
            for m in _TRAINING_CUDA_BY_NAME
        ]
    )
