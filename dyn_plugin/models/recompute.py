"""Activation recompute, switched per micro-batch as the plan says.

The planner picks a recompute mode per micro-batch (DynaPipe; DCP's pyramid checkpointing
recomputes less for shorter sequences): ``full`` recomputes each decoder layer in backward,
``selective`` only its attention block, ``none`` keeps everything. ``RecomputeSwitch`` wraps the
layers' (or attention blocks') ``forward`` in non-reentrant checkpointing and unwraps them again,
so one model runs every micro-batch in its own mode. The profiler measures through the same
switch, so the profile prices exactly what training executes.
"""
from __future__ import annotations

import functools

import torch.utils.checkpoint as cp
from torch import nn

from ..cost.model import RECOMPUTES



def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks: the modules that own an attention block (``self_attn`` or ``attn``)."""
    return [m for m in model.modules() if isinstance(getattr(m, "self_attn", None) or getattr(m, "attn", None), nn.Module)]


def _attention(layer: nn.Module) -> nn.Module:
    return getattr(layer, "self_attn", None) or layer.attn


class RecomputeSwitch:
    def __init__(self, model: nn.Module) -> None:
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (modules with self_attn or attn) to "
                             "recompute")
        self.mode = "none"

    def set(self, mode: str) -> None:
        if mode not in RECOMPUTES:
            raise ValueError(f"recompute mode {mode!r}; known: {', '.join(RECOMPUTES)}")
        if mode == self.mode:
            return
        for layer in self.layers:
            for m in (layer, _attention(layer)):
                m.__dict__.pop("forward", None)  # back to the class's forward
            target = layer if mode == "full" else _attention(layer) if mode == "selective" else None
            if target is not None:
                target.forward = functools.partial(cp.checkpoint, target.forward, use_reentrant=False)
        self.mode = mode
