"""A model's sharding units: the modules a sharding plan decides for (plan/sharding/shard_plan.py).

Each decoder layer gives two units, its attention block and its MLP; a T5 block one unit per
sublayer (self-attention, the decoder's cross-attention, feed-forward), of component "encoder" or
"decoder" as the encoder-decoder cost model prices them; the input embedding and an untied LM head
are units of their own; the root (name "") owns every parameter left over (norms, the final norm). Units do not nest, apart from the root, so wrapping them bottom-up
gives every parameter exactly one owner. A tied embedding and head (GPT-2, Gemma) share one
weight used at both ends of the forward: neither is a unit and the root owns it, since a unit of
its own would reshard it after the embedding's forward and the head would read a shard (FSDP1
crashes, FSDP2 refuses a parameter shared across units). T5's one embedding (``shared``) is read
by the encoder, the decoder and the tied head: the root owns it, so the tie holds under any plan.
"""

from __future__ import annotations

from torch import nn

from ..plan.sharding.shard_plan import ShardUnit
from .hf import is_encoder_decoder
from .recompute import _attention, decoder_layers


def unit_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every unit but the root, in forward order."""
    names = {m: n for n, m in model.named_modules()}
    units: dict[str, nn.Module] = {}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
        embed = head = None  # tied: the root owns the weight (a split head, which has no one weight, is untied)
    if is_encoder_decoder(model):
        embed = None  # read by the encoder and again by the decoder: the root owns it, gathered once per step
    if embed is not None:
        units[names[embed]] = embed
    for layer in decoder_layers(model):
        for part in _parts(layer):
            units[names[part]] = part
    if head is not None:
        units[names[head]] = head
    return units


def _parts(layer: nn.Module) -> list[nn.Module]:
    """A block's units: its attention and MLP, or each sublayer of a T5 block (whose ``layer`` list
    starts with its self-attention)."""
    attention = _attention(layer)
    sublayers = getattr(layer, "layer", None)
    if isinstance(sublayers, nn.ModuleList) and len(sublayers) and attention is sublayers[0]:
        return list(sublayers)
    return [p for p in (attention, getattr(layer, "mlp", None)) if p is not None]


def parameter_units(model: nn.Module) -> dict[str, str]:
    """Qualified parameter name (``named_parameters`` order, shared parameters once) -> the unit
    that owns it: the first unit holding it, in forward order; the root "" owns the rest."""
    owner = {}
    for unit, m in unit_modules(model).items():
        for p in m.parameters():
            owner.setdefault(id(p), unit)
    return {name: owner.get(id(p), "") for name, p in model.named_parameters()}


def shard_units(model: nn.Module) -> list[ShardUnit]:
    """The units of ``model`` with their parameter counts, the root last."""
    modules = unit_modules(model)
    layers = decoder_layers(model)
    layer_of = {id(l): i for i, l in enumerate(layers)}
    encoder = model.get_encoder() if is_encoder_decoder(model) else None
    # an encoder-decoder's blocks are priced per side (cost/encoder_decoder.py)
    side = (
        {id(l): ("encoder" if any(l is m for m in encoder.modules()) else "decoder") for l in layers} if encoder else {}
    )
    owner_layer = {}
    for name, m in model.named_modules():
        if id(m) in layer_of:
            owner_layer[name] = (layer_of[id(m)], side.get(id(m), "layer"))
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    params = dict(model.named_parameters())
    counts = dict.fromkeys([*modules, ""], 0)
    for name, unit in parameter_units(model).items():
        counts[unit] += params[name].numel()
    units = []
    for name, m in modules.items():
        if m is embed:
            component, layer = "embedding", -1
        else:
            layer, component = next(
                (found for prefix, found in owner_layer.items() if name.startswith(prefix + ".")), (-1, "head")
            )
        linear_out = m.out_features if isinstance(m, nn.Linear) else 0
        units.append(ShardUnit(name, counts[name], component, layer, linear_out))
    units.append(ShardUnit("", counts[""], "other"))
    return units


def config_units(spec: str | dict) -> tuple[str, list[ShardUnit]]:
    """(model name, units) of a model given as a preset, a HF ``config.json`` path or a dict: built on
    the meta device, so a 6.7B-parameter model costs no memory and no time to inventory. An
    encoder-decoder's (T5's) units are its sublayers, per side."""
    import torch

    from .hf import build_causal_lm, build_seq2seq_lm, hf_config, load_model_config

    cfg = load_model_config(spec)
    build = build_seq2seq_lm if hf_config(cfg).is_encoder_decoder else build_causal_lm
    with torch.device("meta"):
        model = build(cfg)
    name = spec if isinstance(spec, str) else cfg["model_type"]
    return str(name), shard_units(model)
