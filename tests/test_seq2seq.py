"""Encoder-decoder (T5) micro-batches of (input, target) pairs: the per-side collate, its shape,
the token mean over target tokens, and a tiny T5's exact token-mean step in one process; the
two-rank DeepSpeed runs (ZeRO 0-3) are launched from tests/ds_t5_worker.py."""

import copy
import json
import re

import numpy as np
import pytest
import torch

from dyn_plugin.cost.encoder_decoder import pair_shape
from dyn_plugin.host.recompute import recompute_switch
from dyn_plugin.host.token_mean import HostHooks, token_mean_step
from dyn_plugin.models.hf import PRESETS, build_causal_lm, build_seq2seq_lm
from dyn_plugin.plan.steps.instructions import ExecutionPlan, LoadMicroBatch, PlannedMicroBatch
from dyn_plugin.runtime.collate import IGNORE, scored_tokens
from dyn_plugin.runtime.collate_pairs import collate_pairs
from dyn_plugin.runtime.loader import Step, load_micro_batch
from ranks import run
from token_mean import reference

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
EXACT = 1e-6  # fp32, against the unmodified model on the whole global batch (measured: 1.2e-7 to 2.4e-7)


def _pairs(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(2, 97, size=a), "labels": rng.integers(2, 97, size=b)} for a, b in lens]


def test_scored_tokens_counts_every_target_token_of_pairs_and_all_but_the_first_of_sequences():
    assert scored_tokens([(3, 4), (5, 1)]) == 5
    assert scored_tokens(np.array([[3, 4], [5, 1]])) == 5  # a pair length file's rows
    assert scored_tokens([3, 1, 0]) == 2
    assert scored_tokens(np.array([3, 1])) == 2
    with pytest.raises(ValueError, match="an \\(input, target\\) pair"):
        scored_tokens([(3, 4, 5)])


def shape(lens):
    """The plan's shape of a micro-batch of pairs (the cost model's one definition)."""
    return pair_shape(*zip(*lens))


def test_collate_pairs_pads_inputs_under_the_mask_and_targets_with_ignored_labels():
    lens = [(5, 2), (1, 7), (3, 3)]
    data = _pairs(lens)
    mb = collate_pairs([0, 1, 2], lens, "padded", shape(lens), data.__getitem__, pad_id=0)
    assert mb["input_ids"].shape == mb["attention_mask"].shape == (3, 8)
    assert mb["labels"].shape == (3, 8)
    for r, ((a, b), d) in enumerate(zip(lens, data)):
        assert mb["input_ids"][r, :a].tolist() == d["input_ids"].tolist()
        assert mb["input_ids"][r, a:].eq(0).all() and mb["attention_mask"][r].tolist() == [1] * a + [0] * (8 - a)
        assert mb["labels"][r, :b].tolist() == d["labels"].tolist() and mb["labels"][r, b:].eq(IGNORE).all()
    assert int(mb["labels"].ne(IGNORE).sum()) == scored_tokens(lens)  # the labels scored are the plan's count
    # an (input, target) tuple is an item too, and longer sides are cut to the planned lengths
    tuples = [(d["input_ids"], np.concatenate([d["labels"], [5, 5]])) for d in data]
    again = collate_pairs([0, 1, 2], lens, "padded", shape(lens), tuples.__getitem__)
    assert all(torch.equal(again[k], mb[k]) for k in mb)


def test_collate_pairs_refuses_what_does_not_fit_its_plan():
    lens = [(5, 2), (1, 7)]
    data = _pairs(lens)
    with pytest.raises(ValueError, match="encoder_decoder.pair_shape"):
        collate_pairs([0, 1], lens, "padded", (2, 4, 8), data.__getitem__)  # inputs wider than the plan's width
    with pytest.raises(ValueError, match="encoder_decoder.pair_shape"):
        collate_pairs([0, 1], lens, "padded", (2, 8), data.__getitem__)  # a causal (rows, width) shape
    with pytest.raises(ValueError, match="token counts of the dataset"):
        collate_pairs([0, 1], [(6, 2), (1, 7)], "padded", (2, 8, 8), data.__getitem__)
    with pytest.raises(ValueError, match="\\(input, target\\) pairs"):
        collate_pairs([0], [(1, 2, 3)], "padded", (1, 8, 8), data.__getitem__)
    with pytest.raises(ValueError, match="'labels'"):
        collate_pairs([0], [(1, 1)], "padded", (1, 8, 8), [{"input_ids": [3]}].__getitem__)
    split = PlannedMicroBatch((0, 1), tuple(lens), "padded", "none", (2, 8, 8), (), 2, 0)
    with pytest.raises(ValueError, match="plan them with sp 1"):
        load_micro_batch(split, data.__getitem__, column=0)


def test_encoder_decoders_are_refused_by_the_causal_builder():
    with pytest.raises(ValueError, match="build_seq2seq_lm"):
        build_causal_lm(T5)


def test_token_mean_step_of_pairs_is_the_whole_batch_token_mean():
    """Uneven micro-batches, recompute switched per micro-batch: one SGD step equals the
    unmodified T5 on each pair alone, weighted by target tokens."""
    lens = [(5, 2), (12, 7), (3, 3), (1, 9), (8, 1)]
    data = _pairs(lens, seed=1)
    torch.manual_seed(0)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    cuts = [(0, 1, 2), (3,), (4,)]
    descs = tuple(
        PlannedMicroBatch(ids, tuple(lens[i] for i in ids), "padded", mode, shape([lens[i] for i in ids]), (), 1, 0)
        for ids, mode in zip(cuts, ("full", "none", "selective"))
    )
    plan = ExecutionPlan(0, 0, 0, 1, 1, tuple(LoadMicroBatch(0, mb=k) for k in range(3)), descs)
    loaded = [load_micro_batch(d, data.__getitem__, column=0) for d in descs]
    step = Step(0, 0, plan, loaded, [list(c) for c in cuts], scored_tokens(lens), "", 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    host = HostHooks(
        forward=model,
        device=torch.device("cpu"),
        recompute=recompute_switch(model),
        boundary=lambda last: None,
        backward=lambda loss: loss.backward(),
        optimizer_step=optimizer.step,
    )
    loss = token_mean_step(step, host, dp=1)
    samples = [(d["input_ids"], d["labels"]) for d in data]
    with torch.no_grad():
        want = sum(
            float(ref(input_ids=torch.as_tensor(s)[None], labels=torch.as_tensor(t)[None]).loss) * len(t)
            for s, t in samples
        )
    assert loss == pytest.approx(want / scored_tokens(lens), rel=1e-6)
    reference(ref, samples, 0.5)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    assert diff <= EXACT
    assert len(recompute_switch(model).layers) == 4  # T5's blocks, two a side, under the switch


def test_deepspeed_trains_t5_on_pairs_exactly_for_every_zero_stage(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_t5_worker.py", out, tmp_path / "checkpoints")
    assert codes == [0, 0], logs[0][-3000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert {(c["stage"], c["variant"]) for c in cases} == {(s, "t5") for s in range(4)} | {
        (1, "t5-v1.1"),
        (3, "t5-v1.1"),
    }
    for c in cases:
        assert max(c["max_abs_diff"]) <= EXACT, c  # after each of the two steps
        for loss, want in c["losses"]:
            assert loss == pytest.approx(want, rel=1e-6), c
        assert sorted(c["trained"]) == list(range(report["samples"])), c  # the epoch, each pair once
        sizes = c["micro_batch_sizes"]
        assert sizes[0] != sizes[1] and all(len(set(s)) > 1 for s in sizes), c  # uneven, per step
        assert c["recompute_ran"] == c["recompute_last"] and c["blocks"] == 4, c
    # deepspeed_ext.initialize with pair lengths: the loader plans an epoch with the pair planner
    planned = report["planned"]
    assert [c["stage"] for c in planned] == [0, 1, 2, 3]
    for c in planned:
        assert max(c["max_abs_diff"]) <= EXACT, c
        assert sorted(i for ids in c["trained"] for i in ids) == list(range(report["planned_samples"])), c
        assert all(len(sizes) > 1 for sizes in c["micro_batch_sizes"]), c  # several micro-batches a step
    # resumed from the checkpoint after the first step: the rest of the epoch, bit for bit
    (resumed,) = [c for c in planned if c["resumed"]]
    assert resumed["resumed"]["diff"] == 0.0 and resumed["resumed"]["trained"] == resumed["trained"][1:], resumed


@pytest.mark.parametrize(
    "plugin, lengths, message",
    [
        ({"sequence_parallel": {"enabled": True}}, [[2, 2]], "sequence parallelism over pairs is not built"),
        ({"microbatching": {"layout": "packed"}}, [[2, 2]], "rows packed with several pairs are not built"),
        ({}, [2], "it trains on (input, target) pairs; give lengths as an [N, 2] array"),
        ("decoder-only", [[2, 2]], "pass cost_model=, an encoder-decoder cost model"),
        ({}, [[2, 2]], "cost_model.kind 'analytic': no analytic model prices an encoder-decoder"),
    ],
    ids=["sequence parallel", "packed", "sequence lengths", "decoder-only cost model", "analytic config"],
)
def test_deepspeed_initialize_refuses_what_is_not_built_for_encoder_decoders(plugin, lengths, message):
    import deepspeed_ext
    from dyn_plugin.cost.bundled import load_bundled
    from dyn_plugin.cost.profile import cost_model_from_profile

    cost = None
    if plugin == "decoder-only":
        plugin, cost = {}, cost_model_from_profile(load_bundled("a100-gpt-6.7b"))
    with pytest.raises(ValueError, match=re.escape(message)):
        deepspeed_ext.initialize(
            model=build_seq2seq_lm(T5),
            config={"dyn_plugin": plugin},
            dataset=_pairs([(2, 2)]),
            lengths=lengths,
            cost_model=cost,
        )


def test_global_batches_of_pairs_count_both_sides_against_the_budget():
    from dyn_plugin.runtime.sampler import epoch_batches, global_batches

    pairs = np.random.default_rng(0).integers(1, 50, size=(200, 2))
    batches = epoch_batches(pairs, 300, seed=1, epoch=0, min_sequences=2)
    assert sorted(i for b in batches for i in b) == list(range(200))  # the epoch, each pair once
    assert batches == epoch_batches(pairs.sum(axis=1), 300, seed=1, epoch=0, min_sequences=2)
    assert all(pairs[b].sum() <= 300 for b in batches[:-1])  # the last may take a short tail
    assert global_batches(pairs, 300, 3, seed=1) == batches[:3]
    with pytest.raises(ValueError, match="\\[N, 2\\] array of \\(input, target\\) pairs"):
        epoch_batches(np.ones((4, 3), dtype=int), 300, seed=1, epoch=0)
