"""A transformers causal LM as a DeepSpeed ``PipelineModule``, cut where the planner cut it.

The planner prices each stage by its layer count (``PlannerSpec.stages``), so the module must
hold exactly those layers on each stage: DeepSpeed's partition methods balance parameters or
layer types instead, hence ``PlannedPipelineModule`` takes the cut points directly.

Between layers flows ``(hidden, position_ids)``; only ``hidden`` crosses stages, every stage
rebuilds the position ids from its plan. Attention gets no mask: the plugin's per-document
kernel (or flash-attention) isolates packed documents by position-id resets, and right-padded
rows are handled by causality.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from dyn_plugin.host.attention import DOCUMENT_KERNELS
from dyn_plugin.runtime.collate import IGNORE


class PlannedPipelineModule(PipelineModule):
    """``PipelineModule`` with ``layers_per_stage`` counts of ``layers`` on each stage, in order."""

    def __init__(self, layers: Sequence[nn.Module], layers_per_stage: Sequence[int], **kwargs) -> None:
        if sum(layers_per_stage) != len(layers):
            raise ValueError(
                f"layers_per_stage {list(layers_per_stage)} covers {sum(layers_per_stage)} layers, "
                f"the module has {len(layers)}"
            )
        self._cuts = [0]
        for n in layers_per_stage:
            self._cuts.append(self._cuts[-1] + n)
        super().__init__(layers, num_stages=len(layers_per_stage), **kwargs)

    def _partition_layers(self, method: str = "planned") -> None:
        self.parts = list(self._cuts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


@dataclass(frozen=True)
class Body:
    """What the stages take from a transformers causal LM: the same pieces under each family's own
    names (``body_of``)."""

    embed_tokens: nn.Module
    layers: Sequence[nn.Module]
    norm: nn.Module
    rotary_emb: nn.Module | None  # None: no rotary embedding (GPT-2's learned positions instead)
    positions: nn.Module | None = None  # learned absolute positions, added to the token embeddings
    dropout: nn.Module | None = None  # applied to the embeddings, as the model's forward does


def body_of(model: nn.Module) -> Body:
    """The pieces of ``model``: Llama-shaped models (``model.embed_tokens/layers/norm/rotary_emb``:
    Llama, Mistral, Qwen2, Qwen2-MoE, Mixtral, Phi3, Gemma, OLMo2, ...), GPT-NeoX and GPT-2."""
    inner = getattr(model, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return Body(inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb)
    neox = getattr(model, "gpt_neox", None)
    if neox is not None:
        return Body(neox.embed_in, neox.layers, neox.final_layer_norm, neox.rotary_emb, dropout=neox.emb_dropout)
    gpt2 = getattr(model, "transformer", None)
    if gpt2 is not None and all(hasattr(gpt2, a) for a in ("wte", "wpe", "h", "ln_f")):
        return Body(gpt2.wte, gpt2.h, gpt2.ln_f, None, positions=gpt2.wpe, dropout=gpt2.drop)
    raise ValueError(
        f"{type(model).__name__} is none of the causal LM layouts the stages know (Llama-shaped "
        "model.embed_tokens/layers/norm/rotary_emb, GPT-NeoX, GPT-2); build a PipelineModule yourself and pass "
        "it as the model"
    )


class Embed(nn.Module):
    """The token embedding (the layer a tied head shares with the first stage)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return self.embed_tokens(input_ids), position_ids


class Positions(nn.Module):
    """What the model's forward adds to the token embeddings: learned absolute positions (GPT-2's
    ``wpe``) and the embedding dropout; a layer of its own, so a tied head's copy of ``Embed`` on
    the last stage holds the shared weight alone."""

    def __init__(self, positions: nn.Module | None, dropout: nn.Module | None) -> None:
        super().__init__()
        self.positions, self.dropout = positions, dropout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return hidden, position_ids


class Decoder(nn.Module):
    """One decoder layer with its rotary table. ``layer_type``: the layer's entry of the config's
    ``layer_types`` where the rotary embedding differs per type (Gemma3: local and global
    layers rotate with different bases), None where one table serves every layer."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module | None, layer_type: str | None = None) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.layer_type = layer, rotary_emb, layer_type

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        rope = {}
        if self.rotary_emb is not None:
            # recomputed per layer (a [tokens, head_dim] table) so that no layer depends on another's state
            by_type = () if self.layer_type is None else (self.layer_type,)
            rope = {"position_embeddings": self.rotary_emb(hidden, position_ids, *by_type)}
        return self.layer(hidden, attention_mask=None, position_ids=position_ids, **rope), position_ids


def _layer_types(model: nn.Module, rotary_emb: nn.Module | None, layers: int) -> list[str | None]:
    """Each layer's rotary type (see ``Decoder``): the config's ``layer_types`` where the rotary
    embedding's forward takes one, else None for every layer."""
    if rotary_emb is None or "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return [None] * layers
    return list(model.config.layer_types[:layers])


def _soft_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's ``final_logit_softcapping``, as its own forward applies it."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None = None) -> None:
        super().__init__()
        self.norm, self.lm_head, self.softcap = norm, lm_head, softcap

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _soft_capped(self.lm_head(self.norm(inputs[0])), self.softcap)


class Norm(nn.Module):
    """The final norm, a layer of its own where the head is the tied embedding's other use."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


def _tied_head(softcap: float | None, embed: Embed, hidden: torch.Tensor) -> torch.Tensor:
    """The head as the tied embedding's second use: logits against its weight."""
    return _soft_capped(F.linear(hidden, embed.embed_tokens.weight), softcap)


def _ends(body: Body, lm_head: nn.Module, softcap: float | None, stages: int) -> tuple[list, list]:
    """The first stage's leading layers and the last stage's trailing ones. A head tied to the
    embedding (Gemma, GPT-2 style) on another stage than the embedding is DeepSpeed's tied layer: one
    ``Embed`` built on both stages, its weight broadcast at start and its gradients summed between
    them after every step (``_exec_reduce_tied_grads``), as if the two uses were one parameter."""
    added = body.positions is not None or body.dropout is not None
    extras = [Positions(body.positions, body.dropout)] if added else []
    if lm_head.weight is not body.embed_tokens.weight or stages == 1:
        return [Embed(body.embed_tokens), *extras], [Head(body.norm, lm_head, softcap)]
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("a head tied to the embedding with a bias of its own: the stages tie the weight only")
    attr = "embed_tokens.weight"
    first = TiedLayerSpec("embed_tokens", Embed, body.embed_tokens, tied_weight_attr=attr)
    head = TiedLayerSpec(
        "embed_tokens",
        Embed,
        body.embed_tokens,
        forward_fn=functools.partial(_tied_head, softcap),
        tied_weight_attr=attr,
    )
    return [first, *extras], [Norm(body.norm), head]


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
    """Cross-entropy summed over the scored tokens (HF's shift: position t predicts label t+1).
    ``shifted``: ``labels[t]`` is already position t's target, as a sequence-parallel shard holds
    them (its last position's target is the next shard's first token, which it cannot shift in).

    A sum, not a mean: the engine divides by the whole global batch's scored tokens."""
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def causal_lm_pipe(model: nn.Module, layers_per_stage: Sequence[int]) -> PlannedPipelineModule:
    """A transformers ``*ForCausalLM`` (``body_of``) as pipeline stages holding ``layers_per_stage``
    decoder layers each; the first stage also embeds, the last also runs the norm and the head,
    as the planner's cost model assumes."""
    body = body_of(model)
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in DOCUMENT_KERNELS:
        raise ValueError(
            f"attention implementation {attn!r} needs a mask to keep packed documents apart; pipeline "
            f"stages pass none: use one of {DOCUMENT_KERNELS} (dyn_plugin.models.hf.build_causal_lm "
            "defaults to 'dyn_varlen')"
        )
    if sum(layers_per_stage) != len(body.layers):
        raise ValueError(
            f"layers_per_stage {list(layers_per_stage)} sums to {sum(layers_per_stage)}, "
            f"the model has {len(body.layers)} decoder layers"
        )
    # Gemma's embedding scales by sqrt(hidden_size) inside embed_tokens (transformers 5), so the
    # first stage's embedding is the model's own
    types = _layer_types(model, body.rotary_emb, len(body.layers))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    first, last = _ends(body, model.get_output_embeddings(), softcap, len(layers_per_stage))
    layers = [*first, *(Decoder(l, body.rotary_emb, t) for l, t in zip(body.layers, types)), *last]
    counts = list(layers_per_stage)
    counts[0] += len(first)
    counts[-1] += len(last)
    return PlannedPipelineModule(layers, counts, loss_fn=summed_token_loss, partition_method="planned")
