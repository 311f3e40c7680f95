"""Where this rank trains and in which precision: one answer for every host and for the loader.

The launchers (torchrun, deepspeed, Megatron's) tell each process its rank on its node through
``LOCAL_RANK``; the precision names are the config's ``cost_model.dtype`` literals.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

# the config's precision names and the torch dtypes they train in
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def local_rank() -> int:
    """This process's rank on its node: the launcher's ``LOCAL_RANK``, else (one node) the global
    rank, else 0. The GPU a rank drives follows it."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_device() -> torch.device:
    """The device this rank trains on: its node-local GPU when CUDA is there, else the CPU.
    Needed before a host engine exists (it would set the current device only later)."""
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def collective_device() -> torch.device:
    """Where the default process group's backend takes tensors: this rank's GPU under NCCL (which
    reduces device tensors only), else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def dtype_name(dtype: torch.dtype) -> str | None:
    """The precision name of ``dtype`` (None for one the plugin does not plan in)."""
    return DTYPE_NAMES.get(dtype)


def training_dtype(ds: Mapping[str, Any]) -> str:
    """The precision a DeepSpeed config trains in: its ``bf16`` or ``fp16`` section, else fp32.
    The cost model must price activations and memory in it."""
    if (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled", False):
        return "bf16"
    return "fp16" if (ds.get("fp16") or {}).get("enabled", False) else "fp32"
