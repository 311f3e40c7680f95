"""A sharding plan as ZeRO-3 settings (deepspeed_ext/zero3.py), without ranks: the persistence thresholds
chosen, hpZ, what is reported lost, the memory the settings imply, and the errors of a plan that cannot
run (a user key it contradicts, ZeRO stage != 3, another model's plan)."""

import pytest

import deepspeed_ext
from deepspeed_ext.zero3 import UNLIMITED, merge_zero_config, persistent_parameters, zero3_memory_bytes, zero3_settings
from ds_exact_worker import MODEL
from ds_zero3_plan_worker import CASES, KEPT, hand_plan
from dyn_plugin.config import load_config
from dyn_plugin.models.hf import build_causal_lm
from dyn_plugin.models.shard_units import parameter_units, shard_units
from dyn_plugin.runtime.sharding import resolve_shard_plan

ALL_KEEP = {
    "model.embed_tokens": "keep",
    "model.layers.0.self_attn": "keep",
    "model.layers.0.mlp": "keep",
    "model.layers.1.self_attn": "keep",
    "model.layers.1.mlp": "keep",
    "lm_head": "keep",
    "": "keep",
}


@pytest.fixture(scope="module")
def model():
    return build_causal_lm(MODEL)


def wanted(model, plan) -> list[str]:
    choices = plan.choices()
    return [n for n, u in parameter_units(model).items() if choices[u].kind in KEPT]


@pytest.mark.parametrize("case", sorted(CASES))
def test_thresholds_make_exactly_the_kept_units_persistent(model, case):
    plan = hand_plan(model, CASES[case], world=2)
    mapping = zero3_settings(model, plan)
    assert persistent_parameters(model, mapping.config) == wanted(model, plan)
    # attention weights (<= 1024 elements) by size alone; layer 0 only by cutting the persistent prefix
    # after its MLP, because layer 1's MLP weights are the same size
    expected = {"attention": (1024, UNLIMITED), "layer0": (2048, 3072 + 6144)}[case]
    assert (
        mapping.config["stage3_param_persistence_threshold"],
        mapping.config["stage3_model_persistence_threshold"],
    ) == expected
    # full units are released after every use, and one unit (the largest MLP, 6144) is fetched ahead
    assert mapping.config["stage3_max_reuse_distance"] == 0
    assert mapping.config["stage3_prefetch_bucket_size"] == 6144
    assert mapping.config["stage3_max_live_parameters"] == 2 * 6144
    assert mapping.config["reduce_bucket_size"] == 6144
    assert mapping.hpz == 1


def test_lost_names_what_zero3_cannot_express(model):
    plan = hand_plan(
        model,
        {"model.layers.0.mlp": "keep", "model.layers.1.self_attn": "grad_op", "": "replicate", "lm_head": "split(1/4)"},
        world=2,
        host="fsdp2",
    )
    mapping = zero3_settings(model, plan)
    lost = "\n".join(mapping.lost)
    assert "model.layers.0.mlp -- keep: gradients reduce-scattered every micro-batch" in lost
    # the cut after layer 1's attention leaves the final norm (the root's) partitioned
    assert "(root) -- replicate: partitioned (gathered per use) where parameters exceed" in lost
    assert "grad_op" not in lost  # persistent is a grad_op unit at the same memory, gathered once per step
    assert "lm_head -- split: ZeRO-3 cannot cut a parameter; the whole unit is partitioned" in lost
    # keeping layer 0's MLP (threshold 2048) also keeps layer 0's attention, which the plan shards fully
    assert "model.layers.0.self_attn -- full: held whole on every rank" in lost
    assert "priced for 'fsdp2'" in lost
    assert mapping.lost[-1].startswith("model states per rank: ")
    # a replicated unit kept whole still has its gradients and optimizer states partitioned
    whole_root = zero3_settings(model, hand_plan(model, CASES["attention"], world=2))
    assert any(
        "(root) -- replicate: ZeRO-3 partitions gradients and optimizer states" in line for line in whole_root.lost
    )
    # a hybrid plan: ZeRO-3 shards over the whole world
    hybrid = zero3_settings(model, hand_plan(model, {}, world=4, shard_size=2))
    assert any(line.startswith("hybrid sharding over 2 of 4 ranks") for line in hybrid.lost)


def test_hpz_follows_a_uniform_reshard(model):
    reshard = {u.name: "reshard(2)" for u in shard_units(model)} | CASES["attention"]
    mapping = zero3_settings(model, hand_plan(model, reshard, world=4))
    assert mapping.hpz == 2 and not any("reshard" in line for line in mapping.lost)
    # hpZ is one setting for all: it would hold the (larger) fully sharded units at 1/2 too
    mixed = zero3_settings(model, hand_plan(model, {"model.layers.0.mlp": "reshard(2)"}, world=4))
    assert mixed.hpz == 1
    assert any("model.layers.0.mlp -- reshard: backward gathers over all 4 ranks" in line for line in mixed.lost)
    # reshard sizes that differ, or that are not a proper divisor of the world, leave hpZ off
    two_sizes = {"model.layers.0.mlp": "reshard(2)", "model.layers.1.mlp": "reshard(4)"}
    assert zero3_settings(model, hand_plan(model, two_sizes, world=8)).hpz == 1
    whole = zero3_settings(model, hand_plan(model, {u.name: "reshard(4)" for u in shard_units(model)}, world=4))
    assert whole.hpz == 1 and any("not a proper divisor of the world" in line for line in whole.lost)


def test_memory_is_what_the_settings_hold(model):
    # every unit kept at world 2, fp32 (p, g, o = 4, 4, 8): 24800 parameters, all persistent
    mapping = zero3_settings(model, hand_plan(model, ALL_KEEP, world=2))
    assert len(persistent_parameters(model, mapping.config)) == len(list(model.parameters()))
    states = 24800 * 16 / 2  # weights, gradients and Adam states partitioned
    whole = 24800 * 4  # every weight whole
    bucket = 6144 * 4  # the largest unit's gradients, reduce-scattered together
    assert mapping.memory_bytes == zero3_memory_bytes(model, mapping, 2, "fp32") == states + whole + bucket
    # hpZ holds a 1/2 copy of every partitioned weight; the largest unit in use and prefetched
    reshard = zero3_settings(model, hand_plan(model, {u.name: "reshard(2)" for u in shard_units(model)}, world=4))
    assert reshard.memory_bytes == 24800 * 16 / 4 + 24800 * 4 / 2 + 2 * 4 * 6144 + bucket


def test_budget_bounds_persistence(model):
    everything = zero3_settings(model, hand_plan(model, ALL_KEEP, world=2)).memory_bytes
    budget = 300_000  # below keeping every unit (322176 B), above partitioning all (272128 B)
    mapping = zero3_settings(model, hand_plan(model, ALL_KEEP, world=2, memory_budget_bytes=budget))
    assert mapping.memory_bytes <= budget < everything
    kept = persistent_parameters(model, mapping.config)
    assert 0 < len(kept) < len(list(model.parameters()))
    assert any("keep: partitioned (gathered per use)" in line for line in mapping.lost)


def test_merging_refuses_a_user_key_the_plan_contradicts(model):
    mapping = zero3_settings(model, hand_plan(model, CASES["attention"], world=2))
    merged = merge_zero_config(
        {"zero_optimization": {"stage": 3, "overlap_comm": False}, "train_batch_size": 2}, mapping
    )
    assert merged["zero_optimization"] == {"stage": 3, "overlap_comm": False, **mapping.config}
    assert merged["train_batch_size"] == 2
    same = merge_zero_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1024}}, mapping)
    assert same["zero_optimization"]["stage3_param_persistence_threshold"] == 1024
    for key in ("stage3_param_persistence_threshold", "param_persistence_threshold"):  # DeepSpeed takes both spellings
        with pytest.raises(
            ValueError,
            match=f"zero_optimization.{key} = 5 conflicts with the sharding plan, which "
            "needs 1024; remove zero_optimization.{key}".replace("{key}", key),
        ):
            merge_zero_config({"zero_optimization": {"stage": 3, key: 5}}, mapping)


def test_sharding_needs_zero3_and_a_plan_for_this_model(model):
    cfg = {"zero_optimization": {"stage": 2}, "dyn_plugin": {"sharding": {"enabled": True}}}
    with pytest.raises(
        ValueError,
        match="only under ZeRO-3; set zero_optimization.stage to 3, or train with the FSDP entry dyn_plugin.fsdp",
    ):
        deepspeed_ext.initialize(model=None, config=cfg, dataset=[], lengths=[])
    cfg = {"zero_optimization": {"stage": 3}, "dyn_plugin": {"sharding": {"enabled": True, "host": "fsdp2"}}}
    with pytest.raises(
        ValueError, match="sharding.host 'fsdp2' on DeepSpeed: plans under DeepSpeed run as ZeRO-3 settings"
    ):
        deepspeed_ext.initialize(model=None, config=cfg, dataset=[], lengths=[])
    plan = hand_plan(model, {}, world=2)
    with pytest.raises(ValueError, match="sharding.enabled is false; set it to true"):
        deepspeed_ext.initialize(
            model=None, config={"zero_optimization": {"stage": 3}}, dataset=[], lengths=[], shard_plan=plan
        )
    enabled = load_config({"zero_optimization": {"stage": 3}, "dyn_plugin": {"sharding": {"enabled": True}}})
    cost, lengths = deepspeed_ext.engine.cost_model_for(enabled, model), [50, 120, 30, 200] * 10
    with pytest.raises(ValueError, match="searched for 2 ranks but 4 are running"):
        resolve_shard_plan(shard_units(model), enabled.plugin, cost, lengths, world=4, host="zero3", plan=plan)
    # without a plan it is searched; a budget below the smallest plan says the minimum
    tiny = load_config(
        {"zero_optimization": {"stage": 3}, "dyn_plugin": {"sharding": {"enabled": True, "memory_budget_mb": 0.05}}}
    )
    with pytest.raises(ValueError, match=r"below the smallest possible sharding plan: .* to at least \d+ MB"):
        resolve_shard_plan(shard_units(model), tiny.plugin, cost, lengths, world=2, host="zero3")
    other = build_causal_lm({**MODEL, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="names modules this model does not have: 'model.layers.2.self_attn'"):
        zero3_settings(model, hand_plan(other, {}, world=2))
    with pytest.raises(
        ValueError, match=r"does not decide for units \['model.layers.2.self_attn', 'model.layers.2.mlp'\]"
    ):
        zero3_settings(other, hand_plan(model, {}, world=2))
