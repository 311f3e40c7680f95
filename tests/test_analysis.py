import json

import numpy as np
import pytest

from dyn_plugin.commands import analyze as analyze_cmd
from dyn_plugin.lengths import analysis as A
from dyn_plugin.lengths.io import load_lengths

H = 1  # with H=1 the FLOPs are small integers: f(s) = 24*s + 4*s^2


def f(s):
    return 24 * s + 4 * s * s


def test_sequence_flops_formula():
    assert A.sequence_flops([2], hidden=1).tolist() == [24 * 2 + 4 * 4]
    assert A.sequence_flops(4096, hidden=4096).item() == 24 * 4096**3 + 4 * 4096**3


def test_padding_hand_example():
    lengths = np.array([8, 4, 4])
    units = A.padded_units(A.pad_batches(lengths, 3, seed=0), H)
    assert units.slots.tolist() == [24]
    assert units.tokens.tolist() == [16]
    assert units.flops.tolist() == [3 * f(8)]
    assert units.useful.tolist() == [f(8) + 2 * f(4)]


def test_sorted_batches():
    batches = A.pad_batches(np.array([4, 8, 4]), 2, sort=True)
    assert [b.tolist() for b in batches] == [[8, 4], [4]]
    assert A.padded_units(batches, H).slots.tolist() == [16, 4]


def test_random_batches_are_seeded_and_complete():
    lengths = np.arange(1, 101)
    a = A.pad_batches(lengths, 8, seed=3)
    assert [x.tolist() for x in a] == [x.tolist() for x in A.pad_batches(lengths, 8, seed=3)]
    assert sorted(np.concatenate(a).tolist()) == lengths.tolist()
    assert [len(x) for x in a] == [8] * 12 + [4]


@pytest.mark.parametrize(
    "lengths, rows",
    [
        ([8, 4, 4], [[8], [4, 4]]),
        ([5, 4, 3, 2, 2], [[5, 3], [4, 2, 2]]),
        ([2, 6, 5, 3], [[6, 2], [5, 3]]),  # first fit, not best fit: 2 goes back to the first row
        ([1, 1, 1], [[1, 1, 1]]),
    ],
)
def test_ffd_rows(lengths, rows):
    assert [r.tolist() for r in A.pack_ffd(np.array(lengths), 8)] == rows


def test_ffd_rejects_too_long():
    with pytest.raises(ValueError, match=r"sequence 1 \(length 9\) is longer than the packing row \(8\)"):
        A.pack_ffd(np.array([3, 9]), 8)


def test_ffd_random_never_overfills():
    lengths = np.random.default_rng(0).integers(1, 100, size=500)
    rows = A.pack_ffd(lengths, 100)
    assert all(r.sum() <= 100 for r in rows)
    assert sorted(np.concatenate(rows).tolist()) == sorted(lengths.tolist())
    assert len(rows) <= int(np.ceil(11 / 9 * lengths.sum() / 100)) + 1  # FFD's guarantee


def test_packed_costs_hand_example():
    rows = A.pack_ffd(np.array([8, 4, 4]), 8)
    full = A.packed_units(rows, 8, H, varlen=False)
    varlen = A.packed_units(rows, 8, H, varlen=True)
    assert full.flops.tolist() == [f(8), f(8)]
    # The row [4, 4]: whole-row attention wastes 4*H*(8^2 - 4^2 - 4^2) on cross-document pairs.
    assert full.flops[1] - full.useful[1] == 4 * (64 - 32)
    assert varlen.flops.tolist() == [f(8), 24 * 8 + 4 * 32]
    np.testing.assert_array_equal(varlen.flops, varlen.useful)


def test_analyze_hand_example():
    a = A.analyze([8, 4, 4], batch_size=3, max_len=8, hidden=H, dp=1, token_budget=100)
    pad = a.method("pad-random")
    assert pad.padding_fraction == pytest.approx(8 / 24)
    assert pad.wasted_flop_fraction == pytest.approx((3 * f(8) - f(8) - 2 * f(4)) / (3 * f(8)))
    full = a.method("pack-full")
    assert (full.units, full.padding_fraction) == (2, 0.0)
    assert full.wasted_flop_fraction == pytest.approx(128 / (2 * f(8)))
    assert a.method("pack-varlen").wasted_flop_fraction == 0.0
    assert all(m.dp_imbalance == 0.0 for m in a.methods)  # one rank is never imbalanced
    assert a.truncated == 0


def test_dcp_imbalance():
    assert A.dcp_imbalance([1, 1, 2]) == pytest.approx((1 + 1 + 0) / 3 / 2)
    assert A.dcp_imbalance([5, 5]) == 0.0


def test_split_equal_tokens():
    tokens = np.array([5, 4, 3, 3, 1])
    rank_of = A.split_equal_tokens(tokens, 2)
    assert np.bincount(rank_of, weights=tokens).tolist() == [8, 8]


def test_dp_imbalance_from_quadratic_attention():
    # Two ranks with 8 tokens each: one long document vs. eight short ones.
    units = A.Units(
        tokens=np.array([8, 1, 1, 1, 1, 1, 1, 1, 1]),
        slots=np.array([8, 1, 1, 1, 1, 1, 1, 1, 1]),
        flops=A.sequence_flops([8, 1, 1, 1, 1, 1, 1, 1, 1], H),
        useful=A.sequence_flops([8, 1, 1, 1, 1, 1, 1, 1, 1], H),
    )
    t = np.array([f(8), 8 * f(1)])
    assert A.dp_imbalance(units, token_budget=16, dp=2) == pytest.approx(A.dcp_imbalance(t))


def test_default_max_len_and_truncation():
    lengths = np.array([100] * 98 + [1000] * 2)  # p99 = 1000
    assert A.default_max_len(lengths, token_budget=2**20, dp=8) == 1024
    assert A.default_max_len(lengths, token_budget=4096, dp=8) == 512  # capped at budget/dp
    a = A.analyze(lengths, max_len=512)
    assert (a.truncated, a.max_len, a.max_len_is_default) == (2, 512, False)
    assert a.truncated_token_fraction == pytest.approx(2 * 488 / lengths.sum())


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"dp": 0}, {"max_len": 0}, {"hidden": -1}])
def test_analyze_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="must be at least 1"):
        A.analyze([1, 2, 3], **kwargs)


def test_bundled_code_ordering():
    a = A.analyze(load_lengths("code"))
    waste = {m.name: m.wasted_flop_fraction for m in a.methods}
    assert waste["pack-varlen"] < waste["pad-sorted"] < waste["pack-full"] < waste["pad-random"]
    assert a.method("pack-varlen").dp_imbalance > a.method("pack-full").dp_imbalance
    json.dumps(a.to_dict())  # plain data, for benchmarks and --json


def test_command_plot_and_json(tmp_path, capsys, run_command):
    png = tmp_path / "out.png"
    assert run_command(analyze_cmd, ["code", "--plot", str(png), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in result["methods"]] == ["pad-random", "pad-sorted", "pack-full", "pack-varlen"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_command_table_and_errors(tmp_path, capsys, run_command):
    path = tmp_path / "l.json"
    path.write_text("[8, 4, 4]")
    assert run_command(analyze_cmd, [str(path), "--batch-size", "3", "--max-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "pad-random" in out and "33.3%" in out
    from dyn_plugin.cli import main

    assert main(["analyze", "nope"]) == 2  # one error line, exit 2 (the CLI prints what the command raises)
    assert "neither a bundled distribution" in capsys.readouterr().err
