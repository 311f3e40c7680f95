"""Packed (input, target) pairs (T5 packing per side): the packed shape the planner prices and the
runtime builds, the collate (segments, each side concatenated), and the packed forward against the
unmodified transformers T5 on each pair alone, T5 and T5 v1.1 (gated feed-forward, no output
rescaling; transformers 5 keeps its head tied); the two-rank
DeepSpeed runs (the pair_packing baseline through the loader) are launched from
tests/ds_t5_packed_worker.py."""

import copy
import json
import types

import numpy as np
import pytest
import torch

from dyn_plugin.cost.bundled import DIR
from dyn_plugin.cost.encoder_decoder import import_t5_tables, packed_pair_rows, packed_pair_shape, pair_shape
from dyn_plugin.host.recompute import recompute_switch
from dyn_plugin.host.token_mean import HostHooks, token_mean_step
from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm
from dyn_plugin.models.seq2seq import check_packable, pair_forward, shift_targets
from dyn_plugin.plan.methods.pair_baselines import pair_packing
from dyn_plugin.plan.steps.instructions import ExecutionPlan, LoadMicroBatch, PlannedMicroBatch
from dyn_plugin.plan.steps.pair_spec import pair_planner_spec
from dyn_plugin.runtime.collate import IGNORE, scored_tokens
from dyn_plugin.runtime.collate_pairs import PACKED_PAIR_KEYS, collate_pairs
from dyn_plugin.runtime.loader import Step, load_micro_batch
from ranks import run
from token_mean import reference

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
VARIANTS = {"t5": T5, "t5-v1.1": dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)}
LENS = [(5, 2), (12, 7), (3, 3), (1, 9), (8, 1), (20, 4), (2, 15)]  # three rows of (24, 24)
EXACT = 1e-6  # fp32, relative (measured: loss 2e-8 to 8e-8, gradients 1.5e-7 to 5e-7 of the largest)


def _pairs(lens, seed=1):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(2, 97, size=a), "labels": rng.integers(2, 97, size=b)} for a, b in lens]


def test_packed_rows_are_next_fit_of_the_plans_order_within_the_widths():
    assert packed_pair_rows([3, 4, 2, 5], [2, 2, 6, 1], (8, 8)) == [[0, 1], [2, 3]]  # 2 + 6 targets overflow
    assert packed_pair_rows([8, 1], [1, 8], (8, 8)) == [[0], [1]]  # the input side is full
    assert packed_pair_shape([3, 4, 2, 5], [2, 2, 6, 1], (16, 16)) == (1, 16, 16)
    with pytest.raises(ValueError, match="wider than the rows"):
        packed_pair_rows([9], [1], (8, 8))
    with pytest.raises(ValueError, match="as many inputs as targets"):
        packed_pair_rows([1, 2], [1], (8, 8))


def test_pair_packing_prices_the_rows_the_runtime_builds():
    """The baseline's micro-batches list their pairs row by row: first fit's rows, read back by the
    packed shape, are the rows it priced, within both widths."""
    cost = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    from dyn_plugin.config import DynPluginConfig

    config = DynPluginConfig.model_validate({"cluster": {"device": {"memory_mb": 400000}}})
    spec = pair_planner_spec(cost, config, dp=2, zero_stage=1)
    rng = np.random.default_rng(0)
    inputs, targets = rng.integers(8, 400, 80).tolist(), rng.integers(4, 200, 80).tolist()
    plan = pair_packing(inputs, targets, spec, 512, 512)
    seen = []
    for rep in plan.replicas:
        for mb in rep.micro_batches:
            assert mb.layout == "packed" and mb.shape[1] == mb.target_shape[1] == 512
            ins, tgs = [inputs[i] for i in mb.sample_ids], [targets[i] for i in mb.sample_ids]
            assert packed_pair_shape(ins, tgs, (512, 512))[0] == mb.shape[0] == mb.target_shape[0]
            assert mb.shape[0] < len(mb.sample_ids)  # several pairs a row
            seen += mb.sample_ids
    assert sorted(seen) == list(range(80))


def test_collate_packs_each_side_with_its_pairs_segments():
    data = _pairs(LENS)
    shape = packed_pair_shape(*zip(*LENS), (24, 24))
    assert shape == (3, 24, 24)
    mb = collate_pairs(range(len(LENS)), LENS, "packed", shape, data.__getitem__, pad_id=0)
    assert tuple(mb) == PACKED_PAIR_KEYS and "input_ids" not in mb  # a model handed it fails, not trains wrong
    rows = packed_pair_rows(*zip(*LENS), (24, 24))
    for r, row in enumerate(rows):
        source = np.concatenate([data[k]["input_ids"] for k in row])
        target = np.concatenate([data[k]["labels"] for k in row])
        assert mb["packed_input_ids"][r, : len(source)].tolist() == source.tolist()
        assert mb["packed_input_ids"][r, len(source) :].eq(0).all()
        assert mb["labels"][r, : len(target)].tolist() == target.tolist()
        assert mb["labels"][r, len(target) :].eq(IGNORE).all()
        assert mb["input_segments"][r].tolist() == [s for s, k in enumerate(row) for _ in range(LENS[k][0])] + [-1] * (
            24 - len(source)
        )
        assert mb["target_segments"][r].tolist() == [s for s, k in enumerate(row) for _ in range(LENS[k][1])] + [-1] * (
            24 - len(target)
        )
    assert int(mb["labels"].ne(IGNORE).sum()) == scored_tokens(LENS)
    desc = PlannedMicroBatch(tuple(range(len(LENS))), tuple(LENS), "packed", "none", shape, (), 1, 0)
    again = load_micro_batch(desc, data.__getitem__, column=0)
    assert all(torch.equal(again[k], mb[k]) for k in mb)
    with pytest.raises(ValueError, match="packed_pair_shape"):
        collate_pairs(range(len(LENS)), LENS, "packed", (2, 24, 24), data.__getitem__)  # the plan's rows differ
    with pytest.raises(ValueError, match="wider than the rows"):
        collate_pairs(range(len(LENS)), LENS, "packed", (3, 16, 24), data.__getitem__)
    with pytest.raises(ValueError, match="\\(rows, input width, target width\\)"):
        collate_pairs(range(len(LENS)), LENS, "packed", (1, 72), data.__getitem__)


def test_each_target_is_shifted_right_on_its_own():
    labels = torch.tensor([[11, 12, 13, 21, 22, IGNORE, IGNORE]])
    segments = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    config = types.SimpleNamespace(decoder_start_token_id=5, pad_token_id=0)
    # the second target starts with the decoder start token, not the first target's last token (13)
    assert shift_targets(labels, segments, config).tolist() == [[5, 11, 12, 5, 21, 5, 0]]


def _run(model, lens, data):
    shape = packed_pair_shape(*zip(*lens), (24, 24))
    mb = collate_pairs(range(len(lens)), lens, "packed", shape, data.__getitem__)
    return pair_forward(model, model)(**mb, use_cache=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_forward_is_each_pair_alone_loss_and_gradients(variant, attn):
    """fp32 within 1e-6 (float sums in another order), and fp64 within 1e-12: the same math."""
    data = _pairs(LENS)
    for dtype, tol in ((torch.float32, EXACT), (torch.float64, 1e-12)):
        torch.manual_seed(0)
        model = build_seq2seq_lm(VARIANTS[variant]).to(dtype)
        model.set_attn_implementation(attn)
        assert model.decoder.block[1].layer[1].EncDecAttention.config._attn_implementation == attn
        ref = copy.deepcopy(model)
        total = scored_tokens(LENS)
        loss = _run(model, LENS, data).loss * total
        loss.backward()
        want = 0.0
        for d in data:
            alone = ref(
                input_ids=torch.as_tensor(d["input_ids"])[None], labels=torch.as_tensor(d["labels"])[None]
            ).loss * len(d["labels"])
            alone.backward()
            want += float(alone.detach())
        assert float(loss.detach()) == pytest.approx(want, rel=tol)
        grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
        largest = max(float(g.abs().max()) for _, g in grads)
        assert max(float((g - h).abs().max()) for g, h in grads) <= tol * largest


def test_a_packed_batch_handed_to_the_model_itself_fails():
    data = _pairs(LENS)
    mb = collate_pairs(range(len(LENS)), LENS, "packed", (3, 24, 24), data.__getitem__)
    with pytest.raises(ValueError, match="input_ids"):
        build_seq2seq_lm(T5)(**mb)


def test_models_that_would_not_compute_the_same_packed_are_refused():
    model = build_seq2seq_lm(T5)
    check_packable(model)
    with pytest.raises(ValueError, match="only T5's relative position bias"):
        check_packable(types.SimpleNamespace(config=types.SimpleNamespace(model_type="bart")))
    flex = copy.deepcopy(model.config)
    flex._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="additive 4-D masks"):
        check_packable(types.SimpleNamespace(config=flex))


def test_token_mean_step_of_packed_and_padded_pairs_is_the_whole_batch_token_mean():
    """A host's forward routes packed micro-batches (pair_forward), beside padded ones, recompute
    switched per micro-batch: one SGD step equals the unmodified T5 on each pair alone."""
    lens = LENS + [(4, 6), (9, 2)]
    data = _pairs(lens, seed=2)
    torch.manual_seed(0)
    model = build_seq2seq_lm(T5)
    ref = copy.deepcopy(model)
    packed = tuple(range(len(LENS)))
    descs = (
        PlannedMicroBatch(packed, tuple(LENS), "packed", "full", packed_pair_shape(*zip(*LENS), (24, 24)), (), 1, 0),
        PlannedMicroBatch((7, 8), tuple(lens[7:]), "padded", "none", pair_shape(*zip(*lens[7:])), (), 1, 0),
    )
    plan = ExecutionPlan(0, 0, 0, 1, 1, tuple(LoadMicroBatch(0, mb=k) for k in range(2)), descs)
    loaded = [load_micro_batch(d, data.__getitem__, column=0) for d in descs]
    step = Step(0, 0, plan, loaded, [list(d.sample_ids) for d in descs], scored_tokens(lens), "", 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    host = HostHooks(
        forward=pair_forward(model, model),
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
    assert loss == pytest.approx(want / scored_tokens(lens), rel=EXACT)
    reference(ref, samples, 0.5)
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters())) <= EXACT


def test_deepspeed_trains_the_pair_packing_baseline_exactly(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_t5_packed_worker.py", out)
    assert codes == [0, 0], logs[0][-3000:]
    cases = json.loads(out.read_text())
    assert {c["name"] for c in cases} == {"zero1 packing_full", "zero3 packed"}
    for c in cases:
        assert max(c["max_abs_diff"]) <= EXACT, c  # after every step
        for loss, want in c["losses"]:
            assert loss == pytest.approx(want, rel=EXACT), c
        assert sorted(i for ids in c["trained"] for i in ids) == list(range(c["samples"])), c  # each pair once
        assert c["layouts"] == ["packed"] and c["rows_shared"], c  # rows of several pairs


def test_hosts_without_the_packed_forward_refuse_packing_full():
    """DeepSpeed pipelines and FSDP run no packed pair micro-batch (models.seq2seq.pair_forward is the
    data-parallel DeepSpeed step's): they refuse the method by name."""
    import deepspeed_ext
    from dyn_plugin.fsdp import initialize

    cost = import_t5_tables(DIR / "measured" / "a100-t5-11b.json")
    data = [{"input_ids": [3, 4], "labels": [5, 6]}]
    method = {"microbatching": {"method": "packing_full"}}
    with pytest.raises(ValueError, match="pipelines of packed pairs"):
        deepspeed_ext.initialize(
            model=build_seq2seq_lm(T5),
            config={"dyn_plugin": {**method, "pipeline": {"stages": 2}}},
            dataset=data,
            lengths=[[2, 2]],
            cost_model=cost,
        )
    with pytest.raises(ValueError, match="packed pairs train under deepspeed_ext"):
        initialize(build_seq2seq_lm(T5), {"dyn_plugin": method}, data, [[2, 2]], cost_model=cost)
