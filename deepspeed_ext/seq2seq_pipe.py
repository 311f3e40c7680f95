"""A transformers T5 as a DeepSpeed ``PipelineModule`` of encoder stages then decoder stages.

Megatron's split (``plan.pair_spec``): stages before the split rank run encoder layers, the
others decoder layers. What crosses a link is what ``instructions.link_shapes`` describes and
``EncoderDecoderCostModel.link_bytes`` prices: an encoder stage sends its hidden states, the last
one the encoder output (after the encoder's final norm); a decoder stage sends its hidden states
and the encoder output every later cross-attention reads. The stage input the engine builds is
``(*received tensors, *loaded token ids, input attention mask)``: the first stage gets the input
ids, the first decoder stage the encoder output and the labels, which it shifts into the
decoder's inputs as the model does (``_shift_right``); a later stage its neighbour's tensors.

Nothing else crosses. Every stage builds its masks (bidirectional over the input, causal over the
target, input padding for cross-attention) with the model's own mask functions from the input
padding mask (loaded, or rebuilt from the plan's lengths). T5 computes the relative position bias
of each stack's self-attention in its first block and hands it to the others; a later stage of the
side recomputes it from the same table, which is DeepSpeed's tied layer across the side's stages
(cheap, and exact: the table's gradients from every stage are summed). Cross-attention has no
position bias (zeros, which each stage's first decoder block makes itself, as block 0 does).

The shared embedding (encoder input, decoder input, and the head's weight) is a tied layer too:
one module on every stage that uses it, its weight broadcast at start and its gradients summed
between those stages after every step.
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


class RelativeBias(nn.Module):
    """A stack's relative position bias table (its first block's), computed as that block's
    self-attention computes it (``T5Attention.compute_bias``)."""

    def __init__(self, attention: nn.Module) -> None:
        from transformers.models.t5 import modeling_t5

        super().__init__()
        self.relative_attention_bias = attention.relative_attention_bias
        self.is_decoder = attention.is_decoder
        self.relative_attention_num_buckets = attention.relative_attention_num_buckets
        self.relative_attention_max_distance = attention.relative_attention_max_distance
        self._relative_position_bucket = modeling_t5.T5Attention._relative_position_bucket
        self._compute = modeling_t5.T5Attention.compute_bias

    def forward(self, length: int, device: torch.device) -> torch.Tensor:
        return self._compute(self, length, length, device=device)


def _anchor(table: RelativeBias, state: tuple) -> tuple:
    """On the stage of a stack's first block, which computes the bias itself: the table is only
    held there, so that DeepSpeed ties it with the side's later stages."""
    return state


def _resume_encoder(config, table: RelativeBias, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """A later encoder stage: the received hidden states, the padding mask as the stack builds it,
    the position bias from the tied table."""
    from transformers.models.t5 import modeling_t5

    hidden, attention_mask = inputs
    mask = modeling_t5.create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)
    return hidden, mask, table(hidden.shape[1], hidden.device), None, None, None


def _resume_decoder(config, table: RelativeBias, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
    """A later decoder stage: the received hidden states and encoder output, the masks as the
    stack builds them, the self-attention's position bias from the tied table."""
    from transformers.models.t5 import modeling_t5

    hidden, encoder_output, attention_mask = inputs
    causal = modeling_t5.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None)
    cross = modeling_t5.create_bidirectional_mask(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, encoder_hidden_states=encoder_output
    )
    return hidden, causal, table(hidden.shape[1], hidden.device), encoder_output, cross, None


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


class StageOut(nn.Module):
    """What a stage that does not end its side sends on: the hidden states, and on a decoder stage
    the encoder output too (``instructions.link_shapes``)."""

    def forward(self, state: tuple) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden, _, _, encoder_output, _, _ = state
        return hidden if encoder_output is None else (hidden, encoder_output)


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
    ``lm_head``) as the pipeline stages ``stages`` (``plan.pair_spec.split_stages``): encoder stages
    (the first embeds, the last ends with the encoder's final norm) then decoder stages (the first
    embeds the shifted targets, the last ends with the final norm and the head), each holding its
    stage's count of its side's blocks, in order. The layer counts must be the model's."""
    encoder, decoder = model.encoder, model.decoder
    have = (len(encoder.block), len(decoder.block))
    if (sum(s.encoder_layers for s in stages), sum(s.decoder_layers for s in stages)) != have:
        raise ValueError(
            f"the plan's stages hold {sum(s.encoder_layers for s in stages)} encoder and "
            f"{sum(s.decoder_layers for s in stages)} decoder layers, the model has {have[0]} and {have[1]}: "
            "price the pipeline with a cost model of the model's depth"
        )
    if len(stages) < 2 or any(s.encoder_layers and s.decoder_layers for s in stages):
        raise ValueError(
            f"stages {list(stages)}: a pipeline runs encoder stages then decoder stages, one kind of layer on "
            "each (one stage, pp = 1, trains data-parallel without a PipelineModule)"
        )
    shared = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head.weight is shared.weight
    attr = "embed_tokens.weight"
    shift = functools.partial(type(model)._shift_right, SimpleNamespace(config=model.config))
    scale = model.config.d_model**-0.5 if getattr(model.config, "scale_decoder_outputs", tied) else 1.0
    layers, counts = [], []
    for side, stack in (("encoder", encoder), ("decoder", decoder)):
        own = [n for n in (s.encoder_layers if side == "encoder" else s.decoder_layers for s in stages) if n]
        blocks = iter(stack.block)
        bias, table = f"{side}_position_bias", stack.block[0].layer[0].SelfAttention
        for k, n in enumerate(own):
            if k == 0:
                embed = functools.partial(_embed_targets, shift) if side == "decoder" else None
                stage = [TiedLayerSpec("shared", Embed, shared, forward_fn=embed, tied_weight_attr=attr)]
                stage.append(EncoderEntry(stack) if side == "encoder" else DecoderEntry(stack))
                if len(own) > 1:  # block 0's table, tied with the side's later stages
                    stage.append(TiedLayerSpec(bias, RelativeBias, table, forward_fn=_anchor, tied_weight_attr=_TABLE))
            else:
                resume = functools.partial(_resume_encoder if side == "encoder" else _resume_decoder, stack.config)
                stage = [TiedLayerSpec(bias, RelativeBias, table, forward_fn=resume, tied_weight_attr=_TABLE)]
            stage += [Block(next(blocks)) for _ in range(n)]
            if k < len(own) - 1:
                stage.append(StageOut())
            elif side == "encoder":
                stage.append(StackExit(stack))
            else:
                logits = TiedLayerSpec("shared", Embed, shared, forward_fn=_tied_logits, tied_weight_attr=attr)
                stage += [StackExit(stack, scale), logits if tied else Head(head)]
            layers += stage
            counts.append(len(stage))
    return PlannedPipelineModule(layers, counts, loss_fn=summed_target_loss, partition_method="planned")


_TABLE = "relative_attention_bias.weight"  # what DeepSpeed ties of a RelativeBias
