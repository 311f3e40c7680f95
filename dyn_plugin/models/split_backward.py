"""A backward split in two for a zero-bubble schedule: I (the gradient of a stage's input, sent
upstream at once) and, later, W (the gradients of its linear layers' weights).

Every ``nn.Linear`` of the stage's module gets, once, a forward that normally runs as it did and,
while a micro-batch is ``deferring``, runs as ``_DeferredLinear``: its backward returns the
input's gradient and keeps the layer's input and output gradient for ``weights``, which later
multiplies them into the weight gradient (one matrix multiply, the size of the forward's) and
accumulates it through autograd, so the parameter's gradient-accumulation hooks fire as in a whole
backward (ZeRO and DDP reducers collect gradients through them). What I keeps until W is exactly
that: each linear layer's input and output gradient, as the planner prices it
(``pricing.split_backward_costs``). Embeddings, norms and other modules' parameters keep their
gradients in I, as do linear layers with a forward of their own (LoRA, quantized layers). A layer
recomputed in backward (checkpointing) re-runs this forward inside I, still deferring. The state
lives in a map keyed weakly by the module (``host/recompute.py``'s rule), not on it; the pipeline
engine and the profiler (which times W apart) share it. A host whose linear layers are not
``nn.Linear`` (megatron-core's tensor-parallel ones) defers through ``linear``, and its W's run here
too.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

Reduce = Callable[[torch.Tensor], Any]  # an in-place reduction of an input's gradient


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input's gradient only (``reduce``d where the host's
    layer reduces it: a tensor-parallel all-reduce) and stashes (input, output gradient) for the
    weight gradient. The weight and bias travel in a tuple, not as inputs of the node: were they,
    autograd would run their accumulation (and its hooks) in I with no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, params: tuple, stash: list, reduce: Reduce | None) -> torch.Tensor:
        weight, bias = params
        ctx.save_for_backward(x)
        ctx.weight, ctx.stash, ctx.reduce = weight, stash, reduce
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        ctx.stash.append((x.detach(), grad.detach()))
        grad_input = grad.matmul(ctx.weight)
        if ctx.reduce is not None:
            ctx.reduce(grad_input)
        return grad_input, None, None, None


class SplitBackward:
    """The deferred weight gradients of one module's linear layers, per micro-batch."""

    def __init__(self, module: nn.Module) -> None:
        # only layers that compute nn.Linear's own forward: a subclass with its own (LoRA, quantized
        # layers) keeps it, and its weight gradient stays in I
        self.linears = [
            m
            for m in module.modules()
            if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.weight.requires_grad
        ]
        self.active: Hashable | None = None
        # per micro-batch: (weight, bias or None, the (input, output gradient) pairs of its backwards)
        self.pending: dict[Hashable, list[tuple[nn.Parameter, nn.Parameter | None, list]]] = {}
        for layer in self.linears:
            layer.forward = self._forward_of(layer)

    def _forward_of(self, layer: nn.Linear):
        split = weakref.ref(self)

        def forward(x: torch.Tensor) -> torch.Tensor:
            me = split()
            # an input without a gradient to carry (a frozen embedding's output): nothing to split
            if me is None or me.active is None or not x.requires_grad:
                return F.linear(x, layer.weight, layer.bias)
            return me.linear(x, layer.weight, layer.bias)

        return forward

    def linear(
        self, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, reduce: Reduce | None = None
    ) -> torch.Tensor:
        """A linear layer's forward in the micro-batch being deferred (call only within
        ``deferring``): its I leaves (input, output gradient) for that micro-batch's W; ``reduce``:
        what the host's layer does to the input's gradient (in place) before it flows on."""
        stash: list = []
        self.pending.setdefault(self.active, []).append((weight, bias, stash))
        return _DeferredLinear.apply(x, (weight, bias), stash, reduce)

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Within: the linear layers defer their weight gradients under ``key`` (a micro-batch's
        forward, and its I: a recompute inside it defers as well)."""
        before, self.active = self.active, key
        try:
            yield
        finally:
            self.active = before

    def weights(self, key: Hashable) -> None:
        """W of ``key``: every weight (and bias) gradient its I deferred, accumulated into the
        parameters through autograd, so their accumulation hooks fire."""
        tensors, grads = [], []
        for weight, bias, stash in self.pending.pop(key, []):
            for x, grad in stash:  # once per backward through the layer (a recompute adds none)
                flat_grad = grad.reshape(-1, grad.shape[-1])
                tensors.append(weight)
                grads.append(flat_grad.t().matmul(x.reshape(-1, x.shape[-1])))
                if bias is not None and bias.requires_grad:
                    tensors.append(bias)
                    grads.append(flat_grad.sum(0))
        if tensors:
            torch.autograd.backward(tensors, grads)

    def clear(self) -> None:
        """Drop what a step left deferred (a step that failed between an I and its W)."""
        self.pending.clear()
        self.active = None


_SPLITS: "weakref.WeakKeyDictionary[nn.Module, SplitBackward]" = weakref.WeakKeyDictionary()


def split_backward(module: nn.Module) -> SplitBackward:
    """``module``'s split, made the first time it is asked for."""
    if module not in _SPLITS:
        _SPLITS[module] = SplitBackward(module)
    return _SPLITS[module]
