"""T5 under plain PyTorch FSDP with a sharding plan (issue 27): T5's shard units (a unit per
sublayer, priced per side; the root owns the embedding tied to the head), the sharding search
priced with them on the A100 T5 11B tables, the entry's refusals, and exact token-mean training on
2 gloo ranks (FSDP2 and FSDP1, hand-made and searched plans: tests/fsdp_t5_worker.py)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import import_t5_tables
from dyn_plugin.cost.sharding import unit_compute
from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm
from dyn_plugin.models.shard_units import parameter_units, shard_units
from dyn_plugin.plan.sharding.search import search_sharding, typical_step
from dyn_plugin.plan.sharding.shard_plan import MB, ShardUnit
from dyn_plugin.plan.steps.pair_planner import plan_pairs
from dyn_plugin.plan.steps.pair_spec import pair_planner_spec
from ranks import run
from test_fsdp import PER_STEP

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
# T5 11B's shape (the tables' model), built on the meta device: its units cost no memory
T5_11B = dict(model_type="t5", d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_decoder_layers=24, num_heads=128)
COST = dataclasses.replace(import_t5_tables(MEASURED_DIR / "a100-t5-11b.json"), dtype="fp32")


def test_t5_units_are_its_sublayers_per_side_and_the_root_keeps_the_tied_embedding():
    model = build_seq2seq_lm(T5)
    units = shard_units(model)
    assert [(u.name, u.component, u.layer) for u in units] == [
        ("encoder.block.0.layer.0", "encoder", 0),
        ("encoder.block.0.layer.1", "encoder", 0),
        ("encoder.block.1.layer.0", "encoder", 1),
        ("encoder.block.1.layer.1", "encoder", 1),
        ("decoder.block.0.layer.0", "decoder", 2),
        ("decoder.block.0.layer.1", "decoder", 2),
        ("decoder.block.0.layer.2", "decoder", 2),
        ("decoder.block.1.layer.0", "decoder", 3),
        ("decoder.block.1.layer.1", "decoder", 3),
        ("decoder.block.1.layer.2", "decoder", 3),
        ("", "other", -1),
    ]
    owners = parameter_units(model)
    assert model.lm_head.weight is model.shared.weight  # tied: one weight, read by both sides and the head
    assert owners["shared.weight"] == "" and "lm_head.weight" not in owners
    assert owners["decoder.block.0.layer.1.EncDecAttention.k.weight"] == "decoder.block.0.layer.1"
    assert sum(u.params for u in units) == sum(p.numel() for p in model.parameters())  # each parameter once


def test_unit_compute_prices_each_side_with_its_own_layer():
    units = [
        ShardUnit("e.0", 3, "encoder", 0),
        ShardUnit("e.1", 1, "encoder", 0),
        ShardUnit("d.0", 1, "decoder", 1),
        ShardUnit("d.1", 1, "decoder", 1),
        ShardUnit("", 5, "other"),
    ]
    comp = {
        "embedding": (np.zeros(2), np.zeros(2)),
        "encoder": (np.array([4.0, 8.0]), np.array([8.0, 16.0])),
        "decoder": (np.array([10.0, 20.0]), np.array([20.0, 40.0])),
        "head": (np.array([1.0, 2.0]), np.array([2.0, 4.0])),
    }
    fwd, bwd = unit_compute(units, comp)
    np.testing.assert_allclose(fwd, [[3, 6], [1, 2], [5, 10], [5, 10], [1, 2]])  # shares of each side's layer
    np.testing.assert_allclose(bwd, 2 * fwd)


def _pairs(count: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(a), int(b)) for a, b in zip(rng.integers(8, 1000, count), rng.integers(4, 500, count))]


def test_the_search_prices_t5_units_and_the_pair_planner_plans_in_the_room_left():
    """T5 11B's 121 units on 8 ranks: a tighter budget shards more (fewer model states), every plan
    fits its budget with its typical step, and the pair planner given the plan's states plans
    within what they leave."""
    with torch.device("meta"):
        units = shard_units(build_seq2seq_lm(dict(T5_11B, vocab_size=32128)))
    assert len(units) == 24 * 2 + 24 * 3 + 1
    pairs = _pairs(200, 0)
    plans = {}
    for budget in (60000, 200000):
        cfg = DynPluginConfig.model_validate(
            {
                "cluster": {"device": {"memory_mb": 80000}},
                "sharding": {"memory_budget_mb": budget},
                "microbatching": {"max_seq_len": 1024},
            }
        )
        plan = plans[budget] = search_sharding(units, COST, cfg, world=8, lengths=pairs)
        assert plan.peak_bytes <= budget * MB
        spec = pair_planner_spec(COST, cfg, dp=8, zero_stage=0, state_bytes=plan.planning_state_bytes)
        step = plan_pairs(*(list(s) for s in zip(*pairs)), spec)
        assert step.peak_bytes <= budget * MB - plan.planning_state_bytes
        assert len({len(r.micro_batches) for r in step.replicas}) == 1  # every rank gathers as often
    assert plans[60000].state_bytes < plans[200000].state_bytes
    assert {u.choice.kind for u in plans[60000].units} >= {"full"}
    # the typical step's compute split into 24 encoder layers, 24 decoder layers (each side its own
    # price) and the head, whole: what the units' shares are cut from
    typ = typical_step(pairs, COST, cfg, world=8, state_bytes=plans[200000].state_bytes)
    assert typ.micro_batches == plans[200000].micro_batches
    comp = typ.component_ms
    assert not np.allclose(comp["encoder"][0], comp["decoder"][0])
    whole = sum(24 * comp["encoder"][p] + 24 * comp["decoder"][p] + comp["head"][p] for p in (0, 1))
    assert whole.sum() == pytest.approx(typ.compute_ms, rel=1e-9)


def test_the_search_names_the_longest_pair_when_nothing_fits():
    cfg = DynPluginConfig.model_validate({"sharding": {"memory_budget_mb": 1000}})
    units = shard_units(build_seq2seq_lm(T5))
    with pytest.raises(ValueError, match=r"activations for the longest \(input, target\) pair, \(999, 499\)"):
        search_sharding(units, COST, cfg, world=2, lengths=[(999, 20), (10, 499)])


@pytest.mark.parametrize(
    "plugin, lengths, cost, message",
    [
        ({"microbatching": {"layout": "packed"}}, [[2, 2]], COST, "rows packed with several pairs are not built"),
        ({}, [2], COST, "it trains on \\(input, target\\) pairs; give lengths as an \\[N, 2\\] array"),
        ({}, [[2, 2]], None, "no analytic model prices an encoder-decoder"),
        # the config's tables price the precision the model's parameters train in (fp32 here)
        (
            {"cost_model": {"kind": "profile", "profile": "a100-t5-11b"}},
            [[2, 2]],
            None,
            "measured in fp16, but the run trains in fp32",
        ),
        ({"pipeline": {"stages": 2}}, [[2, 2]], COST, "data-parallel only"),
    ],
    ids=["packed", "sequences", "cost-model", "tables-precision", "pipeline"],
)
def test_the_fsdp_entry_refuses_what_is_not_built_for_t5(plugin, lengths, cost, message):
    from dyn_plugin.fsdp import initialize

    data = [{"input_ids": [3, 4], "labels": [5, 6]}]
    with pytest.raises(ValueError, match=message):
        initialize(build_seq2seq_lm(T5), {"dyn_plugin": plugin}, data, lengths, cost_model=cost)


def test_the_fsdp_entry_refuses_encoder_decoders_other_than_t5():
    from dyn_plugin.fsdp import initialize

    bart = dict(
        model_type="bart",
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=97,
        max_position_embeddings=64,
    )
    data = [{"input_ids": [3, 4], "labels": [5, 6]}]
    with pytest.raises(ValueError, match="model_type 'bart' \\(BartForConditionalGeneration\\) is not built"):
        initialize(build_seq2seq_lm(bart), {}, data, [[2, 2]], cost_model=COST)


def test_fsdp_trains_t5_on_pairs_exactly_under_sharding_plans(tmp_path):
    out = tmp_path / "t5.json"
    codes, logs = run("fsdp_t5_worker.py", out, tmp_path / "checkpoints", world=2, timeout=300)
    assert codes == [0, 0], logs[0][-4000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert [(c["fsdp"], c["variant"], c["how"]) for c in cases] == [
        ("fsdp2", "t5", "mixed"),
        ("fsdp2", "t5-v1.1", "mixed"),
        ("fsdp1", "t5", "mixed"),
        ("fsdp2", "t5", "search"),
    ]
    for c in cases:
        assert c["units"] == report["units"] and c["tied"], c
        assert len(c["max_abs_diff"]) >= 2 and max(c["max_abs_diff"]) < 1e-6, c  # after every step
        assert c["moved"] > 1e-3, c
        assert sorted(i for ids in c["trained"] for i in ids) == list(range(report["samples"]))  # each pair once
        # several uneven micro-batches per rank, recompute chosen per micro-batch
        assert any(len(s) > 2 and len(set(s)) > 1 for s in c["micro_batch_sizes"]), c
        assert len({m for ms in c["recompute"] for m in ms}) > 1, c
        assert c["planned_states"] == c["planning_state_bytes"]  # the pair planner was told the plan's states
        for sizes, counts in zip(c["micro_batch_sizes"], c["collectives"]):  # FSDP2: as the plan prices them
            ran = {name: (gathers, reductions) for name, (_, gathers, reductions) in counts.items()}
            assert ran == {name: PER_STEP[kind](len(sizes)) for name, (kind, _, _) in counts.items()}, counts
    mixed = cases[0]
    assert {"full", "keep", "grad_op", "replicate"} <= set(mixed["choices"])
    assert len(mixed["collectives"]) == len(mixed["micro_batch_sizes"])
    # saved after the first step, resumed by a fresh model and loader: the rest of the epoch, bit for bit
    assert mixed["resumed"]["trained"] == mixed["trained"][1:]
    assert mixed["resumed"]["diff"] == 0.0
