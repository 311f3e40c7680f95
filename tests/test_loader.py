"""DynLoader without a store: exactly once, resume, collation, bad input."""

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.layout import RankLayout
from dyn_plugin.runtime.collate import collate, scored_tokens
from dyn_plugin.runtime.loader import DynLoader
from dyn_plugin.runtime.sampler import epoch_batches

SECTION = {
    "cost_model": {
        "kind": "analytic",
        "dtype": "fp32",
        "model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 100},
    },
    "microbatching": {"global_tokens": 3000, "max_seq_len": 600},
    "cluster": {"device": {"memory_mb": 2000}},
}


def make(pp=1, n=120, seed=0, **over):
    cfg = DynPluginConfig.model_validate({**SECTION, "pipeline": {"stages": pp}, **over})
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 600, size=n)
    data = [{"input_ids": rng.integers(1, 100, size=int(s))} for s in lens]
    return cfg, build_cost_model(cfg.cost_model, cfg.cluster), lens, data


def loaders(cfg, cm, lens, data, dp, pp, **kw):
    return {
        (r, s): DynLoader(
            data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout.of(dp, pp), stage=s, column=r, seed=7, **kw
        )
        for r in range(dp)
        for s in range(pp)
    }


@pytest.mark.parametrize("dp,pp", [(1, 1), (2, 1), (2, 2), (3, 1)])
def test_every_sample_exactly_once_per_epoch(dp, pp):
    cfg, cm, lens, data = make(pp)
    ls = loaders(cfg, cm, lens, data, dp, pp)
    seen = []
    steps = {k: list(l) for k, l in ls.items()}
    for (_, s), st in steps.items():
        for step in st:
            if s == 0:
                seen += [i for mb in step.sample_ids for i in mb]
    assert sorted(seen) == list(range(len(lens)))
    for st in steps.values():
        assert [x.digest for x in st] == [x.digest for x in steps[(0, 0)]]  # all ranks, same plans
        assert all(x.scored_tokens == steps[(0, 0)][i].scored_tokens for i, x in enumerate(st))
    if pp == 2:  # the last stage loads the same micro-batches (labels) as the first
        for r in range(dp):
            assert [x.sample_ids for x in steps[(r, 1)]] == [x.sample_ids for x in steps[(r, 0)]]


def test_tokens_count_every_replicas_scored_tokens():
    cfg, cm, lens, data = make()
    ls = loaders(cfg, cm, lens, data, 2, 1)
    for a, b in zip(ls[(0, 0)], ls[(1, 0)]):
        ids = [i for st in (a, b) for mb in st.sample_ids for i in mb]
        assert a.scored_tokens == scored_tokens([int(lens[i]) for i in ids])
        scored = sum(int((mb["labels"] != -100).sum()) for st in (a, b) for mb in st.micro_batches)
        assert scored == a.scored_tokens


def test_resume_gives_exactly_the_rest_with_the_same_plans():
    cfg, cm, lens, data = make()
    full = list(DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=3))
    first = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=3)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=3)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [s.digest for s in rest] == [s.digest for s in full[3:]]
    assert [s.sample_ids for s in rest] == [s.sample_ids for s in full[3:]]
    # the next epoch starts afterwards, reshuffled
    nxt = list(resumed)
    assert nxt and nxt[0].epoch == 1 and [s.sample_ids for s in nxt] != [s.sample_ids for s in full]


def test_resume_refuses_a_different_run():
    cfg, cm, lens, data = make()
    state = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=3).state_dict()
    other = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=4)
    with pytest.raises(ValueError, match="different lengths, seed"):
        other.load_state_dict(state)


def _epoch_samples(cfg, cm, lens, data, dp: int, state: dict | None = None) -> list[int]:
    """Every sample the rest of epoch 0 hands out over ``dp`` columns (from ``state`` when given)."""
    out = []
    for column in range(dp):
        loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(dp), column=column, seed=3)
        if state is not None:
            loader.load_state_dict(state)
        out += [i for step in loader for mb in step.sample_ids for i in mb]
    return out


def test_resume_on_another_data_parallel_size_keeps_the_epoch_when_its_order_survives():
    cfg, cm, lens, data = make()
    first = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=3)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    trained = [i for batch in first.context.batches(0)[:3] for i in batch]
    for dp in (1, 4):  # batches hold ~10 sequences: at least 1, 2 or 4 per batch changes none of them
        assert sorted(trained + _epoch_samples(cfg, cm, lens, data, dp, state)) == list(range(len(lens)))

    # 12 columns need 12 sequences a batch: the epoch's batches change, and where a changed one was
    # already trained the samples left would not be the interrupted run's
    wide = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(12), column=0, seed=3)
    changed = next(k for k, (a, b) in enumerate(zip(first.context.batches(0), wide.context.batches(0))) if a != b)
    later = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=3)
    it = iter(later)
    for _ in range(changed + 1):
        next(it)
    with pytest.raises(ValueError, match="saved on 2 data-parallel columns, this run has 12"):
        wide.load_state_dict(later.state_dict())
    wide.load_state_dict({**later.state_dict(), "epoch": 1, "step": 0})  # at an epoch's start: any size


def test_bad_input_names_the_index():
    cfg, cm, lens, data = make()
    with pytest.raises(ValueError, match="lengths has 119 entries but the dataset has 120"):
        DynLoader(data, lengths=lens[:-1], config=cfg, cost_model=cm)
    bad = lens.copy()
    bad[5] = 0
    with pytest.raises(ValueError, match=r"lengths\[5\] = 0"):
        DynLoader(data, lengths=bad, config=cfg, cost_model=cm)
    bad = lens.copy()
    bad[9] = 5000
    with pytest.raises(ValueError, match=r"lengths\[9\] = 5000 exceeds microbatching.max_seq_len = 600"):
        DynLoader(data, lengths=bad, config=cfg, cost_model=cm)
    with pytest.raises(ValueError, match="the layout has 2 stages but dyn_plugin.pipeline.stages = 1"):
        DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2, stages=2))


def test_truncation_only_when_asked():
    cfg, cm, lens, data = make(microbatching={"global_tokens": 3000, "max_seq_len": 600, "truncate": True})
    long = lens.copy()
    long[0] = 900
    data[0] = {"input_ids": np.arange(900) % 99 + 1}
    steps = list(DynLoader(data, lengths=long, config=cfg, cost_model=cm))
    for s in steps:
        for mb in s.micro_batches:
            longest = mb["max_length_q"] if "max_length_q" in mb else int(mb["attention_mask"].sum(1).max())
            assert longest <= 600


def test_length_mismatch_with_the_data_is_caught():
    cfg, cm, lens, data = make()
    data[2] = {"input_ids": np.arange(3)}
    lens = lens.copy()
    lens[2] = 10
    with pytest.raises(ValueError, match=r"dataset\[2\] has 3 tokens but its length was given as 10"):
        list(DynLoader(data, lengths=lens, config=cfg, cost_model=cm))


def test_collate_layouts():
    data = {0: [1, 2, 3], 1: [4, 5, 6, 7, 8]}
    packed = collate([0, 1], [3, 5], "packed", (1, 8), data.__getitem__)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert packed["labels"].tolist() == [[-100, 2, 3, -100, 5, 6, 7, 8]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 8] and packed["max_length_q"] == 5
    padded = collate([0, 1], [3, 5], "padded", (2, 8), data.__getitem__, pad_id=0)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0]]
    assert padded["labels"][0].tolist() == [-100, 2, 3, -100, -100, -100, -100, -100]
    assert padded["attention_mask"].sum().item() == 8
    row = collate([0, 1], [3, 5], "padded", (1, 10), data.__getitem__, pad_id=0)  # fixed-length packing
    assert row["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0, 0]]
    assert row["labels"].tolist() == [[-100, 2, 3, -100, 5, 6, 7, 8, -100, -100]]


def test_epoch_batches_partition_and_keep_dp_sized_tails():
    lens = np.array([5] * 11)
    batches = epoch_batches(lens, 20, seed=0, epoch=0, min_sequences=4)
    assert sorted(sum(batches, [])) == list(range(11))
    assert all(len(b) >= 4 for b in batches)
    assert epoch_batches(lens, 20, seed=0, epoch=1, min_sequences=4) != batches


def _epoch_batches_by_loop(lengths, tokens, *, seed, epoch, min_sequences=1):
    """The sampler's rule written as the plain per-sample loop it once was: the reference."""
    batches, cur, total = [], [], 0
    for i in np.random.default_rng(seed + epoch).permutation(len(lengths)):
        s = int(lengths[i])
        if total + s > tokens and len(cur) >= min_sequences:
            batches.append(cur)
            cur, total = [], 0
        cur.append(int(i))
        total += s
    if len(cur) < min_sequences and batches:
        batches[-1] += cur
    else:
        batches.append(cur)
    return batches


def test_vectorized_epoch_batches_equal_the_per_sample_loop():
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        lens = rng.integers(0 if trial % 3 == 0 else 1, int(rng.choice([5, 50, 500])), size=n)
        tokens = int(rng.integers(1, 400))
        min_seq = int(rng.integers(1, min(n, 5) + 1))
        kw = dict(seed=int(rng.integers(100)), epoch=int(rng.integers(3)), min_sequences=min_seq)
        assert epoch_batches(lens, tokens, **kw) == _epoch_batches_by_loop(lens, tokens, **kw), (lens, tokens, kw)


def test_a_lookahead_fills_the_budget_and_keeps_every_sample_once():
    """With a lookahead a batch goes on past the sequences that do not fit, taking later ones that
    do: every sample still once an epoch, no batch over budget (beyond its first min_sequences),
    the same batches on every call, and code-like lengths fill >= 99% of the budget on average."""
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(6.2, 1.3, size=3000).astype(int), 2, 4096)
    for min_seq in (1, 4):
        plain = epoch_batches(lens, 16384, seed=1, epoch=0, min_sequences=min_seq)
        batches = epoch_batches(lens, 16384, seed=1, epoch=0, min_sequences=min_seq, lookahead=64)
        assert batches == epoch_batches(lens, 16384, seed=1, epoch=0, min_sequences=min_seq, lookahead=64)
        assert sorted(i for b in batches for i in b) == list(range(len(lens)))
        assert all(len(b) >= min_seq for b in batches)
        # within the budget, but for a batch of only its forced first ones (and the last, a short tail joined)
        assert all(sum(lens[b]) <= 16384 or len(b) == min_seq for b in batches[:-1])
        fill = [sum(lens[b]) / 16384 for b in batches[:-1]]
        assert np.percentile(fill, 5) >= 0.97 and np.mean(fill) >= 0.99  # the epoch's last few hold what is left
        assert np.mean([sum(lens[b]) / 16384 for b in plain[:-1]]) < 0.95  # what the lookahead buys
        assert len(batches) < len(plain)
    # small cases: a partition whatever the lengths, budget and lookahead
    for trial in range(300):
        n = int(rng.integers(1, 60))
        small = rng.integers(0, int(rng.choice([5, 50, 500])), size=n)
        kw = dict(
            seed=trial, epoch=0, min_sequences=int(rng.integers(1, min(n, 5) + 1)), lookahead=int(rng.integers(1, 9))
        )
        got = epoch_batches(small, int(rng.integers(1, 400)), **kw)
        assert sorted(i for b in got for i in b) == list(range(n)) and all(len(b) >= kw["min_sequences"] for b in got)


@pytest.mark.parametrize("how", ["close", "garbage-collected"])
def test_planner_processes_stop_with_the_loader(how):
    import gc
    import os
    import time

    cfg, cm, lens, data = make(store={"backend": "tcp", "port": 0, "namespace": f"lifecycle-{how}"})
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=7)
    it = iter(loader)
    first = next(it)
    assert first.micro_batches
    pids = [p.pid for p in loader._pool.procs]
    assert pids and all(os.path.exists(f"/proc/{p}") for p in pids)
    it.close()
    if how == "close":
        loader.close()
    else:
        del it, loader
        gc.collect()
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


@pytest.mark.parametrize("method", ["fixed_padding", "token_budget", "packing_full", "packing_varlen"])
def test_baseline_batching_through_the_same_loader(method):
    cfg, cm, lens, data = make(microbatching={"global_tokens": 3000, "max_seq_len": 600, "method": method})
    seen = []
    for r in range(2):
        for step in DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=r, seed=1):
            seen += [i for mb in step.sample_ids for i in mb]
            assert step.predicted_ms > 0
    assert sorted(seen) == list(range(len(lens)))


def test_run_wide_positions_round_trip_across_epochs():
    cfg, cm, lens, data = make()
    ctx = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=7).context
    per_epoch = [len(ctx.batches(e)) for e in range(3)]
    assert ctx.position(2, 1) == per_epoch[0] + per_epoch[1] + 1
    for epoch in range(3):
        for step in range(per_epoch[epoch]):
            assert ctx.locate(ctx.position(epoch, step)) == (epoch, step)


def test_uneven_micro_batch_counts_refused_under_zero_2():
    """Round-robin batchings can leave one replica a micro-batch short; ZeRO-2/3 would hang."""
    cfg, cm, lens, data = make(microbatching={"global_tokens": 3000, "max_seq_len": 600, "method": "packing_varlen"})
    loader = DynLoader(
        data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=1, zero_stage=2
    )
    with pytest.raises(ValueError, match=r"gave the replicas \[.*\] micro-batches, but ZeRO-2 needs the same number"):
        list(loader)
    plugin = make(microbatching={"global_tokens": 3000, "max_seq_len": 600})[0]
    assert list(DynLoader(data, lengths=lens, config=plugin, cost_model=cm, layout=RankLayout(2), seed=1, zero_stage=2))


def test_recompute_differing_between_replicas_refused_under_zero_3(monkeypatch):
    """ZeRO-3 gathers parameters per module over all ranks in the order modules run; a replica that
    recomputes where another does not runs them in another order (gloo: a size mismatch; NCCL: a hang)."""
    from dataclasses import replace

    from dyn_plugin.plan.methods import registry as methods

    cfg, cm, lens, data = make()
    plan_step = methods.plan_step

    def mixed(lengths, spec):
        plan = plan_step(lengths, spec)
        first = plan.replicas[0]
        redone = tuple(replace(mb, recompute="full") for mb in first.micro_batches)
        return replace(plan, replicas=(replace(first, micro_batches=redone),) + plan.replicas[1:])

    monkeypatch.setattr(methods, "plan_step", mixed)
    loader = DynLoader(
        data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=1, zero_stage=3
    )
    with pytest.raises(ValueError, match="ZeRO-3 needs the same recompute at each micro-batch index"):
        list(loader)
    assert list(DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), seed=1, zero_stage=2))


METHODS = ["dynapipe", "fixed_padding", "token_budget", "packing_full", "packing_varlen"]


@pytest.mark.parametrize("layout", ["padded", "packed", "auto"])
@pytest.mark.parametrize("method", METHODS)
def test_loaded_tensors_have_exactly_the_plans_shapes(method, layout):
    """The planner prices a plan's shape and later pipeline stages allocate receive buffers from
    it: every tensor the loader builds must have exactly that shape, for every method."""
    cfg, cm, lens, data = make(
        pp=2, microbatching={"global_tokens": 3000, "max_seq_len": 600, "method": method, "layout": layout}
    )
    layouts = set()
    for s in (0, 1):  # the first stage loads inputs, the last labels
        loader = DynLoader(
            data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout.of(2, 2), stage=s, column=0, seed=1
        )
        for step, _ in zip(loader, range(3)):
            assert step.micro_batches
            for tensors, desc in zip(step.micro_batches, step.loaded):
                layouts.add(desc.layout)
                for name in ("input_ids", "labels", "attention_mask", "position_ids"):
                    if name in tensors:
                        assert tuple(tensors[name].shape) == tuple(desc.shape), (name, desc)
                if desc.layout == "packed":  # priced and run on the real tokens, no fill
                    assert tuple(desc.shape) == (1, sum(desc.seq_lens))
    if method == "dynapipe" and layout != "auto":
        assert layouts == {layout}
    if method == "packing_varlen":
        assert layouts == {"packed"}


@pytest.mark.parametrize(
    "layout,shape", [("packed", (1, 16)), ("packed", (2, 7)), ("padded", (1, 8)), ("padded", (3, 8))]
)
def test_collate_refuses_tensors_other_than_the_plans_shape(layout, shape):
    data = [list(range(1, 4)), list(range(1, 10))]  # 3 and 9 tokens
    with pytest.raises(ValueError, match=r"samples \[0, 1\] .* does not fit the plan's shape .*tensor_shape"):
        collate([0, 1], [3, 9], layout, shape, data.__getitem__)


def test_padded_width_follows_pad_multiple():
    cfg, cm, lens, data = make(
        microbatching={"global_tokens": 3000, "max_seq_len": 600, "layout": "padded", "pad_multiple": 64}
    )
    step = next(iter(DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=1)))
    widths = [mb["input_ids"].shape[1] for mb in step.micro_batches]
    assert all(w % 64 == 0 for w in widths) and any(w % 128 for w in widths), widths


def _kill_first_planner(loader):
    import os
    import signal

    loader._source.start_planners(loader.position)
    os.kill(loader._pool.procs[0].pid, signal.SIGKILL)


@pytest.mark.parametrize("rank", ["host", "other"])
def test_a_killed_planner_is_planned_around_at_once(rank, caplog):
    """Not after loader.local_plan_after_s: the watcher publishes the exit, each rank plans the step
    itself (the same plan: plans are deterministic) and says so once."""
    import time

    from dyn_plugin.child import free_port

    store = {"backend": "tcp", "port": free_port(), "namespace": "killed-planner"}
    cfg, cm, lens, data = make(store=store, loader={"planners": 1, "plan_timeout_s": 120})
    host, other = (
        DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=r, seed=7) for r in (0, 1)
    )
    alone = DynLoader(data, lengths=lens, config=make()[0], cost_model=cm, layout=RankLayout(2), column=1, seed=7)
    try:
        _kill_first_planner(host)
        t0 = time.monotonic()
        with caplog.at_level("WARNING"):
            step = next(iter(host if rank == "host" else other))
        assert time.monotonic() - t0 < 3.0
        assert "killed by signal SIGKILL" in caplog.text
        if rank == "other":
            assert step.digest == next(iter(alone)).digest  # what a rank planning alone plans
    finally:
        other.close()
        host.close()


def test_a_crashed_planner_is_reported_with_its_stderr():
    import time

    from dyn_plugin.runtime.planner_pool import PlannerPool

    reports = []
    pool = PlannerPool(
        "{}",
        '{"backend": "tcp", "port": 1, "namespace": "x"}',
        num_planners=1,
        prefetch=1,
        start=0,
        world_size=2,
        on_failure=reports.append,
    )
    try:
        deadline = time.monotonic() + 30
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reports) == 1  # one failure, reported once
        assert "planner process 0" in reports[0] and "exited with code 1" in reports[0]
        assert "KeyError: 'config'" in reports[0]  # the traceback's last line, from its stderr
    finally:
        pool.close()


def test_each_run_gets_its_own_namespace():
    cfg, cm, lens, data = make(store={"backend": "tcp", "port": 0})
    spaces = []
    for _ in range(2):
        loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=7)
        spaces.append(loader._store.namespace)
        loader.close()
    assert spaces[0] != spaces[1] and all(s.startswith("run-") for s in spaces)


def test_ranks_without_a_process_group_need_a_namespace():
    cfg, cm, lens, data = make(store={"backend": "tcp", "port": 0})
    with pytest.raises(ValueError, match="store.namespace is unset.*init_process_group"):
        DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(2), column=0, seed=7)


def _redis_loader(server, monkeypatch, **store):
    import time

    monkeypatch.setenv("DYN_PLUGIN_REDIS_PASSWORD", server.password)
    store = {"backend": "redis", "url": server.url, "namespace": f"loader-{time.time_ns()}", **store}
    cfg, cm, lens, data = make(store=store, loader={"planners": 1, "prefetch": 4, "plan_timeout_s": 30})
    return DynLoader(data, lengths=lens, config=cfg, cost_model=cm, seed=7), make()[0], cm, lens, data


def test_plans_that_expired_in_the_store_are_planned_again_locally(redis_server, monkeypatch, caplog):
    import logging
    import time

    loader, plain, cm, lens, data = _redis_loader(redis_server, monkeypatch, ttl_s=0.6)
    expected = [s.sample_ids for s in DynLoader(data, lengths=lens, config=plain, cost_model=cm, seed=7)]
    try:
        steps = iter(loader)
        got = [next(steps).sample_ids]
        time.sleep(1.5)  # a pause in training: every plan fetched ahead expires
        with caplog.at_level(logging.WARNING, logger="dyn_plugin.runtime.plan_source"):
            got += [s.sample_ids for s in steps]
    finally:
        loader.close()
    assert got == expected
    assert "was published but is gone: it expired (store.ttl_s = 0.6 s)" in caplog.text


def test_close_never_raises_on_an_unreachable_store(fresh_redis_server, monkeypatch):
    import time

    loader, *_ = _redis_loader(fresh_redis_server, monkeypatch, timeout_s=1.0)
    next(iter(loader))
    planners = loader._pool.procs
    fresh_redis_server.kill()
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 10
    assert all(p.poll() is not None for p in planners)


def test_the_redis_password_never_reaches_the_planners_command_line(redis_server, monkeypatch):
    from pathlib import Path

    url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    loader, *_ = _redis_loader(redis_server, monkeypatch, url=url)
    monkeypatch.delenv("DYN_PLUGIN_REDIS_PASSWORD")  # the URL's password is the only one
    try:
        next(iter(loader))  # the planners connected, so they got the password
        for p in loader._pool.procs:
            argv = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
            assert b"dyn_plugin.runtime.planner_worker" in argv
            assert not any(redis_server.password.encode() in arg for arg in argv), argv
        files = Path(loader._pool._dir).iterdir()
        assert not any(redis_server.password in f.read_text() for f in files if f.suffix == ".json")
    finally:
        loader.close()
