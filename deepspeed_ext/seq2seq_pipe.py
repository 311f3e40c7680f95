"""A transformers T5 as a DeepSpeed ``PipelineModule`` of encoder stages then decoder stages.

Megatron's split (``plan.pair_spec``): stages before the split rank run encoder layers, the
others decoder layers. What crosses a link is what ``instructions.link_shapes`` describes and
``EncoderDecoderCostModel.link_bytes`` prices: the last encoder stage sends the encoder output
(after the encoder's final norm); a decoder stage would send its hidden states and the encoder
output every later cross-attention reads. The stage input the engine builds is
``(*received tensors, *loaded token ids, attention mask)``: the first stage gets the input ids, the
first decoder stage the encoder output and the labels, which it shifts into the decoder's inputs
as the model does (``_shift_right``).

Nothing else crosses: both stages load the micro-batch (the input padding mask with it) and
build the masks (bidirectional over the input, causal over the target, input padding for
cross-attention) with the model's own mask functions. T5 computes its relative position bias in the first block of each
stack and hands it to the others; that block and the rest of its side share a stage here.

The shared embedding (encoder input, decoder input, and the head's weight) is DeepSpeed's tied
layer: one module on every stage that uses it, its weight broadcast at start and its gradients
summed between those stages after every step.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from deepspeed_ext.pipe_module import Embed, PlannedPipelineModule
from dyn_plugin.cost.encoder_decoder import PairStage
from dyn_plugin.runtime.collate import IGNORE


class EncoderEntry(nn.Module):
    """The encoder's first layer on its stage: its padding mask as the stack builds it, the
    embedding dropout; the block state ``(hidden, mask, position bias)``."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.config, self.dropout = stack.config, stack.dropout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        from transformers.models.t5 import modeling_t5

        embeds, attention_mask = inputs
        mask = modeling_t5.create_bidirectional_mask(
            config=self.config, inputs_embeds=embeds, attention_mask=attention_mask
        )
        return self.dropout(embeds), mask, None, None, None, None


class DecoderEntry(nn.Module):
    """The decoder's first layer on its stage: the causal mask and the cross-attention's input
    padding mask as the stack builds them, the embedding dropout; the block state
    ``(hidden, causal mask, position bias, encoder output, cross mask, cross bias)``."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        self.config, self.dropout = stack.config, stack.dropout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
        from transformers.models.t5 import modeling_t5

        encoder_output, embeds, attention_mask = inputs
        causal = modeling_t5.create_causal_mask(
            config=self.config, inputs_embeds=embeds, attention_mask=None, cache=None
        )
        cross = modeling_t5.create_bidirectional_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_output,
        )
        return self.dropout(embeds), causal, None, encoder_output, cross, None


class Block(nn.Module):
    """One T5 block on the block state; the first of a stack computes the position bias the
    others take, as ``T5Stack.forward`` passes it on."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, state: tuple) -> tuple:
        hidden, mask, bias, encoder_output, cross_mask, cross_bias = state
        hidden, bias, cross_bias = self.block(hidden, mask, bias, encoder_output, cross_mask, cross_bias)
        return hidden, mask, bias, encoder_output, cross_mask, cross_bias


class StackExit(nn.Module):
    """A stack's final norm and dropout: the encoder output, or the decoder's last hidden states
    (scaled by d_model^-0.5 before a tied head where the model does so)."""

    def __init__(self, stack: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.final_layer_norm, self.dropout, self.scale = stack.final_layer_norm, stack.dropout, scale

    def forward(self, state: tuple) -> torch.Tensor:
        hidden = self.dropout(self.final_layer_norm(state[0]))
        return hidden * self.scale if self.scale != 1.0 else hidden


class Head(nn.Module):
    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _embed_targets(shift, embed: Embed, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
    """The decoder's inputs: the labels shifted right by the model's own ``_shift_right``, embedded
    by the shared (tied) embedding."""
    encoder_output, labels, attention_mask = inputs
    return encoder_output, embed.embed_tokens(shift(labels)), attention_mask


def _tied_logits(embed: Embed, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embed.embed_tokens.weight)


def summed_target_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the target tokens (labels are the targets themselves, -100 on
    padding, as the model's own loss reads them). A sum: the engine divides by the global batch's."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def seq2seq_pipe(model: nn.Module, stages: Sequence[PairStage]) -> PlannedPipelineModule:
    """A transformers T5 (``T5ForConditionalGeneration`` and kin: ``shared``, ``encoder``, ``decoder``,
    ``lm_head``) as the pipeline stages ``stages`` (``plan.pair_spec.split_stages``): one encoder stage
    (embedding, the encoder's blocks, its final norm) then one decoder stage (embedding, blocks,
    final norm, head). The layer counts must be the model's."""
    encoder, decoder = model.encoder, model.decoder
    have = (len(encoder.block), len(decoder.block))
    if (sum(s.encoder_layers for s in stages), sum(s.decoder_layers for s in stages)) != have:
        raise ValueError(
            f"the plan's stages hold {sum(s.encoder_layers for s in stages)} encoder and "
            f"{sum(s.decoder_layers for s in stages)} decoder layers, the model has {have[0]} and {have[1]}: "
            "price the pipeline with a cost model of the model's depth"
        )
    if len(stages) != 2 or any(s.encoder_layers and s.decoder_layers for s in stages):
        # a stage after a side's first needs the side's relative position bias table (in its first
        # block), tied across the side's stages: not built
        raise ValueError(
            f"T5 pipelines of {len(stages)} stages: the plugin runs one encoder stage then one decoder stage "
            "(pipeline.stages = 2); more stages per side need each side's position bias table tied across its "
            "stages, which is not built"
        )
    shared = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head.weight is shared.weight
    attr = "embed_tokens.weight"
    shift = functools.partial(type(model)._shift_right, SimpleNamespace(config=model.config))
    scale = model.config.d_model**-0.5 if getattr(model.config, "scale_decoder_outputs", tied) else 1.0
    first = [TiedLayerSpec("shared", Embed, shared, tied_weight_attr=attr), EncoderEntry(encoder)]
    first += [Block(b) for b in encoder.block] + [StackExit(encoder)]
    second = [
        TiedLayerSpec(
            "shared", Embed, shared, forward_fn=functools.partial(_embed_targets, shift), tied_weight_attr=attr
        ),
        DecoderEntry(decoder),
    ]
    second += [Block(b) for b in decoder.block] + [StackExit(decoder, scale)]
    second.append(
        TiedLayerSpec("shared", Embed, shared, forward_fn=_tied_logits, tied_weight_attr=attr) if tied else Head(head)
    )
    return PlannedPipelineModule(
        [*first, *second], [len(first), len(second)], loss_fn=summed_target_loss, partition_method="planned"
    )
