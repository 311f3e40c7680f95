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
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from dyn_plugin.host.attention import DOCUMENT_KERNELS
from dyn_plugin.host.exactness import Difference
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
    """The token embedding (the layer a tied head shares with the first stage), times the family's
    embedding multiplier where its forward has one (Granite's ``embedding_multiplier``)."""

    def __init__(self, embed_tokens: nn.Module, multiplier: float | None = None) -> None:
        super().__init__()
        self.embed_tokens, self.multiplier = embed_tokens, multiplier

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        hidden = self.embed_tokens(input_ids)
        return (hidden if self.multiplier is None else hidden * self.multiplier), position_ids


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


@dataclass(frozen=True)
class Around:
    """What a family's forward does around its layers, which the stages do too: the embedding's
    multiplier, a factor on the logits and their soft-cap, each as the model's own forward applies it."""

    embedding: float | None = None  # Granite: embeddings * embedding_multiplier
    logits: float | None = None  # Granite: logits / logits_scaling; Cohere: logits * logit_scale
    softcap: float | None = None  # Gemma2/3: tanh(logits / cap) * cap

    def head(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logits is not None:
            logits = logits * self.logits
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def _uses(cls: type, name: str) -> bool:
    """Whether ``cls.forward``'s own code reads ``name`` (a family's forward, from transformers' source)."""
    try:
        return name in inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):  # no source, or no such class (GPT-2 has no inner .model)
        return False


def around(model: nn.Module) -> Around:
    """``Around`` as ``model``'s forward (and its inner model's) does it, read from their code: the
    families of transformers 5.24 scale their embeddings (``embedding_multiplier``) and their logits
    (``logits_scaling``, ``logit_scale``) in those names. The start-up check
    (``stage_difference``) catches whatever else a family does there."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embedding_multiplier", None) if _uses(type(inner), "embedding_multiplier") else None
    factor = None
    if _uses(type(model), "logits_scaling"):
        factor = 1.0 / model.config.logits_scaling
    elif _uses(type(model), "logit_scale") and isinstance(getattr(model, "logit_scale", None), (int, float)):
        factor = float(model.logit_scale)
    return Around(embedding, factor, getattr(model.config, "final_logit_softcapping", None))


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, outside: Around = Around()) -> None:
        super().__init__()
        self.norm, self.lm_head, self.outside = norm, lm_head, outside

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.outside.head(self.lm_head(self.norm(inputs[0])))


class Norm(nn.Module):
    """The final norm, a layer of its own where the head is the tied embedding's other use."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


def _tied_head(outside: Around, embed: Embed, hidden: torch.Tensor) -> torch.Tensor:
    """The head as the tied embedding's second use: logits against its weight."""
    return outside.head(F.linear(hidden, embed.embed_tokens.weight))


def _ends(body: Body, lm_head: nn.Module, outside: Around, stages: int) -> tuple[list, list]:
    """The first stage's leading layers and the last stage's trailing ones. A head tied to the
    embedding (Gemma, GPT-2 style) on another stage than the embedding is DeepSpeed's tied layer: one
    ``Embed`` built on both stages, its weight broadcast at start and its gradients summed between
    them after every step (``_exec_reduce_tied_grads``), as if the two uses were one parameter."""
    added = body.positions is not None or body.dropout is not None
    extras = [Positions(body.positions, body.dropout)] if added else []
    if lm_head.weight is not body.embed_tokens.weight or stages == 1:
        return [Embed(body.embed_tokens, outside.embedding), *extras], [Head(body.norm, lm_head, outside)]
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("a head tied to the embedding with a bias of its own: the stages tie the weight only")
    attr = "embed_tokens.weight"
    first = TiedLayerSpec("embed_tokens", Embed, body.embed_tokens, outside.embedding, tied_weight_attr=attr)
    head = TiedLayerSpec(
        "embed_tokens",
        Embed,
        body.embed_tokens,
        outside.embedding,
        forward_fn=functools.partial(_tied_head, outside),
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


def stage_layers(model: nn.Module, layers_per_stage: Sequence[int]) -> tuple[list, list[int]]:
    """The layers of the stages (modules and DeepSpeed's tied-layer specs), in order, and how many each
    stage holds: ``layers_per_stage`` decoder layers, the first stage also the embedding, the last
    the norm and the head, as the planner's cost model assumes."""
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
    first, last = _ends(body, model.get_output_embeddings(), around(model), len(layers_per_stage))
    layers = [*first, *(Decoder(l, body.rotary_emb, t) for l, t in zip(body.layers, types)), *last]
    counts = list(layers_per_stage)
    counts[0] += len(first)
    counts[-1] += len(last)
    return layers, counts


def causal_lm_pipe(model: nn.Module, layers_per_stage: Sequence[int]) -> PlannedPipelineModule:
    """A transformers ``*ForCausalLM`` (``body_of``) as pipeline stages holding ``layers_per_stage``
    decoder layers each (``stage_layers``)."""
    layers, counts = stage_layers(model, layers_per_stage)
    return PlannedPipelineModule(layers, counts, loss_fn=summed_token_loss, partition_method="planned")


def _runnable(layer) -> Callable:
    """A stage layer as the pipeline runs it: a module, or a tied-layer spec's module through its forward_fn."""
    if not isinstance(layer, TiedLayerSpec):
        return layer
    module = layer.build()
    return functools.partial(layer.forward_fn, module) if layer.forward_fn is not None else module


def stage_difference(model: nn.Module, layers_per_stage: Sequence[int]) -> Difference | None:
    """The start-up check of the stages (``dyn_plugin.host.exactness``): ``stage_layers`` run one
    after another on this process against the model's own forward, on one packed row; None when they
    agree, else the first piece whose output differs (the embedding, a decoder layer, the head)."""
    from dyn_plugin.host import exactness
    from dyn_plugin.models.varlen_attention import cumulative_offsets, documents
    from dyn_plugin.runtime.collate import collate

    layers, _ = stage_layers(model, layers_per_stage)
    body = body_of(model)
    docs = exactness.probe_tokens(model, exactness.PROBE_LENGTHS)
    lengths = [len(d) for d in docs]
    device = next(model.parameters()).device
    batch = collate(list(range(len(docs))), lengths, "packed", [1, sum(lengths)], lambda i: {"input_ids": docs[i]})
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    theirs: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(_first_input(theirs), with_kwargs=True) for layer in body.layers]
    ours: list[torch.Tensor] = []
    try:
        with exactness.evaluating(model):
            want = exactness.logits_of(model(**exactness.model_inputs(batch), use_cache=False))
            x: Any = (batch["input_ids"], batch["position_ids"])
            with documents(cumulative_offsets(batch["position_ids"], 1, sum(lengths), device)):
                for layer in map(_runnable, layers):
                    if isinstance(layer, Decoder):
                        ours.append(x[0].float())
                    x = layer(x)
            got = x.float()
    finally:
        for h in hooks:
            h.remove()
    tolerance = exactness.tolerance_of(model)
    worst = exactness.relative(got, want)
    if worst <= tolerance:
        return None
    pieces = [f"the embedding (what {type(model).__name__}'s forward does before its first decoder layer)"]
    pieces += [f"decoder layer {i}" for i in range(len(theirs) - 1)]
    for piece, a, b in zip(pieces, ours, theirs):
        if exactness.relative(a, b) > tolerance:
            return Difference("pipeline stages", piece, worst, tolerance)
    piece = f"the head (what {type(model).__name__}'s forward does after its last decoder layer)"
    return Difference("pipeline stages", piece, worst, tolerance)


def _first_input(into: list) -> Callable:
    def hook(module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        into.append(hidden.detach().float())

    return hook
