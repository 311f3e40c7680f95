"""Plain PyTorch FSDP with a sharding plan (dyn_plugin/fsdp): the split linear layer, plan checks,
and exact token-mean training on 2 and 4 gloo ranks (FSDP1 policy, FSDP2 plan, integer reshard,
a 2x2 hybrid mesh), with the measured peak memory against the plan's prediction."""

import copy
import json

import pytest
import torch
from torch import nn

from dyn_plugin.fsdp.targets import wrap_targets
from dyn_plugin.models.hf import build_causal_lm
from dyn_plugin.models.shard_units import shard_units
from dyn_plugin.models.split_linear import SplitLinear, slice_sizes, split_linear
from dyn_plugin.plan.sharding.shard_plan import Choice, ShardPlan, UnitPlan
from ranks import run

TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "tokens,inp,out,slices,bias",
    [
        (5, 16, 97, 2, False),
        (7, 32, 256, 4, True),
        (33, 128, 512, 3, True),
        (200, 32, 1000, 2, True),
        (1, 64, 2048, 4, False),
    ],
)
def test_split_linear_matches_the_unsplit_layer(tokens, inp, out, slices, bias):
    torch.manual_seed(0)
    linear = nn.Linear(inp, out, bias=bias)
    split = SplitLinear.from_linear(linear, slices)
    assert [p.out_features for p in split.slices] == slice_sizes(out, slices)
    x = torch.randn(2, tokens, inp, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(2, tokens, out)
    y, y2 = linear(x), split(x2)
    y.backward(grad)
    y2.backward(grad)
    # each output is one slice's own dot product: bit-exact, as are the weight and bias gradients
    assert torch.equal(y, y2)
    assert torch.equal(linear.weight.grad, torch.cat([p.weight.grad for p in split.slices]))
    if bias:
        assert torch.equal(linear.bias.grad, torch.cat([p.bias.grad for p in split.slices]))
    # the input gradient sums the slices' partial products one slice after another: rounding only
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)


def test_slices_fall_on_gemm_blocks_where_the_layer_is_wide_enough():
    assert slice_sizes(97, 2) == [64, 33]
    assert slice_sizes(1000, 3) == [384, 384, 232]
    assert slice_sizes(64, 4) == [16, 16, 16, 16]  # too narrow for 64-wide blocks: equal shares
    with pytest.raises(ValueError, match="cannot cut 3 output features into 4 slices"):
        slice_sizes(3, 4)


def test_split_linear_replaces_a_named_linear_and_refuses_other_modules():
    torch.manual_seed(0)
    model = build_causal_lm(TINY)
    head = copy.deepcopy(model.lm_head)
    split = split_linear(model, "lm_head", 2)
    assert model.lm_head is split and split_linear(model, "lm_head", 2) is split
    torch.testing.assert_close(torch.cat([p.weight for p in split.slices]), head.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="model.layers.0.mlp' is a LlamaMLP, not an nn.Linear"):
        split_linear(model, "model.layers.0.mlp", 2)


def _plan(model, labels: dict[str, str], world: int = 2, shard: int = 2) -> ShardPlan:
    units = tuple(
        UnitPlan(u.name, u.params, Choice.parse(labels.get(u.name, "full")), 0.0, 0.0, 0.0) for u in shard_units(model)
    )
    return ShardPlan("tiny-llama", world, shard, "fp32", "fsdp2", 0.0, 0, 0.0, 0.0, 0.0, units)


def test_a_plan_for_another_model_is_refused_naming_the_modules():
    model = build_causal_lm(TINY)
    plan = _plan(model, {})
    alien = UnitPlan("model.layers.7.mlp", 10, Choice("full"), 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"names modules this model does not have: 'model.layers.7.mlp'"):
        wrap_targets(model, ShardPlan(**{**plan.__dict__, "units": plan.units + (alien,)}), 2)
    with pytest.raises(ValueError, match=r"does not decide for units \['lm_head'\] of this model"):
        wrap_targets(
            model, ShardPlan(**{**plan.__dict__, "units": tuple(u for u in plan.units if u.name != "lm_head")}), 2
        )
    with pytest.raises(ValueError, match="searched for 2 ranks but 4 are running"):
        wrap_targets(model, plan, 4)
    with pytest.raises(ValueError, match="priced in fp32 but the model's parameters are bf16"):
        wrap_targets(model.to(torch.bfloat16), plan, 2)


def test_reshard_must_divide_the_shard_group():
    model = build_causal_lm(TINY)
    with pytest.raises(ValueError, match=r"reshard\(3\) must be a divisor of shard_size 4"):
        wrap_targets(model, _plan(model, {"model.layers.0.mlp": "reshard(3)"}, world=4, shard=4), 4)


def test_wrap_targets_split_the_planned_head_into_full_and_keep_slices():
    model = build_causal_lm(TINY)
    targets = wrap_targets(model, _plan(model, {"lm_head": "split(1/2)", "": "keep"}), 2)
    assert [(t.name, t.choice.kind) for t in targets][-3:] == [
        ("lm_head.slices.0", "full"),
        ("lm_head.slices.1", "keep"),
        ("", "keep"),
    ]
    assert targets[-1].module is model and isinstance(model.lm_head, SplitLinear)


# FSDP2 collectives per unit and step with M micro-batches: (all-gathers, gradient reductions), as
# the plan prices them; recompute re-runs forwards inside backward without gathering again
PER_STEP = {
    "keep": lambda m: (1, 1),
    "grad_op": lambda m: (m, m),
    "full": lambda m: (2 * m, m),
    "reshard": lambda m: (2 * m, m),
    "replicate": lambda m: (0, 1),
}


def _check_exact(cases):
    for c in cases:
        assert c["compared"], c
        assert c["moved"] > 1e-3, c  # the step did change the weights
        assert c["max_abs_diff"] < 1e-6, c
        assert c["fsdp"] == "fsdp1" or len(c["collectives"]) == len(c["micro_batch_sizes"]), c
        for sizes, counts in zip(c["micro_batch_sizes"], c["collectives"]):
            ran = {name: (gathers, reductions) for name, (_, gathers, reductions) in counts.items()}
            planned = {name: PER_STEP[kind](len(sizes)) for name, (kind, _, _) in counts.items()}
            assert ran == planned, (c["recompute"], sizes, counts)


def test_fsdp1_policy_and_fsdp2_plan_train_exactly_on_two_ranks(tmp_path):
    out = tmp_path / "two.json"
    codes, logs = run("fsdp_worker.py", out, "two", world=2, timeout=600)
    assert codes == [0, 0], logs[0][-4000:]
    result = json.loads(out.read_text())
    _check_exact(result["cases"])
    assert {c["fsdp"] for c in result["cases"]} == {"fsdp1", "fsdp2"}
    # uneven micro-batches, several per step: the keep units' flags switch between them
    assert any(len(sizes) > 2 and len(set(sizes)) > 1 for c in result["cases"] for sizes in c["micro_batch_sizes"])
    # a plan searched by initialize for a budget: peak per rank (LiveMemory over wrapping and two
    # AdamW steps) against the plan's states plus the step's activations as the cost model prices
    # them, and never above the budget; at rest: sharded parameters and AdamW states
    memory = result["memory"]
    for measured, predicted in zip(memory["measured_peak"], memory["predicted_peak"]):
        assert abs(measured / predicted - 1) < 0.15, memory
        assert measured <= memory["budget"], memory
    for measured, predicted in zip(memory["measured_at_rest"], memory["predicted_at_rest"]):
        assert abs(measured / predicted - 1) < 0.05, memory


def test_fsdp2_integer_reshard_and_hybrid_meshes_train_exactly_on_four_ranks(tmp_path):
    out = tmp_path / "four.json"
    codes, logs = run("fsdp_worker.py", out, "four", world=4, timeout=600)
    assert codes == [0] * 4, logs[0][-4000:]
    cases = json.loads(out.read_text())["cases"]
    _check_exact(cases)
    assert [(c["fsdp"], c["shard"]) for c in cases] == [("fsdp2", 4), ("fsdp2", 2), ("fsdp1", 2)]
    assert "reshard(2)" in cases[0]["choices"]


def test_the_entry_refuses_what_sharded_training_cannot_run():
    from dyn_plugin.fsdp import initialize

    model = build_causal_lm(TINY)
    with pytest.raises(ValueError, match="fsdp='fsdp3'"):
        initialize(model, {}, [], [], fsdp="fsdp3")
    with pytest.raises(ValueError, match="microbatching.method 'token_budget' on FSDP2.*only 'dynapipe' plans"):
        initialize(model, {"dyn_plugin": {"microbatching": {"method": "token_budget"}}}, [], [])
    with pytest.raises(ValueError, match="data-parallel only"):
        initialize(model, {"dyn_plugin": {"pipeline": {"stages": 2}}}, [], [])
