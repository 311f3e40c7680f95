"""megatron-core's tensor-parallel linear layers, their weight gradients deferred for a split backward.

``ColumnParallelLinear`` and ``RowParallelLinear`` are not ``nn.Linear``: each runs its matrix
multiply through ``_forward_impl`` (megatron-core 0.16.1's ``LinearWithGradAccumulationAndAsyncCommunication``),
whose backward computes the input's and the weight's gradients together. Here each such layer of a
model chunk gets, once, an ``_forward_impl`` that runs as before, and while the chunk's
``SplitBackward`` (``dyn_plugin.models.split_backward``) defers a micro-batch runs the split's
deferred linear: the same forward, a backward that returns the input's gradient only
(all-reduced over the tensor-parallel ranks where Megatron's does), and the (input, output
gradient) pair left for W. W multiplies them and accumulates the result through autograd, so
Megatron DDP's gradient hooks add it to ``main_grad`` as they do a whole backward's. A layer with
frozen weights keeps Megatron's own forward.

Megatron's fused weight-gradient accumulation (``--gradient-accumulation-fusion``) writes into
``main_grad`` inside the backward, its embedding-gradient deferral holds output gradients of its
own, and ``--sequence-parallel`` gathers a layer's input over the tensor-parallel ranks, which W
would have to do again: the executor refuses all three with a split backward
(``plan_executor.check_model``), as it does Transformer Engine's layers, which it cannot defer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dyn_plugin.models.split_backward import SplitBackward, split_backward


def _forward_impl_of(split: SplitBackward, original: Any):
    owner = weakref.ref(split)

    def forward_impl(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: A002
        me = owner()
        if me is None or me.active is None or not weight.requires_grad or not input.requires_grad:
            return original(input, weight, *args, **kwargs)
        # megatron-core 0.16.1 passes these by keyword (ColumnParallelLinear.forward, RowParallelLinear.forward)
        group = kwargs.get("tp_group")
        reduce = (
            (lambda grad: torch.distributed.all_reduce(grad, group=group)) if kwargs.get("allreduce_dgrad") else None
        )
        return me.linear(input, weight, kwargs.get("bias"), reduce)

    return forward_impl


_DONE: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def megatron_split(chunk: torch.nn.Module) -> SplitBackward:
    """``chunk``'s split backward, its tensor-parallel linear layers deferring too (set up once)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    split = split_backward(chunk)
    if chunk not in _DONE:
        for layer in chunk.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer._forward_impl = _forward_impl_of(split, layer._forward_impl)
        _DONE[chunk] = True
    return split
