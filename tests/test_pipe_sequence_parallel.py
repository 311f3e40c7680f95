"""Sequence-parallel groups inside DeepSpeed pipelines (the plugin's PlanPipelineEngine) on gloo:
4 ranks as pp=2 x 2 columns, ZeRO-1, consecutive steps grouping the columns [2], [1, 1], [2],
padded (Ulysses) and packed (ring, full recompute; again with backwards split for a
zero-bubble schedule): parameters and losses equal the single-process token-mean reference
(tests/ds_pipe_sp_worker.py)."""

import json

from ranks import run

EXACT = 1e-6  # fp32, three SGD steps; shards sum their losses and attention in another order than one process


def test_pipeline_runs_sequence_parallel_groups_exactly(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_pipe_sp_worker.py", out, world=4)
    assert codes == [0] * 4, logs[0][-3000:]
    results = json.loads(out.read_text())
    assert {(r["layout"], r["attention"], r["schedule"]) for r in results} == {
        ("padded", "ulysses", "auto"),
        ("packed", "ring", "auto"),
        ("packed", "ring", "zero_bubble"),
    }
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
        split = sum(s["split"] for s in r["steps"])  # rank 0's backwards run as I and W (zero-bubble plans only)
        assert (split > 0) == (r["schedule"] == "zero_bubble"), r
    packed = next(r for r in results if r["layout"] == "packed")
    assert sum(s["padding_documents"] for s in packed["steps"]) > 0, packed  # a width rounded up to the group


def test_a_send_alone_is_waited_for_at_the_next_exchange(monkeypatch):
    """A batch of sends only is left in flight while the next forward or backward runs (waited at
    once, on NCCL the compute stream would queue behind it); a batch with a receive is waited for
    before its tensors are used, and the pending send before that; the step's end waits for the last."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dyn_plugin.host.transfers import Transfers

    events = []

    class Work:
        def __init__(self, name):
            self.name = name

        def wait(self):
            events.append(f"wait {self.name}")

    def batch_isend_irecv(ops):
        events.append("post " + "+".join(op.name for op in ops))
        return [Work(op.name) for op in ops]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    transfers = Transfers()  # the DeepSpeed pipeline engine's and the Megatron executor's

    def op(kind, name):
        return SimpleNamespace(op=kind, name=name), lambda: events.append(f"done {name}")

    transfers.exchange([op(dist.isend, "act0")])
    events.append("forward 1")
    transfers.exchange([op(dist.isend, "act1"), op(dist.irecv, "grad0")])
    assert transfers.receiving  # a batch with a receive: waited before the next instruction but a W
    transfers.exchange([op(dist.isend, "act2")])
    assert not transfers.receiving
    transfers.finish()
    assert events == [
        "post act0",
        "forward 1",  # ran while act0 was in flight
        "wait act0",
        "done act0",
        "post act1+grad0",
        "wait act1",
        "wait grad0",
        "done act1",
        "done grad0",
        "post act2",
        "wait act2",
        "done act2",
    ]
