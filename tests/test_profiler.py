"""The profiler on a real (tiny) torch model, and the fit's held-out accuracy on this machine."""

import numpy as np
import pytest
import torch

from dyn_plugin.models.hf import PRESETS, build_causal_lm
from dyn_plugin.profiling.memory import LiveMemory
from dyn_plugin.profiling.profiler import ProfileRun, run_profile
from dyn_plugin.profiling.workload import ProfileGrid, make_inputs

GRID = ProfileGrid(seq_lens=(16, 64, 256), micro_batch_sizes=(1, 4), max_tokens=512, recomputes=("none",), repeats=4)


@pytest.fixture(scope="module")
def profile():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # as one of 2 training ranks: a load process beside it, the all-reduce among 2
        yield run_profile(
            PRESETS["tiny-llama"], ProfileRun(name="tiny-llama", grid=GRID, validate=12, progress=False, ranks=2)
        )
    finally:
        torch.set_num_threads(threads)


def test_profile_contents(profile):
    assert {(t.layout, t.recompute) for t in profile.tables} == {("padded", "none"), ("packed", "none")}
    assert profile.model.num_layers == 4 and profile.model.params["layer"] > 0
    depths = {s.num_layers for s in profile.samples if s.component == "model"}
    assert depths == set(GRID.depths)
    for t in profile.tables:
        assert t.max_tokens == 256 and t.max_len == 256  # largest grid point: 64 x 4 and 256 x 1
        layer = t.fits["layer"]
        assert layer["forward_ms"].coef[1] > 0, "a layer's time must grow with tokens"
        assert layer["stored_bytes"].coef[1] > 0, "a layer must keep activations per token"


def test_a_split_backwards_weight_gradients_are_timed_apart_and_priced(profile):
    """W (the linear layers' weight gradients, as the pipeline engine's split runs them) is timed
    apart at both depths on a few micro-batches of each layout, fitted per layer and head, and the
    cost model prices a split backward by it: a part of the backward, growing with the tokens."""
    from dyn_plugin.cost.model import StageSpec, features
    from dyn_plugin.cost.profile import cost_model_from_profile
    from dyn_plugin.cost.table import evaluate_stage, weight_grad_ms

    timed = [s for s in profile.samples if s.weight_ms is not None]
    assert {s.num_layers for s in timed} == set(GRID.depths) and {s.layout for s in timed} == {"padded", "packed"}
    assert all(0 < s.weight_ms < s.backward_ms for s in timed)
    cost = cost_model_from_profile(profile)
    for layout in ("padded", "packed"):
        table = cost.table(layout, "none", 1)
        assert "weight_ms" in table.fits["layer"] and "weight_ms" in table.fits["head"]
        small, large = (features([n], layout, cost.pad_multiple) for n in (32, 256))
        stage = StageSpec(2, first=False, last=True)
        for f in (small, large):
            assert 0 < weight_grad_ms(table, f, stage) < evaluate_stage(table, f, stage).backward_ms
        assert weight_grad_ms(table, large, stage) > weight_grad_ms(table, small, stage)


def test_update_measured_with_the_load_gone(profile):
    import subprocess

    from dyn_plugin.cost.profile import cost_model_from_profile
    from dyn_plugin.cost.table import TableCostModel

    assert profile.ranks == 2
    (p1, t1), (p3, t3) = profile.update.optimizer  # AdamW at depths 1 and 3
    assert p3 > p1 and t3 > 0 and t1 > 0
    sizes = [b for b, _ in profile.update.allreduce]
    assert len(sizes) == 3 and all(ms > 0 for _, ms in profile.update.allreduce)
    # sharded data parallelism's collectives, among the same 2 ranks: the whole buffer's bytes per rank
    for points in (profile.update.allgather, profile.update.reducescatter):
        assert [b for b, _ in points] == [1 << 20, 4 << 20, 8 << 20] and all(ms > 0 for _, ms in points)
    cost = cost_model_from_profile(profile)
    assert cost.update.optimizer is not None and cost.update.allreduce is not None
    assert cost.update.allgather[1] > 0 and cost.update.reducescatter[1] > 0
    assert TableCostModel.from_dict(cost.to_dict()).update == cost.update
    left = subprocess.run(
        ["pgrep", "-f", "dyn_plugin.profiling.(shadow|collective)"], capture_output=True, text=True
    ).stdout
    assert left == "", f"profiling helpers still running: {left}"


def test_sequence_parallel_collectives_measured_among_the_ranks(profile):
    """The same 2 gloo ranks time an all-to-all and a ring exchange at three sizes; the cost model
    gets their lines and the model's heads (tiny-llama: 4 query, 2 key/value heads)."""
    from dyn_plugin.cost.profile import cost_model_from_profile
    from dyn_plugin.profiling.collective import measure_collectives

    c = profile.collectives
    assert c.backend == "gloo"
    for points in (c.alltoall, c.p2p):
        assert [b for b, _ in points] == [1 << 16, 1 << 20, 4 << 20] and all(ms > 0 for _, ms in points)
    cost = cost_model_from_profile(profile)
    assert cost.collectives.ranks == 2 and cost.collectives.alltoall[1] > 0 and cost.collectives.p2p[1] > 0
    assert (cost.num_heads, cost.num_kv_heads, cost.kv_hidden_size) == (4, 2, 64)
    with pytest.raises(ValueError, match=r"unknown collectives \['broadcast'\]"):
        measure_collectives(2, {"broadcast": [1024]})


def test_held_out_prediction_within_15_percent(profile):
    v = profile.validation
    assert v["count"] == 12 and {c["layout"] for c in v["cases"]} == {"padded", "packed"}
    assert v["mape"] <= 0.15, f"held-out mean error {v['mape']:.1%}: {v['cases']}"


def test_live_memory_counts_stored_activations():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with LiveMemory() as mem:
        before = mem.live
        y = torch.relu(lin(x))
        stored = mem.live - before
        y.sum().backward()
    assert stored >= 32 * 64 * 4  # at least the activation relu keeps for backward
    assert mem.peak >= stored


def test_packed_inputs_reset_positions_and_mask_boundaries():
    packed = make_inputs([3, 2], "packed", 100, 8, np.random.default_rng(0))
    assert packed.pos.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.labels[0, 0] == -100 and packed.labels[0, 3] == -100
    # the boundaries and the longest document travel with the batch, as the collator ships them
    assert packed.cu.tolist() == [0, 3, 5] and packed.longest == 3
    assert packed.kwargs()["cu_seq_lens_q"] is packed.cu and packed.kwargs()["max_length_q"] == 3
    padded = make_inputs([3, 9], "padded", 100, 8, np.random.default_rng(0))
    assert padded.ids.shape == (2, 16) and padded.pos is None and (padded.labels[0, 3:] == -100).all()
    assert "cu_seq_lens_q" not in padded.kwargs()


def test_varlen_attention_isolates_documents():
    torch.manual_seed(0)
    model = build_causal_lm(PRESETS["tiny-llama"], num_layers=2).eval()
    lens = [10, 7, 15]
    ids = torch.randint(0, 100, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    packed = model(input_ids=ids, position_ids=pos).logits
    start = 0
    for n in lens:
        alone = model(input_ids=ids[:, start : start + n]).logits
        assert torch.allclose(alone, packed[:, start : start + n], atol=1e-5)
        start += n


def test_recompute_switch_saves_memory_and_keeps_gradients():
    from dyn_plugin.models.recompute import RecomputeSwitch

    torch.manual_seed(0)
    model = build_causal_lm({**PRESETS["tiny-llama"], "num_hidden_layers": 2}).train()
    ids = torch.randint(0, 8192, (1, 256))
    switch = RecomputeSwitch(model)
    assert len(switch.layers) == 2
    stored, grads = {}, {}
    for mode in ("none", "full", "selective", "none"):
        switch.set(mode)
        model.zero_grad()
        with LiveMemory() as mem:
            before = mem.live
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            stored[mode] = mem.live - before
            loss.backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert stored["full"] < stored["selective"] < stored["none"]
    for mode in ("full", "selective"):
        assert torch.allclose(grads[mode], grads["none"], atol=1e-6)
    assert not any("forward" in vars(m) for m in model.modules())  # "none" restored every forward
    with pytest.raises(ValueError, match="recompute mode 'some'"):
        switch.set("some")


def test_load_processes_that_do_not_start_in_time_are_an_error_and_stopped():
    from dyn_plugin.profiling.shadow import ShadowLoad

    load = ShadowLoad(PRESETS["tiny-llama"], GRID, count=1, threads=1, timeout_s=0.2)  # too short to build a model
    with pytest.raises(RuntimeError, match=r"did not start \(not ready after 0.2 s\)"):
        with load:
            pass
    assert all(p.poll() is not None for p in load.procs)


def test_bf16_on_cpu_is_measured_and_recorded_in_bf16(profile):
    from dyn_plugin.profiling.device import Target

    half = run_profile(
        PRESETS["tiny-llama"],
        ProfileRun(
            name="tiny-llama", grid=GRID, validate=0, progress=False, target=Target(torch.device("cpu"), "bf16")
        ),
    )
    assert (half.device.type, half.device.dtype, half.model.dtype) == ("cpu", "bf16", "bf16")
    assert (profile.device.dtype, profile.model.dtype) == ("fp32", "fp32")

    def per_token(p):
        return next(t for t in p.tables if t.layout == "padded").fits["layer"]["stored_bytes"].coef[1]

    # a layer's activations in 2-byte elements (softmax statistics stay fp32)
    assert 0.35 < per_token(half) / per_token(profile) < 0.75
    # AdamW steps fp32 master copies: as many parameters as the fp32 model's
    assert [n for n, _ in half.update.optimizer] == [n for n, _ in profile.update.optimizer]
