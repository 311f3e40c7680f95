"""The cost model's shape of each family, read from its transformers config (cost/shape.py), and
priced as the model computes: the analytic FLOPs and parameter counts are checked against the
tiny model itself (torch's FLOP counter, its own parameters), and a profile measured on one shape
is refused for a model of another."""

from __future__ import annotations

import logging

import pytest

from dyn_plugin.config import ClusterConfig, CostModelConfig, DeviceSpec, ModelShape
from dyn_plugin.cost.analytic import analytic_cost_model, layer_flops_per_token, param_counts
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.cost.shape import differences, gated_mlp, shape_from_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

H, LAYERS, HEADS, KV, FFN, VOCAB = 64, 2, 4, 2, 128, 256
COMMON = dict(
    hidden_size=H,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
# family -> (its config beyond COMMON, the fields of its shape beyond the common widths)
FAMILIES = {
    "llama": ({}, {}),
    "mistral": ({}, {}),
    "qwen2": ({}, {}),
    "qwen2_moe": (
        # 8 experts of 32, 2 per token, a shared expert of 64; layer 1 keeps a dense MLP
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        ),
        dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=32, shared_expert_ffn_hidden_size=64),
    ),
    "mixtral": (
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
        dict(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=96, ffn_hidden_size=96),
    ),
    "phi3": (dict(pad_token_id=0), {}),  # its gate is fused with the up projection (gate_up_proj)
    "gemma2": (dict(head_dim=32), dict(head_dim=32, tied_embeddings=True)),  # heads wider than hidden/heads
    "gemma3_text": (dict(head_dim=32), dict(head_dim=32, tied_embeddings=True)),
    "gpt_neox": (dict(num_key_value_heads=None), dict(gated_mlp=False, num_kv_heads=None)),
    "gpt2": (None, dict(gated_mlp=False, num_kv_heads=None, ffn_hidden_size=4 * H, tied_embeddings=True)),
    "olmo2": ({}, {}),
}


def family_config(family: str):
    extra, _ = FAMILIES[family]
    if extra is None:  # GPT-2 names its widths its own way
        return AutoConfig.for_model("gpt2", n_embd=H, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=256)
    kw = {k: v for k, v in {**COMMON, **extra}.items() if v is not None}
    return AutoConfig.for_model(family, **kw)


def tiny_model(family: str):
    cfg = family_config(family)
    # counted FLOPs need the plain implementations: eager attention, and experts looped over (the
    # grouped kernel is invisible to torch's FLOP counter)
    cfg._attn_implementation, cfg._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_shape_is_read_from_the_config(family):
    _, fields = FAMILIES[family]
    want = dict(
        hidden_size=H,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV,
        head_dim=None,  # hidden/heads
        ffn_hidden_size=FFN,
        vocab_size=VOCAB,
        gated_mlp=True,
        tied_embeddings=False,
        dense_layers=1 if family == "qwen2_moe" else 0,
    )
    want.update(fields)
    shape = shape_from_config(family_config(family))
    assert {k: getattr(shape, k) for k in want} == want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_and_parameters_are_the_models_own(family):
    """Forward FLOPs counted on the real model at two lengths separate the per-token (linear layers,
    head) and per-pair (attention) terms, exactly; the analytic ones must be the same. Eager attention
    computes every pair, the analytic model the causal half. Qwen2-MoE's shared-expert gate (h -> 1)
    is not priced: 2h FLOPs and h weights of a layer's tens of thousands."""
    model, shape = tiny_model(family), shape_from_config(family_config(family))

    def counted(length: int) -> float:
        with FlopCounterMode(display=False) as fc:
            model(input_ids=torch.randint(0, VOCAB, (1, length)), use_cache=False)
        return fc.get_total_flops()

    f8, f16 = counted(8), counted(16)  # F(s) = a*s + b*s^2
    per_pair = (f16 - 2 * f8) / 128
    per_token = (f8 - 64 * per_pair) / 8
    linear, attention = layer_flops_per_token(shape)
    assert per_token == pytest.approx(LAYERS * linear + 2 * H * VOCAB, rel=1e-2 if family == "qwen2_moe" else 1e-12)
    assert per_pair == pytest.approx(LAYERS * 2 * attention, rel=1e-12)

    params = param_counts(shape)
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h
    matrices = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() >= 2) / len(layers)
    assert matrices == pytest.approx(params["layer"] - 4 * H, rel=1e-2 if family == "qwen2_moe" else 1e-12)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (params["head"] == H) == tied == shape.tied_embeddings


def test_experts_and_heads_scale_the_costs():
    dense = ModelShape(hidden_size=512, num_layers=4, num_heads=8, ffn_hidden_size=1024, vocab_size=1000)
    moe = dense.model_copy(update=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=512))
    lin_dense, att_dense = layer_flops_per_token(dense)
    lin_moe, att_moe = layer_flops_per_token(moe)
    # two active experts of 512 compute as one MLP of 1024, plus the router's 8 logits
    assert lin_moe - lin_dense == 2 * 512 * 8 and att_moe == att_dense
    # ... but all eight are held
    assert param_counts(moe)["layer"] - param_counts(dense)["layer"] == 512 * 8 + 3 * 512 * 512 * 6
    # half of the layers dense: the mean layer
    half = moe.model_copy(update=dict(dense_layers=2))
    assert layer_flops_per_token(half)[0] == pytest.approx((lin_moe + lin_dense) / 2)
    # heads twice as wide: twice the attention per pair, and Q, K, V and the output projection 512 wider each
    wide = dense.model_copy(update=dict(head_dim=128))
    lin_wide, att_wide = layer_flops_per_token(wide)
    assert att_wide == 2 * att_dense and lin_wide - lin_dense == 4 * 2 * 512 * 512
    device = DeviceSpec()
    stored = [analytic_cost_model(s, device).micro_batch_cost([256], layout="packed") for s in (dense, wide)]
    assert stored[1].stored_bytes > stored[0].stored_bytes  # Q, K, V and the attention output are wider


def test_gated_is_decided_by_the_declared_modules_then_the_activation():
    from types import SimpleNamespace as NS

    assert gated_mlp(NS(base_model_tp_plan={"layers.*.mlp.gate_proj": "colwise"}, hidden_act="gelu"))
    assert not gated_mlp(NS(base_model_tp_plan={"layers.*.mlp.c_fc": "colwise"}, hidden_act="silu"))
    assert gated_mlp(NS(base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"}, hidden_act="silu"))
    assert not gated_mlp(NS(activation_function="relu"))
    with pytest.raises(ValueError, match="cannot tell whether the MLP of 'mystery' is gated.*cost_model.model"):
        gated_mlp(NS(model_type="mystery"))


def _profile_with(shape: ModelShape | None, tmp_path):
    import json

    from dyn_plugin.cost.bundled import DIR

    raw = json.loads((DIR / "a100-gpt-6.7b.json").read_text())
    raw["version"] = 4
    raw["model"]["name"] = "tiny-llama"
    raw["model"]["shape"] = shape.model_dump() if shape else None
    del raw["sha256"]  # edited here on purpose
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    return CostModelConfig(kind="profile", profile=str(path))


def test_a_profile_is_refused_for_a_model_of_another_shape(tmp_path, caplog):
    llama, gemma = shape_from_config(family_config("llama")), shape_from_config(family_config("gemma2"))
    cfg, cluster = _profile_with(llama, tmp_path), ClusterConfig()
    assert build_cost_model(cfg, cluster, llama).num_layers == 32  # the profile's own shape: used
    assert differences(llama, llama.model_copy(update={"head_dim": None})) == []  # defaults resolved
    with pytest.raises(ValueError) as refused:
        build_cost_model(cfg, cluster, gemma)
    msg = str(refused.value)
    assert "was measured on 'tiny-llama' (hidden 64, 2 layers, 4 heads of 16 (2 key/value), gated MLP 128" in msg
    assert "the model trained is another (hidden 64, 2 layers, 4 heads of 32 (2 key/value)" in msg
    assert "head_dim 16 -> 32, tied_embeddings False -> True" in msg
    assert "dynplugin profile --model" in msg and "cost_model.kind to 'analytic'" in msg
    # a profile that records no shape cannot be checked: used, with a warning that says so
    with caplog.at_level(logging.WARNING):
        build_cost_model(_profile_with(None, tmp_path), cluster, gemma)
    assert "records no model shape" in caplog.text


def test_megatrons_view_is_the_same_shape():
    """Megatron's GPT in the tiny-llama shape (the Megatron benchmark's model) is the shape a
    tiny-llama profile records, so the profile is used for it; its MoE settings are read too."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace as NS

    from megatron.core.transformer import TransformerConfig

    from dyn_plugin.bench.train_megatron import TINY_LLAMA
    from dyn_plugin.models.hf import PRESETS, hf_config
    from megatron_patches.runtime import model_shape_view

    t = TINY_LLAMA
    common = dict(num_layers=t["layers"], hidden_size=t["hidden"], num_attention_heads=t["heads"])
    dense = TransformerConfig(
        **common, num_query_groups=t["kv_heads"], ffn_hidden_size=t["ffn"], gated_linear_unit=True
    )
    view = model_shape_view(NS(config=dense, vocab_size=t["vocab"], share_embeddings_and_output_weights=False))
    assert differences(shape_from_config(hf_config(PRESETS["tiny-llama"])), view) == []
    moe = TransformerConfig(
        **common,
        ffn_hidden_size=t["ffn"],
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_layer_freq=[1, 0, 1, 1],
    )
    view = model_shape_view(NS(config=moe, vocab_size=t["vocab"], share_embeddings_and_output_weights=True))
    assert (view.num_experts, view.experts_per_token, view.expert_ffn_hidden_size, view.dense_layers) == (8, 2, 64, 1)
    assert not view.gated_mlp and view.tied_embeddings
