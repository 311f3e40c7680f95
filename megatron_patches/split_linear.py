"""megatron-core's tensor-parallel linear layers, their weight gradients deferred for a split backward.

``ColumnParallelLinear`` and ``RowParallelLinear`` are not ``nn.Linear``: each runs its matrix
multiply through ``_forward_impl`` (megatron-core 0.16.1's ``LinearWithGradAccumulationAndAsyncCommunication``),
whose backward computes the input's and the weight's gradients together. Here each such layer of a
model chunk gets, once, an ``_forward_impl`` that runs as before, and while the chunk's
``SplitBackward`` (``dyn_plugin.models.split_backward``) defers a micro-batch runs
``_DeferredParallelLinear``: the same forward, a backward that returns the input's gradient only
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


class _DeferredParallelLinear(torch.autograd.Function):
    """Megatron's linear forward; a backward that returns the input's gradient only and stashes
    (input, output gradient). The weight and bias travel hidden in a tuple, not as inputs of the
    node: were they inputs, autograd would run their accumulation (and DDP's hooks) in I."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, params: tuple, stash: list, allreduce_dgrad: bool, group: Any):
        weight, bias = params
        ctx.save_for_backward(x)
        ctx.weight, ctx.stash, ctx.allreduce_dgrad, ctx.group = weight, stash, allreduce_dgrad, group
        out = torch.matmul(x, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        ctx.stash.append((x.detach(), grad.detach()))
        grad_input = grad.matmul(ctx.weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.group)
        return grad_input, None, None, None, None


def _forward_impl_of(split: SplitBackward, original: Any):
    owner = weakref.ref(split)

    def forward_impl(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: A002
        me = owner()
        if me is None or me.active is None or not weight.requires_grad or not input.requires_grad:
            return original(input, weight, *args, **kwargs)
        # megatron-core 0.16.1 passes these by keyword (ColumnParallelLinear.forward, RowParallelLinear.forward)
        bias, group = kwargs.get("bias"), kwargs.get("tp_group")
        stash = me.stash(weight, bias)
        return _DeferredParallelLinear.apply(input, (weight, bias), stash, kwargs.get("allreduce_dgrad", False), group)

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
