"""A sharding plan under DeepSpeed ZeRO-3 on 2 CPU ranks (gloo): a hand-made plan mixing kept and
fully sharded units, applied by deepspeed_ext.initialize (as an argument and from its JSON file),
trains one planned step of uneven micro-batches exactly like the single-process token-mean
reference, with the kept units' parameters persistent and the others partitioned."""

import json

from ranks import run

EXACT = 1e-6  # fp32; ZeRO-3 reduces in another order than the reference sums


def test_zero3_trains_a_mapped_plan_exactly(tmp_path):
    out = tmp_path / "result.json"
    codes, logs = run("ds_zero3_plan_worker.py", out, tmp_path)
    assert codes == [0, 0], logs[0][-3000:]
    results = json.loads(out.read_text())
    assert [r["case"] for r in results] == ["attention", "layer0", "searched"]
    for r in results:
        # the loader plans micro-batches for the model states ZeRO-3 really holds under the mapping
        assert r["planned_state_bytes"] == r["mapped_state_bytes"] > 0, r
        assert r["max_abs_diff"] <= EXACT, r
        assert len(r["micro_batch_sizes"]) > 1, r  # several micro-batches in the step
        assert r["recompute_ran"] == r["recompute"], r
    attention, layer0, searched = results
    assert searched["host"] == "zero3"  # searched by initialize with ZeRO-3's semantics, then trained exactly
    for r in (attention, layer0):
        assert r["reuse_distance"] == 0  # partitioned parameters freed after every use, as "full" is
        # exactly the kept units' parameters are marked persistent by initialize, and after the step they are
        # whole and gathered on every rank while the rest are partitioned: released, no elements outside their shard
        assert sorted(n for n, (persist, _, _) in r["before"].items() if persist) == r["wanted_persistent"], r
        for name, (persist, available, held) in r["after"].items():
            assert persist == (name in r["wanted_persistent"]), name
            assert available == persist and held == (r["numel"][name] if persist else 0), (name, r["after"][name])
    assert len(set(attention["micro_batch_sizes"] + layer0["micro_batch_sizes"])) > 1  # of uneven sizes
    # the size threshold alone separates attention (<= 1024 elements) from the MLPs and embeddings
    assert attention["thresholds"][0] == 1024
    # layer 0's and layer 1's MLP weights are the same size: the model threshold cuts the persistent prefix
    # after layer 0's MLP (embedding 3104 elements first, partitioned; layer 0's attention 3072 + MLP 6144)
    assert layer0["thresholds"] == [2048, 3072 + 6144]
