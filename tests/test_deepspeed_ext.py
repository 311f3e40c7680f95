"""DeepSpeed on CPU ranks (gloo): one planned step equals the single-process token-mean
reference for ZeRO 0-3, padded and packed, with several uneven micro-batches per rank, and
for the plugin's pipeline engine at pp=2 and pp=2 x dp=2."""

import json

import pytest

from ranks import run

EXACT = 1e-7  # plan vs single-process reference, fp32: equal up to the order floats are summed in


def test_exact_token_mean_step_for_every_zero_stage(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_exact_worker.py", out)
    assert codes == [0, 0], logs[0][-3000:]
    report = json.loads(out.read_text())
    results, mixed = report["cases"], report["mixed"]
    assert {(r["stage"], r["layout"]) for r in results} == {(s, l) for s in range(4) for l in ("padded", "packed")}
    for r in results + [mixed]:
        # fp32, one SGD step at lr 0.5: the runs differ only in summation order (~1e-8 measured)
        assert r["max_abs_diff"] <= EXACT, r
        assert len(r["micro_batch_sizes"]) > 1, r  # the plan cut the step into several micro-batches
    for r in results:
        assert r["recompute_ran"] == r["recompute"], r  # recompute changes memory, never the gradients
    assert any(len(set(r["micro_batch_sizes"])) > 1 for r in results)  # of uneven sizes
    # one step whose micro-batches switch recompute modes and checkpointed layer counts (pyramid),
    # each honoured: attention runs once per layer, twice in each layer whose backward recomputes it
    # (full: the whole layer; selective: attention only)
    assert len(set(mixed["planned_modes"])) > 1, mixed
    assert mixed["modes_ran"] == mixed["planned_modes"] and mixed["counts_ran"] == mixed["planned_counts"], mixed
    assert mixed["attention_calls"] == [
        mixed["layers"] + (0 if m == "none" else n) for m, n in zip(mixed["planned_modes"], mixed["planned_counts"])
    ], mixed


@pytest.mark.parametrize(
    "world, schedule",
    [(2, "auto"), (4, "auto"), (2, "zero_bubble"), (4, "zero_bubble")],
    ids=["pp2", "pp2xdp2", "pp2-split", "pp2xdp2-split"],
)
def test_pipeline_engine_runs_the_plan_exactly(tmp_path, world, schedule):
    """The plan as planned, exactly; under zero_bubble with its backwards split into I and a later
    W wherever the plan splits them (the linear layers' weight gradients deferred, then accumulated
    through autograd so DeepSpeed's gradient hooks see them)."""
    out = tmp_path / "result.json"
    codes, logs = run("ds_pipe_worker.py", out, schedule, world=world)
    assert codes == [0] * world, logs[0][-3000:]
    results = json.loads(out.read_text())
    assert {(r["zero"], r["layout"], r["tied"]) for r in results} == {
        (0, "padded", False),
        (1, "packed", False),
        (1, "packed", True),
    }
    for r in results:
        assert r["dp"] == world // 2
        assert r["max_abs_diff"] <= EXACT, r
        assert r["recompute_ran"] == r["recompute"], r
        assert r["restored_diff"] == 0.0 and r["resume_step"] == 2, r
        assert r["shapes_changed"], (
            r
        )  # two steps, different micro-batches, one engine  # checkpoint: weights and loader position
        # every parameter, on the stage that holds it (a tied one on both its stages)
        assert r["params_compared"] == (r["params"] + r["tied"]) * r["dp"], r
        assert r["samples"] == r["distinct"] == r["global_batch"], r  # each sample once, over all replicas, 2 steps
        assert r["micro_batches"] > 1, r
        # each forward and backward ran its micro-batch's mode on the count planned for its stage
        if r["recompute"] == "none":
            assert all(ran == 0 for _, ran, _ in r["pyramid"]), r
        else:
            assert all(ran == planned and planned is not None for planned, ran, _ in r["pyramid"]), r
            assert any(0 < planned < layers for planned, _, layers in r["pyramid"]), r  # partial counts ran
        inputs, weights, _ = r["split"]
        assert inputs == weights and (inputs > 0) == (schedule == "zero_bubble"), r
        # every stage's passes were timed and gathered after each step (its I and W as one backward),
        # and the second step was planned with the version fitted after the first
        assert r["observed"] == [0, 1] and len(r["versions"]) >= 2 and r["versions"][1]["from_step"] == 1, r
    assert any(len(set(r["sizes"])) > 1 for r in results)  # of uneven sizes
    # W's placed after other micro-batches' passes (where a plan of two micro-batches has none to wait for)
    assert any(r["split"][2] for r in results) == (schedule == "zero_bubble")


def test_pipeline_splits_backwards_in_bf16(tmp_path):
    """DeepSpeed's bf16 optimizer takes each backward's gradients into fp32 as the backward ends: a W's,
    which come later, are taken the same way. Against the fp32 reference the split plans land as close
    as the unsplit ones do (bf16's rounding: 1.04e-3 both, measured), and without their W's far off."""
    for drop, bound in (([], 2e-3), (["--drop-weights"], None)):
        out = tmp_path / f"bf16{len(drop)}.json"
        codes, logs = run("ds_pipe_worker.py", out, "zero_bubble", "--bf16", *drop, world=2)
        assert codes == [0, 0], logs[0][-3000:]
        for r in json.loads(out.read_text()):
            assert r["split"][0] == r["split"][1] > 0, r
            assert r["zero"] == 1 and r["restored_diff"] == 0.0 and r["resume_step"] == 2, r  # its checkpoint too
            if bound:
                assert r["max_abs_diff"] <= bound, r
            else:
                assert r["max_abs_diff"] > 3e-3, r


def test_a_split_backward_without_its_weight_gradients_is_caught(tmp_path):
    """The same split plans with every W doing nothing: the linear layers' weight gradients are
    missing, and the comparison with the reference says so."""
    out = tmp_path / "result.json"
    codes, logs = run("ds_pipe_worker.py", out, "zero_bubble", "--drop-weights", world=2)
    assert codes == [0, 0], logs[0][-3000:]
    for r in json.loads(out.read_text()):
        assert r["split"][1] > 0 and r["max_abs_diff"] > 1e-3, r


def test_pipeline_with_zero_2_is_refused_before_training():
    import deepspeed_ext

    cfg = {"zero_optimization": {"stage": 2}, "dyn_plugin": {"pipeline": {"stages": 2}}}
    with pytest.raises(ValueError, match="supports ZeRO stages 0 and 1 only"):
        deepspeed_ext.initialize(model=None, config=cfg, dataset=[], lengths=[])
    # a batching that cannot promise every rank the same number of micro-batches
    cfg = {"zero_optimization": {"stage": 3}, "dyn_plugin": {"microbatching": {"method": "fixed_padding"}}}
    with pytest.raises(ValueError, match="same number of micro-batches, which ZeRO-2/3 need"):
        deepspeed_ext.initialize(model=None, config=cfg, dataset=[], lengths=[])


def test_cost_model_takes_the_heads_a_profile_lacks_from_the_live_model(tmp_path):
    """A version 2 profile of imported tables records no heads: the model being trained says."""
    from deepspeed_ext.engine import cost_model_for
    from dyn_plugin.config import load_config
    from dyn_plugin.cost.bundled import DIR
    from dyn_plugin.models.hf import PRESETS, build_causal_lm

    raw = json.loads((DIR / "a100-gpt-6.7b.json").read_text())
    raw["version"], raw["model"]["num_heads"] = 2, None
    del raw["sha256"]  # a profile that old carried no checksum
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(
        {"fp16": {"enabled": True}, "dyn_plugin": {"cost_model": {"kind": "profile", "profile": str(path)}}}
    )
    cost = cost_model_for(cfg, build_causal_lm(PRESETS["tiny-llama"], num_layers=1))
    assert (cost.num_heads, cost.num_kv_heads, cost.hidden_size) == (4, 2, 4096)  # width: the profile's own
