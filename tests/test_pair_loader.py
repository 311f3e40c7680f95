"""DynLoader over (input, target) pairs: the encoder-decoder planner's plans, each pair once per
epoch over every rank, the tensors the plan describes, resume at the next global batch."""

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.bundled import DIR
from dyn_plugin.cost.encoder_decoder import import_t5_tables
from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.collate import IGNORE, scored_tokens
from dyn_plugin.runtime.loader import DynLoader

SECTION = {
    "microbatching": {"global_tokens": 4096, "max_seq_len": 512},
    # T5 11B's measured tables on a device large enough for its states on two stages
    "cluster": {"device": {"memory_mb": 400000}},
}


@pytest.fixture(scope="module")
def cost():
    return import_t5_tables(DIR / "measured" / "a100-t5-11b.json")


def make(pp=2, n=60, seed=0, **over):
    cfg = DynPluginConfig.model_validate({**SECTION, "pipeline": {"stages": pp}, **over})
    rng = np.random.default_rng(seed)
    pairs = np.stack([rng.integers(16, 400, size=n), rng.integers(8, 200, size=n)], axis=1)
    data = [{"input_ids": rng.integers(2, 100, size=a), "labels": rng.integers(2, 100, size=b)} for a, b in pairs]
    return cfg, pairs, data


def loaders(cfg, cost, pairs, data, dp, pp, seed=7, **kw):
    layout = RankLayout.of(dp, pp)
    return {
        (c, s): DynLoader(
            data, lengths=pairs, config=cfg, cost_model=cost, layout=layout, stage=s, column=c, seed=seed, **kw
        )
        for c in range(dp)
        for s in range(pp)
    }


@pytest.mark.parametrize("dp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_every_pair_exactly_once_per_epoch_with_the_plans_tensors(cost, dp, pp):
    cfg, pairs, data = make(pp)
    steps = {k: list(loader) for k, loader in loaders(cfg, cost, pairs, data, dp, pp).items()}
    seen = [i for c in range(dp) for step in steps[(c, 0)] for ids in step.sample_ids for i in ids]
    assert sorted(seen) == list(range(len(pairs)))
    first = steps[(0, 0)]
    for (c, _), st in steps.items():
        assert [x.digest for x in st] == [x.digest for x in first]  # every rank, the same plans
        # the decoder stage loads (labels) the same micro-batches as the encoder stage
        assert [x.sample_ids for x in st] == [x.sample_ids for x in steps[(c, 0)]]
        for step in st:
            for desc, ids, mb in zip(step.loaded, step.sample_ids, step.micro_batches):
                assert list(desc.sample_ids) == ids
                assert [tuple(p) for p in desc.seq_lens] == [tuple(pairs[i]) for i in ids]
                rows, se, sd = desc.shape
                assert mb["input_ids"].shape == mb["attention_mask"].shape == (rows, se)
                assert mb["labels"].shape == (rows, sd)
                assert mb["attention_mask"].sum(1).tolist() == [int(pairs[i][0]) for i in ids]
                assert mb["labels"].ne(IGNORE).sum(1).tolist() == [int(pairs[i][1]) for i in ids]
    for step_index, step in enumerate(first):  # the denominator: every target token of the global batch
        ids = [i for c in range(dp) for mb in steps[(c, 0)][step_index].sample_ids for i in mb]
        assert step.scored_tokens == scored_tokens([tuple(pairs[i]) for i in ids]) == int(pairs[ids, 1].sum())


@pytest.mark.parametrize("method", ["fixed_padding", "token_budget"])
def test_the_padded_pair_baselines_train_through_the_same_loader(cost, method):
    cfg, pairs, data = make(1, microbatching={**SECTION["microbatching"], "method": method})
    steps = {k: list(loader) for k, loader in loaders(cfg, cost, pairs, data, 2, 1).items()}
    seen = [i for c in range(2) for step in steps[(c, 0)] for ids in step.sample_ids for i in ids]
    assert sorted(seen) == list(range(len(pairs)))
    shapes = {
        tuple(mb["input_ids"].shape[1:]) + tuple(mb["labels"].shape[1:])
        for st in steps.values()
        for s in st
        for mb in s.micro_batches
    }
    if method == "fixed_padding":  # every side padded to max_seq_len, as fixed padding pads sequences
        assert shapes == {(512, 512)}
    else:
        assert len(shapes) > 1


def test_zero_3_plans_equal_counts_and_recompute_at_each_index(cost):
    """ZeRO-3 gathers parameters in the order modules run on every rank: the replicas run as many
    micro-batches, recomputing alike at each index."""
    cfg, pairs, data = make(1, n=120, microbatching={**SECTION["microbatching"], "global_tokens": 16384})
    steps = {k: list(loader) for k, loader in loaders(cfg, cost, pairs, data, 2, 1, zero_stage=3).items()}
    for a, b in zip(steps[(0, 0)], steps[(1, 0)]):
        assert [d.recompute for d in a.loaded] == [d.recompute for d in b.loaded]
    assert any(len(s.micro_batches) > 1 for s in steps[(0, 0)])


def test_resume_gives_exactly_the_rest_with_the_same_plans(cost):
    cfg, pairs, data = make()
    full = list(loaders(cfg, cost, pairs, data, 1, 2)[(0, 0)])
    assert len(full) > 3
    first = loaders(cfg, cost, pairs, data, 1, 2)[(0, 0)]
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = loaders(cfg, cost, pairs, data, 1, 2)[(0, 0)]
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert [s.digest for s in rest] == [s.digest for s in full[3:]]
    assert [s.sample_ids for s in rest] == [s.sample_ids for s in full[3:]]
    other = loaders(cfg, cost, pairs[:, ::-1].copy(), data, 1, 2)[(0, 0)]  # the sides swapped: other data
    with pytest.raises(ValueError, match="different lengths"):
        other.load_state_dict(first.state_dict())


@pytest.mark.parametrize(
    "over, message",
    [
        (
            {"microbatching": {**SECTION["microbatching"], "method": "packing_varlen"}},
            "microbatching.method 'packing_varlen'",
        ),
    ],
    ids=["baseline"],
)
def test_what_pairs_cannot_be_planned_with_is_refused(cost, over, message):
    cfg, pairs, data = make(**over)
    with pytest.raises(ValueError, match=message):
        DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, layout=RankLayout.of(1, 2))


def test_pairs_and_cost_models_must_agree(cost):
    from dyn_plugin.cost.from_config import build_cost_model

    cfg, pairs, data = make()
    with pytest.raises(ValueError, match="one token count per sample"):
        DynLoader(data, lengths=pairs[:, 0].copy(), config=cfg, cost_model=cost, layout=RankLayout.of(1, 2))
    decoder_only = DynPluginConfig.model_validate(
        {
            **SECTION,
            "pipeline": {"stages": 2},
            "cost_model": {
                "kind": "analytic",
                "model": {
                    "hidden_size": 64,
                    "num_layers": 4,
                    "num_heads": 4,
                    "ffn_hidden_size": 128,
                    "vocab_size": 100,
                },
            },
        }
    )
    with pytest.raises(ValueError, match="encoder-decoder cost model"):
        DynLoader(
            data,
            lengths=pairs,
            config=decoder_only,
            cost_model=build_cost_model(decoder_only.cost_model, decoder_only.cluster),
            layout=RankLayout.of(1, 2),
        )


def test_planner_processes_plan_pairs_as_each_rank_would(cost, caplog):
    """DynaPipe's planning ahead for an encoder-decoder: planner processes rebuild the T5 cost model
    from its JSON form (the fits, equal to the original) and publish, through the store, the plans
    a rank planning alone makes (pairs were refused with a store before)."""
    import json

    from dyn_plugin.cost.encoder_decoder import EncoderDecoderCostModel

    assert EncoderDecoderCostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    store = {"backend": "tcp", "port": 0, "namespace": "pair-planners"}
    cfg, pairs, data = make(pp=1, store=store, loader={"planners": 1, "prefetch": 2, "plan_timeout_s": 60})
    ahead = DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, seed=7)
    try:
        with caplog.at_level("WARNING"):
            steps = iter(ahead)
            first = next(steps)
            assert ahead._pool is not None and ahead._pool.procs  # started at the first plan
            planned = [(s.digest, s.sample_ids) for s in (first, *steps)]
    finally:
        ahead.close()
    assert "planner" not in caplog.text  # none failed (a rank would then plan the rest itself)
    cfg, pairs, data = make(pp=1)
    alone = [(s.digest, s.sample_ids) for s in DynLoader(data, lengths=pairs, config=cfg, cost_model=cost, seed=7)]
    assert planned == alone and len(alone) > 1
