"""Sequence parallelism's attention collectives per layer, figured by hand from the measured lines
(or from the link where nothing was measured)."""

import pytest

from dyn_plugin.cost.sequence_parallel import LayerComm, SequenceParallelCost, attention_kind

# a GQA layer: 1024 wide, keys and values 256 wide, 2-byte activations
SHAPE = dict(hidden=1024, kv_hidden=256, heads=16, act_bytes=2)
LINK = dict(link_gb_per_s=100.0, latency_us=10.0)


def layer(cost, k, kind, recompute):
    return cost.layer(k, kind, recompute, **SHAPE, **LINK)


def test_ulysses_from_the_link():
    # 4 all-to-alls of q, k, v, out: per token 2*1024 + 2*256 values of 2 bytes = 5120 bytes of buffer,
    # of which a rank sends 3/4 at 100 GB/s (1e-8 ms per byte); 10 us latency per all-to-all (one
    # grouped launch, as NCCL runs it, whatever the peers)
    got = layer(SequenceParallelCost(), 4, "ulysses", "none")
    assert got.forward == pytest.approx((4 * 0.01, 5120 * 0.75e-8), rel=1e-12)
    assert layer(SequenceParallelCost(), 32, "ulysses", "none").forward[0] == got.forward[0]
    assert got.backward == pytest.approx(got.forward, rel=1e-12)  # the mirrored all-to-alls
    # recompute re-runs the forward's all-to-alls in backward
    for recompute in ("selective", "full"):
        again = layer(SequenceParallelCost(), 4, "ulysses", recompute)
        assert again.forward == got.forward
        assert again.backward == pytest.approx((0.08, 2 * 5120 * 0.75e-8), rel=1e-12)


def test_ulysses_measured_on_two_ranks_scales_to_four():
    # measured among 2: ms = 0.1 + 1e-9 * buffer bytes, a rank sending 1/2 of its buffer; among 4 it sends 3/4
    cost = SequenceParallelCost(alltoall=(0.1, 1e-9), ranks=2)
    got = layer(cost, 4, "ulysses", "none")
    assert got.forward == pytest.approx((0.4, 1.5e-9 * 5120), rel=1e-12)
    assert got.forward_ms(8192) == pytest.approx(0.4 + 1.5e-9 * 5120 * 8192, rel=1e-12)
    assert layer(cost, 2, "ulysses", "none").forward == pytest.approx((0.4, 1e-9 * 5120), rel=1e-12)


def test_ring_measured_and_recompute():
    # k - 1 = 3 exchanges of a key and a value block: 2 * 256 * 2 = 1024 bytes per token each
    cost = SequenceParallelCost(p2p=(0.05, 2e-9))
    got = layer(cost, 4, "ring", "none")
    assert got.forward == pytest.approx((0.15, 3 * 2e-9 * 1024), rel=1e-12)
    # backward passes the blocks around again with their gradients: twice the forward
    assert got.backward == pytest.approx((0.3, 2 * 3 * 2e-9 * 1024), rel=1e-12)
    full = layer(cost, 4, "ring", "full")  # ... and re-runs the forward's exchanges first
    assert full.forward == got.forward
    assert full.backward == pytest.approx((0.45, 3 * 3 * 2e-9 * 1024), rel=1e-12)
    assert full.as_tuple() == (*full.forward, *full.backward, *full.stored, *full.transient)


def test_ring_from_the_link():
    got = layer(SequenceParallelCost(), 2, "ring", "selective")
    # one exchange: 10 us, 1024 bytes per token at 100 GB/s; backward 2 + 1 (rerun) exchanges
    assert got.forward == pytest.approx((0.01, 1024e-8), rel=1e-12)
    assert got.backward == pytest.approx((0.03, 3 * 1024e-8), rel=1e-12)


def test_one_rank_has_no_collectives_and_kinds_are_checked():
    assert layer(SequenceParallelCost(), 1, "ulysses", "full") == LayerComm()
    with pytest.raises(ValueError, match="'ulysses' or 'ring'"):
        layer(SequenceParallelCost(), 2, "zigzag", "none")
    # Ulysses splits heads: 8 query and 2 key/value heads split over 2, not over 4
    assert attention_kind(2, "auto", 8, 2) == "ulysses"
    assert attention_kind(4, "auto", 8, 2) == "ring"
    with pytest.raises(ValueError, match="do not divide by 4"):
        attention_kind(4, "ulysses", 8, 2)


def test_fit_and_dict_round_trip():
    cost = SequenceParallelCost.fit([(1e3, 0.201), (1e6, 1.2)], None, ranks=4)
    assert cost.alltoall == pytest.approx((0.2, 1e-6), rel=1e-9) and cost.p2p is None and cost.ranks == 4
    assert SequenceParallelCost.from_dict(cost.to_dict()) == cost
    assert SequenceParallelCost.from_dict(None) == SequenceParallelCost()
