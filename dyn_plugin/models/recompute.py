"""Activation recompute, switched per micro-batch as the plan says.

The planner picks a recompute mode per micro-batch (DynaPipe; DCP's pyramid checkpointing
recomputes less for shorter sequences): ``full`` recomputes each decoder layer in backward,
``selective`` only its attention block, ``none`` keeps everything. ``RecomputeSwitch`` wraps the
layers' (or attention blocks') ``forward`` in non-reentrant checkpointing and unwraps them again,
so one model runs every micro-batch in its own mode; with a layer count (pyramid checkpointing)
only that many of the layers run in the mode, the others keep their activations. The profiler measures through the same
switch, so the profile prices exactly what training executes.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint as cp
from torch import nn

from ..cost.model import RECOMPUTES
from ..plan.steps.instructions import PlannedMicroBatch

# what transformer blocks call their attention block (Llama-likes, GPT-2, GPT-NeoX)
ATTENTION_NAMES = ("self_attn", "attn", "attention")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks: transformers' own block classes where the model names them (its
    ``_no_split_modules``, whatever the attributes are called), else the modules that own an
    attention block (an attribute in ``ATTENTION_NAMES``)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks and all(_attention(b) is not None for b in blocks):
        return blocks
    return [m for m in model.modules() if _attention(m) is not None]


def _attention(layer: nn.Module) -> nn.Module | None:
    """The block's attention module (None for a module that is not a block)."""
    for name in ATTENTION_NAMES:
        found = getattr(layer, name, None)
        if isinstance(found, nn.Module):
            return found
    # T5's blocks keep their sublayers in a list, self-attention first (then cross-attention in
    # the decoder's, then the feed-forward): selective recompute takes the self-attention sublayer
    sublayers = getattr(layer, "layer", None)
    if (
        isinstance(sublayers, nn.ModuleList)
        and len(sublayers)
        and isinstance(getattr(sublayers[0], "SelfAttention", None), nn.Module)
    ):
        return sublayers[0]
    return None


class RecomputeSwitch:
    """Puts the first ``layers`` decoder layers of a module under a recompute mode, the rest under none."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(
                f"{type(model).__name__} has no transformer blocks (transformers' _no_split_modules classes, or "
                f"modules with an attention block named one of {', '.join(ATTENTION_NAMES)}) to recompute"
            )
        self.mode = "none"
        self.count = len(self.layers)  # layers under ``mode``
        self._modes = ["none"] * len(self.layers)  # what each layer runs now

    def set(self, mode: str, layers: int | None = None) -> None:
        """Run the first ``layers`` of this module's decoder layers under ``mode`` and the others with
        no recompute (pyramid checkpointing); None = all of them. Only layers that change are touched."""
        if mode not in RECOMPUTES:
            raise ValueError(f"recompute mode {mode!r}; known: {', '.join(RECOMPUTES)}")
        count = len(self.layers) if layers is None else layers
        if not 0 <= count <= len(self.layers):
            raise ValueError(
                f"checkpointed layers = {layers}: this module has {len(self.layers)} decoder layers; "
                "the plan was made for another pipeline split"
            )
        if (mode, count) == (self.mode, self.count):
            return
        for i, layer in enumerate(self.layers):
            want = mode if i < count else "none"
            if want == self._modes[i]:
                continue
            for m in (layer, _attention(layer)):
                m.__dict__.pop("forward", None)  # back to the class's forward
            target = layer if want == "full" else _attention(layer) if want == "selective" else None
            if target is not None:
                target.forward = functools.partial(cp.checkpoint, target.forward, use_reentrant=False)
            self._modes[i] = want
        self.mode, self.count = mode, count


def planned_layers(desc: PlannedMicroBatch, stage: int) -> int | None:
    """Layers of ``stage`` an execution plan's micro-batch runs under its recompute mode (None = all)."""
    counts = desc.checkpointed
    return counts[stage] if counts else None
