"""One gloo rank of the sequence-parallel attention tests (run as a script, env rendezvous).

Usage: sp_attention_worker.py CHECK[,CHECK...]; checks: attention, groups, rng, llama, memory. Every rank
builds the same full inputs from one seed, runs its shard and compares with the single-process
result it computes itself; a failed check raises, so the exit code says it all.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

from dyn_plugin.models import sequence_parallel as sp
from dyn_plugin.models.varlen_attention import document_attention, varlen_attention
from dyn_plugin.runtime.sequence_groups import SequenceGroups, group_rng, group_seed

TOL = 1e-6


def close(name, got, want, tol=TOL):
    """Within ``tol`` relative to the largest reference value (fp32 sums in another order)."""
    got, want = got.detach(), want.detach()
    err, scale = float((got - want).abs().max()), max(1.0, float(want.abs().max()))
    assert err <= tol * scale, f"{name}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"


def packed_positions(docs_per_row, width):
    """Rows of documents, each row filled to ``width`` by one padding document."""
    rows = []
    for docs in docs_per_row:
        fill = width - sum(docs)
        rows.append(torch.cat([torch.arange(n) for n in docs + ([fill] if fill else [])]))
    return torch.stack(rows)


def check_attention_case(shard, heads, kv_heads, pos, kind, dtype, window=None, softcap=None, dv=8, sinks=False):
    """fp64 shows the algorithm exact (1e-12); fp32 stays within 1e-6 of it, as fp32 SDPA does.
    ``window`` / ``softcap``: the model's sliding window and attention-logit soft-cap (Mistral,
    Gemma2), as transformers' attention modules pass them to the kernel; ``dv``: the values' width
    (below the queries' and keys' 8: multi-head latent attention, DeepSeek-V3); ``sinks``: one logit
    per head beside the keys' (GPT-OSS), whose gradient sums over every rank's queries."""
    rank, k = shard.index, shard.size
    rows, width = pos.shape
    n = width // k
    gen = torch.Generator().manual_seed(1234)
    q, key = (torch.randn(rows, h, width, 8, generator=gen, dtype=torch.float64) for h in (heads, kv_heads))
    v = torch.randn(rows, kv_heads, width, dv, generator=gen, dtype=torch.float64)
    dout = torch.randn(rows, width, heads, dv, generator=gen, dtype=torch.float64)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64) if sinks else None
    # single-process reference: per-document attention over the whole rows, in fp64
    ref = [t.clone().requires_grad_() for t in (q, key, v)]
    ref_sink = sink.clone().requires_grad_() if sinks else None
    ref_out = document_attention(*ref, pos, 0.0, None, window=window, softcap=softcap, sinks=ref_sink)
    (ref_out * dout).sum().backward()
    mine = slice(rank * n, (rank + 1) * n)
    local = [t[:, :, mine].to(dtype).requires_grad_() for t in (q, key, v)]
    local_sink = sink.to(dtype).requires_grad_() if sinks else None
    module = torch.nn.Module().eval()
    with sp.sharded(shard):  # forward and backward, as the runtime does
        out = varlen_attention(
            module, *local, None, position_ids=pos[:, mine], sliding_window=window, softcap=softcap, s_aux=local_sink
        )[0]
        (out * dout[:, mine].to(dtype)).sum().backward()
    label = f"{kind} k={k} heads={heads}/{kv_heads} {dtype} window={window} softcap={softcap} dv={dv} sinks={sinks}"
    tol = TOL if dtype == torch.float32 else 1e-12
    close(f"{label} out", out.double(), ref_out[:, mine], tol)
    for name, got, want in zip("qkv", local, ref):
        close(f"{label} d{name}", got.grad.double(), want.grad[:, :, mine], tol)
    if sinks:
        summed = local_sink.grad.double().clone()
        dist.all_reduce(summed, group=shard.group)
        close(f"{label} dsinks", summed, ref_sink.grad, tol)


def attention(group, size, index):
    width = 24  # 12 or 6 per rank; the 9- and 13-token documents cross shard boundaries
    layouts = {
        "packed": packed_positions([[5, 9, 7], [13, 8]], width),  # padding documents of 3 at the end
        "padded": torch.arange(width).expand(2, width),  # right-padded rows: one causal document each
    }
    for pos in layouts.values():
        for heads, kv_heads in ((4, 4), (4, 2)):
            for kind in ("ulysses", "ring"):
                shard = sp.SequenceShard(group, size, index, kind, pos)
                if kind == "ulysses" and kv_heads % size:
                    try:
                        check_attention_case(shard, heads, kv_heads, pos, kind, torch.float32)
                    except ValueError as exc:
                        assert "must both divide by the group size" in str(exc) and "'ring'" in str(exc), exc
                    else:
                        raise AssertionError("Ulysses with indivisible key/value heads was not refused")
                    continue
                for dtype in (torch.float64, torch.float32):
                    check_attention_case(shard, heads, kv_heads, pos, kind, dtype)
                # windows shorter than a shard and than the documents, and soft-capped scores (at a cap
                # the scores reach: the inputs are N(0, 1) over 8 dimensions)
                for window, softcap in ((4, None), (None, 1.0), (7, 0.5)):
                    check_attention_case(shard, heads, kv_heads, pos, kind, torch.float64, window, softcap)
                # values narrower than keys (DeepSeek-V3's latent attention) and attention sinks (GPT-OSS)
                check_attention_case(shard, heads, kv_heads, pos, kind, torch.float64, dv=6)
                check_attention_case(shard, heads, kv_heads, pos, kind, torch.float64, 4, None, sinks=True)
                check_attention_case(shard, heads, kv_heads, pos, kind, torch.float32, None, 1.0, dv=6, sinks=True)
    assert sp.current() is None
    # dropout: Ulysses runs it in the per-document kernel, ring refuses it
    pos = layouts["packed"]
    q = torch.randn(2, 4, width // size, 8)
    train = torch.nn.Module().train()
    with sp.sharded(sp.SequenceShard(group, size, index, "ulysses", pos)):
        assert varlen_attention(train, q, q, q, None, dropout=0.5)[0].shape == (2, width // size, 4, 8)
    with sp.sharded(sp.SequenceShard(group, size, index, "ring", pos)):
        try:
            varlen_attention(train, q, q, q, None, dropout=0.5)
        except ValueError as exc:
            assert "ring attention has no attention dropout" in str(exc), exc
        else:
            raise AssertionError("ring attention accepted dropout")
    try:
        sp.SequenceShard(group, size, (index + 1) % size, "ring", pos)
    except ValueError as exc:
        assert "SequenceShard.index" in str(exc), exc
    else:
        raise AssertionError("a wrong shard index was accepted")


def check_attention():
    from dyn_plugin.cost import sequence_parallel as priced

    rank, world = dist.get_rank(), dist.get_world_size()
    attention(dist.group.WORLD, world, rank)
    whole = priced.RING_QUERY_CHUNK
    priced.RING_QUERY_CHUNK = 5  # the ring's blocks of 12 or 6 queries in chunks, the last one shorter
    try:
        attention(dist.group.WORLD, world, rank)
    finally:
        priced.RING_QUERY_CHUNK = whole
    if world == 4:  # two pairs at once: group-relative peers, not global ranks
        pairs = SequenceGroups(columns=4, stages=1, sizes=[2])
        attention(pairs.group(0, rank // 2 * 2, 2), 2, rank % 2)


def members(group):
    return sorted(dist.get_process_group_ranks(group))


def check_groups():
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 3:
        groups = SequenceGroups(columns=3, stages=1, sizes=[1, 2, 4])
        assert groups.blocks() == [(0, 0, 2)], groups.blocks()
        assert members(groups.group(0, 0, 2)) == [0, 1]
        for bad in ((0, 1, 2), (0, 2, 2), (0, 0, 4)):
            try:
                groups.group(*bad)
            except ValueError as exc:
                assert "no sequence-parallel group" in str(exc), exc
            else:
                raise AssertionError(f"group {bad} should not exist")
        if rank < 2:  # the pair works as a group
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t, group=groups.group(0, 0, 2))
            assert float(t) == 3.0
        return
    assert world == 4
    flat = SequenceGroups(columns=4, stages=1, sizes=[2, 4])
    assert flat.blocks() == [(0, 0, 2), (0, 2, 2), (0, 0, 4)], flat.blocks()
    assert [members(flat.group(*b)) for b in flat.blocks()] == [[0, 1], [2, 3], [0, 1, 2, 3]]
    grid = SequenceGroups(columns=2, stages=2, sizes=[2, 4])  # 4 exceeds the columns: skipped
    assert grid.blocks() == [(0, 0, 2), (1, 0, 2)], grid.blocks()
    assert members(grid.group(1, 0, 2)) == [2, 3]  # stage-major: stage 1 holds ranks 2, 3
    stage = rank // 2
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=grid.group(stage, 0, 2))
    assert float(t) == (1.0 if stage == 0 else 5.0), float(t)


def check_rng():
    world = dist.get_world_size()
    seeds = [group_seed(7, 0, 3, mb, 0) for mb in range(3)]
    assert len(set(seeds)) == 3 and seeds == [group_seed(7, 0, 3, mb, 0) for mb in range(3)]
    assert group_seed(7, 0, 3, 0, 0, stage=1) not in seeds  # pipeline stages draw their own masks
    torch.manual_seed(100 + dist.get_rank())  # ranks' own streams differ
    before = torch.get_rng_state()
    with group_rng(seeds[0]):
        mask = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(torch.get_rng_state(), before), "the rank's own stream was not restored"
    with group_rng(seeds[0]):
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), mask), "not reproducible"
    with group_rng(seeds[1]):
        assert not torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), mask), "micro-batches share masks"
    gathered = [torch.empty_like(mask) for _ in range(world)]
    dist.all_gather(gathered, mask)
    assert all(torch.equal(g, mask) for g in gathered), "ranks of a group drew different masks"


def check_llama():
    """A tiny Llama split over 2 ranks (labels shifted before sharding, summed loss, recompute on)
    equals the unsharded model."""
    from dyn_plugin.models.hf import PRESETS, build_causal_lm
    from dyn_plugin.models.recompute import RecomputeSwitch

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = build_causal_lm(PRESETS["tiny-llama"]).train()
    pos = packed_positions([[20, 25]], 48)  # padding document of 3 at the end
    ids = torch.randint(0, 8192, pos.shape, generator=torch.Generator().manual_seed(5))
    shift = torch.full_like(ids, -100)  # the token each position predicts; none across documents
    shift[:, :-1] = ids[:, 1:].masked_fill(pos[:, 1:] == 0, -100)
    shift[:, 45:] = -100  # the padding document is not scored
    ref_loss = reference(input_ids=ids, position_ids=pos, labels=shift, shift_labels=shift, num_items_in_batch=1).loss
    ref_loss.backward()
    n = pos.shape[1] // world
    mine = slice(rank * n, (rank + 1) * n)
    for kind in ("ulysses", "ring"):
        model = copy.deepcopy(reference)
        model.zero_grad()
        RecomputeSwitch(model).set("full")  # backward re-runs attention: it needs the group again
        with sp.sharded(sp.SequenceShard(dist.group.WORLD, world, rank, kind, pos)):
            loss = model(
                input_ids=ids[:, mine],
                position_ids=pos[:, mine],
                labels=shift[:, mine],
                shift_labels=shift[:, mine],
                num_items_in_batch=1,
            ).loss
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        close(f"llama {kind} loss", total, ref_loss)
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            close(f"llama {kind} grad {name}", g, ref.grad)


def _live(fn):
    """(kept after forward, peak above the start) bytes of fn's forward, then its backward."""
    from dyn_plugin.profiling.memory import LiveMemory

    with LiveMemory() as mem:
        out = fn()
        kept = mem.live - out.untyped_storage().nbytes()  # the output is the next op's input, not kept here
        out.float().sum().backward()
        return kept, mem.peak


def check_memory():
    """The ring's buffers, measured op by op, against what the planners price per layer
    (``SequenceParallelCost.layer``): never under, and at most 1.3x over (measured 1.16x and
    1.14x on the two ranks, which compute one block and two). bf16 inputs, as training runs; the
    ring computes in fp32. (Ulysses' buffers are copies the size of its inputs; on gloo its
    all-to-all work objects keep them alive for a varying time, so the measurement is not stable.)"""
    from dyn_plugin.cost.model import features
    from dyn_plugin.cost.sequence_parallel import SequenceParallelCost

    rank, k = dist.get_rank(), dist.get_world_size()
    heads, d, n = 8, 16, 1024  # blocks of 1024 queries, in chunks of RING_QUERY_CHUNK
    width = k * n
    pos = packed_positions([[1200, width - 1200]], width)
    f = features([1200, width - 1200], "packed", 1, k)
    gen = torch.Generator().manual_seed(3)
    q, key, v = (torch.randn(1, heads, n, d, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    priced = SequenceParallelCost().layer(
        k,
        "ring",
        "none",
        hidden=heads * d,
        kv_hidden=heads * d,
        heads=heads,
        act_bytes=2,
        link_gb_per_s=1,
        latency_us=1,
    )
    with sp.sharded(sp.SequenceShard(dist.group.WORLD, k, rank, "ring", pos)):
        mine = pos[:, rank * n : (rank + 1) * n]
        kept, peak = _live(lambda: varlen_attention(torch.nn.Module().eval(), q, key, v, None, position_ids=mine)[0])
    want_kept, want_live = priced.stored_bytes(f.slots, f.attn), priced.transient_bytes(f.slots, f.attn)
    label = f"ring: kept {kept} (priced {want_kept:.0f}), transient {peak - kept} (priced {want_live:.0f})"
    print(f"rank {rank} {label}", flush=True)
    assert kept <= want_kept and peak - kept <= want_live, label
    assert want_kept + want_live <= 1.3 * peak, label


def main():
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    for check in sys.argv[1].split(","):
        globals()[f"check_{check}"]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
