"""Sequence-parallel groups inside DeepSpeed pipelines (the plugin's PlanPipelineEngine) on gloo:
4 ranks as pp=2 x 2 columns, ZeRO-1, consecutive steps grouping the columns [2], [1, 1], [2],
padded (Ulysses) and packed (ring, full recompute): parameters and losses equal the single-process
token-mean reference (tests/ds_pipe_sp_worker.py)."""

import json

from ranks import run

EXACT = 1e-6  # fp32, three SGD steps; shards sum their losses and attention in another order than one process


def test_pipeline_runs_sequence_parallel_groups_exactly(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_pipe_sp_worker.py", out, world=4)
    assert codes == [0] * 4, logs[0][-3000:]
    results = json.loads(out.read_text())
    assert {(r["layout"], r["attention"]) for r in results} == {("padded", "ulysses"), ("packed", "ring")}
    for r in results:
        assert r["stage_major"] and r["dp"] == 2, r
        assert r["max_abs_diff"] <= EXACT, r
        assert r["params_compared"] == r["params"] * r["dp"], r  # every parameter, on the stage that holds it
        assert r["samples"] == r["distinct"] == r["global_batch"], r  # each sample once per step, over the groups
        assert r["recompute_ran"] == r["recompute"], r
        assert [s["sp"] for s in r["steps"]] == [[2], [1], [2]], r  # the groupings [2], [1, 1], [2] ran
        # the global token-mean loss on every rank, from train_batch and from eval_batch's forwards
        assert all(s["loss_diff"] <= EXACT and s["eval_diff"] <= EXACT for s in r["steps"]), r
        assert r["steps"][0]["micro_batches"] > 1, r  # a group runs several micro-batches through the pipeline
    packed = next(r for r in results if r["layout"] == "packed")
    assert sum(s["padding_documents"] for s in packed["steps"]) > 0, packed  # a width rounded up to the group
