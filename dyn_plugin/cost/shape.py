"""A model's shape as the cost model prices it, read from its transformers config.

The config is read by attribute (no transformers import: this layer stays pure), so anything
shaped like a ``PretrainedConfig`` works. What is read, and from where:

- widths: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (GQA; absent: as
  many as the query heads), ``head_dim`` where the config sets it (Gemma's 256 is not
  hidden/heads), the MLP's ``intermediate_size`` (GPT-2: ``n_inner``, else 4h), the vocabulary,
  ``tie_word_embeddings``; GPT-2's own names come through the config's ``attribute_map``;
- a mixture of experts: the routed experts (``num_local_experts``: Mixtral; ``num_experts``:
  Qwen2-MoE), ``num_experts_per_tok`` active per token, each ``moe_intermediate_size`` wide
  (Mixtral's experts are ``intermediate_size`` wide), Qwen2-MoE's shared expert
  (``shared_expert_intermediate_size``) and its dense layers (``mlp_only_layers``, and every
  layer off ``decoder_sparse_step``), as transformers' Qwen2MoeDecoderLayer chooses them;
- whether the MLP is gated (SwiGLU/GeGLU: act(x W_gate) * x W_up, one more h x f matrix than
  GPT's act(x W_up)): see :func:`gated_mlp`.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelShape

# MLP projections a config's tensor-parallel plan names: a gate, fused with the up projection or not
GATE_PROJECTIONS = ("gate_proj", "gate_up_proj")
# activations of MLPs with no gate, as configs without a layout name them (GPT-2, OPT, Falcon, GPT-J)
PLAIN_ACTIVATIONS = ("gelu", "relu", "tanh")
GLU_ACTIVATIONS = ("silu", "swish")


def gated_mlp(config: Any) -> bool:
    """Whether the model's MLP multiplies by a gate.

    The activation alone does not say: Gemma's GELU MLP is gated and GPT-NeoX's is not, and
    model types are no guide for a family this list has not seen. What the model computes is its
    modules, and a transformers 5 config declares them: ``base_model_tp_plan`` names every
    linear layer tensor parallelism shards, ``mlp.gate_proj`` (Llama, Mistral, Qwen2, Gemma,
    OLMo2), ``mlp.gate_up_proj`` (Phi3, fused) or ``experts.gate_up_proj`` (Mixtral, Qwen2-MoE)
    where there is a gate, ``mlp.dense_h_to_4h`` (GPT-NeoX) or ``mlp.c_fc`` where there is none.
    A config without MLP entries there (GPT-2, OPT, Falcon declare no plan) is decided by its
    activation: in transformers 5.24 every such family with a SiLU MLP gates it (SwiGLU: GPT-OSS,
    Hunyuan, Emu3) and every GELU/ReLU one does not; anything else is refused rather than guessed.
    """
    text = _text_config(config)
    mlp = [
        name.rsplit(".", 1)[-1]
        for name in (getattr(text, "base_model_tp_plan", None) or {})
        if any(part in name for part in ("mlp.", "feed_forward.", "experts."))
    ]
    if mlp:
        return any(name in GATE_PROJECTIONS for name in mlp)
    act = next(
        (
            str(value).lower()
            for key in ("hidden_act", "hidden_activation", "activation_function", "activation")
            if isinstance(value := getattr(text, key, None), str)
        ),
        "",
    )
    if any(name in act for name in GLU_ACTIVATIONS):
        return True
    if any(name in act for name in PLAIN_ACTIVATIONS):
        return False
    raise ValueError(
        f"cannot tell whether the MLP of {getattr(text, 'model_type', type(text).__name__)!r} is gated: its config "
        f"declares no MLP modules (base_model_tp_plan) and its activation {act or 'is not named'!r} does not say; "
        "give the shape in dyn_plugin.cost_model.model (gated_mlp and the widths)"
    )


def shape_from_config(config: Any) -> ModelShape:
    """The shape of the transformers model ``config`` describes (its text model's, for a
    multimodal config)."""
    c = _text_config(config)
    hidden, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    # Llama's config sets head_dim to hidden/heads, Qwen2's leaves it out: the same shape, written one way
    head_dim = getattr(c, "head_dim", None)
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
    moe: dict[str, Any] = {}
    if experts:
        sparse_step = getattr(c, "decoder_sparse_step", None) or 1
        dense_only = set(getattr(c, "mlp_only_layers", None) or ())
        moe = dict(
            num_experts=experts,
            experts_per_token=c.num_experts_per_tok,
            expert_ffn_hidden_size=getattr(c, "moe_intermediate_size", None) or ffn,
            shared_expert_ffn_hidden_size=getattr(c, "shared_expert_intermediate_size", None) or 0,
            dense_layers=sum(i in dense_only or (i + 1) % sparse_step != 0 for i in range(layers)),
        )
    return ModelShape(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None),
        head_dim=None if head_dim == hidden // heads else head_dim,
        ffn_hidden_size=ffn,
        vocab_size=c.vocab_size,
        gated_mlp=gated_mlp(c),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        **moe,
    )


def differences(measured: ModelShape, trained: ModelShape) -> list[str]:
    """The fields in which two shapes differ, as ``name measured -> trained``, defaults resolved
    (a head_dim left out is hidden/heads). ``flash_attention`` is how a run computes attention,
    not the model's shape, and is left out."""
    a, b = _resolved(measured), _resolved(trained)
    return [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k]]


def _resolved(shape: ModelShape) -> dict[str, Any]:
    fields = shape.model_dump(exclude={"flash_attention"})
    fields.update(
        num_kv_heads=shape.num_kv_heads or shape.num_heads,
        head_dim=shape.query_width // shape.num_heads,
        expert_ffn_hidden_size=(shape.expert_ffn_hidden_size or shape.ffn_hidden_size) if shape.num_experts else None,
    )
    return fields


def describe(shape: ModelShape) -> str:
    """One line a person recognises a model by."""
    r = _resolved(shape)
    mlp = f"{'gated' if shape.gated_mlp else 'plain'} MLP {shape.ffn_hidden_size}"
    if shape.num_experts:
        mlp = (
            f"{shape.num_experts} {'gated' if shape.gated_mlp else 'plain'} experts of {r['expert_ffn_hidden_size']} "
            f"({shape.experts_per_token} per token"
            + (f", shared {shape.shared_expert_ffn_hidden_size}" if shape.shared_expert_ffn_hidden_size else "")
            + (f", {shape.dense_layers} dense layers of {shape.ffn_hidden_size}" if shape.dense_layers else "")
            + ")"
        )
    return (
        f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads} heads of {r['head_dim']} "
        f"({r['num_kv_heads']} key/value), {mlp}, vocabulary {shape.vocab_size}"
        + (" tied" if shape.tied_embeddings else "")
    )


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
