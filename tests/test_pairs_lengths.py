"""Lengths as (input, target) pairs: validation, files, the bundled ``tasks`` mix, per-side waste, CLI."""

import json
import re
import sys

import numpy as np
import pytest

from dyn_plugin.cli import main
from dyn_plugin.commands import analyze as analyze_cmd
from dyn_plugin.commands import lengths as lengths_cmd
from dyn_plugin.lengths import corpus as C
from dyn_plugin.lengths import io as L
from dyn_plugin.lengths import pairs as P
from dyn_plugin.lengths import tasks as TK
from dyn_plugin.lengths.packing import pack_pair_rows
from dyn_plugin.lengths.pair_analysis import analyze_pairs, format_pair_analysis

MANIFEST = json.loads((L.BUNDLED_DIR / "manifest.json").read_text())

# input, target: long -> short, short -> long, short -> short, medium -> medium
TINY = [[3, 1], [1, 3], [1, 1], [2, 2]]


# --- validate / load / save ------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        (np.ones((4, 3), dtype=np.int64), r"pairs must have shape \[N, 2\] .* got an array of shape \[4, 3\]"),
        (np.ones(4, dtype=np.int64), r"pairs must have shape \[N, 2\] .* shape \[4\]"),
        ([[5, 3], [2, 0]], r"pairs\[1\]\[1\] \(target\) = 0: every sample needs at least one token"),
        ([[0, 3]], r"pairs\[0\]\[0\] \(input\) = 0: every sample needs at least one token"),
        ([[5, 3], [-2, 4]], r"pairs\[1\]\[0\] \(input\) = -2"),
        ([[5, 1.5]], r"pairs\[0\]\[1\] \(target\) = 1.5: target lengths must be integers"),
        ([[5, "7"]], r"pairs\[0\]\[1\] \(target\) = '7': target lengths must be integers"),
        ([[5, 3], [4]], r"pairs\[1\] = \[4\]: each pair is \[input length, target length\]"),
        ([[5, 3], 4], r"pairs\[1\] = 4: each pair is"),
        ([], r"pairs is empty"),
        ([[1, 2**41]], r"pairs\[0\]\[1\] \(target\) = 2199023255552: longer than any sequence"),
    ],
)
def test_bad_pairs_name_the_entry(tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        P.validate_pairs(values)
    path = tmp_path / "bad.npy" if isinstance(values, np.ndarray) else tmp_path / "bad.json"
    if isinstance(values, np.ndarray):
        np.save(path, values)
    else:
        path.write_text(json.dumps({"pairs": values}))
    with pytest.raises(ValueError, match=rf"pairs file {path}: {message}"):
        P.load_pairs(path)


def test_valid_pairs_are_int64_n_by_2():
    got = P.validate_pairs(np.array([[2.0, 3.0], [1.0, 7.0]]))
    assert got.dtype == np.int64 and got.tolist() == [[2, 3], [1, 7]]
    assert P.validate_pairs([(4, 1)]).tolist() == [[4, 1]]


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    path = P.save_pairs(TINY, tmp_path / f"p{suffix}")
    got = P.load_pairs(path)
    assert got.dtype == np.int64 and got.shape == (4, 2)
    np.testing.assert_array_equal(got, TINY)
    if suffix == ".json":
        assert json.loads(path.read_text()) == {"pairs": TINY}
    else:
        assert np.load(path).shape == (4, 2)


def test_load_plain_json_list_and_refusals(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[[7, 8], [9, 1]]")
    assert P.load_pairs(path).tolist() == [[7, 8], [9, 1]]
    path.write_text('{"lengths": [1, 2]}')
    with pytest.raises(ValueError, match=r'a JSON object needs a "pairs" list, found keys \[\'lengths\'\]'):
        P.load_pairs(path)
    path.write_text('"x"')
    with pytest.raises(ValueError, match=r"expected a JSON list of \[input, target\] pairs or an object"):
        P.load_pairs(path)
    with pytest.raises(FileNotFoundError, match=r"pairs file .*missing.npy does not exist"):
        P.load_pairs(tmp_path / "missing.npy")
    with pytest.raises(ValueError, match=r"'nope' is neither a bundled distribution \(tasks\)"):
        P.load_pairs("nope")
    with pytest.raises(ValueError, match=r"cannot save pairs to .* must end in \.npy or \.json"):
        P.save_pairs(TINY, tmp_path / "p.csv")


def test_lengths_loader_points_pairs_to_their_own():
    with pytest.raises(ValueError, match=r"1-D .* shape \(4, 2\) \(input/target pairs are read with --pairs\)"):
        L.validate_lengths(np.array(TINY))


def test_summarize_pairs_by_hand():
    s = P.summarize_pairs(TINY)
    assert s["count"] == 4
    assert s["input"] == L.summarize([3, 1, 1, 2]) and s["target"] == L.summarize([1, 3, 1, 2])
    # deviations from the mean 1.75: x (1.25, -.75, -.75, .25), y (-.75, 1.25, -.75, .25)
    assert s["correlation"] == pytest.approx(-1.25 / 2.75)
    assert s["target_longer"] == 0.25
    assert P.summarize_pairs([[1, 5], [1, 6]])["correlation"] == 0.0  # a constant side


# --- packing and waste, by hand --------------------------------------------------------------


def test_pair_packing_by_hand():
    # shares of a 4 + 4 row: 3/4, 3/4, 1/4, 2/4 -> order 0, 1, 3, 2; [1, 3] fills row 0 beside [3, 1]
    assert pack_pair_rows(np.array(TINY), 4, 4) == [[0, 1], [3, 2]]
    # rows of 4 + 3: [1, 3] fills a target row (share 1) and goes first, alone; [3, 1] opens row 1,
    # [2, 2] fits neither (input 1 left in row 1), [1, 1] joins row 1
    assert pack_pair_rows(np.array(TINY), 4, 3) == [[1], [0, 2], [3]]
    with pytest.raises(ValueError, match=r"pair 1 has target length 3, longer than the packing row \(2\)"):
        pack_pair_rows(np.array(TINY), 4, 2)


def test_pair_packing_never_overfills_a_side():
    rng = np.random.default_rng(3)
    pairs = np.stack([rng.integers(1, 100, 2000), rng.integers(1, 300, 2000)], axis=1)
    rows = pack_pair_rows(pairs, 128, 512)
    assert sorted(i for r in rows for i in r) == list(range(2000))
    for r in rows:
        assert pairs[r, 0].sum() <= 128 and pairs[r, 1].sum() <= 512


def test_waste_by_hand():
    a = analyze_pairs(TINY, batch_size=4, max_input=4, max_target=4)
    pad, pack = a.method("pad-random"), a.method("pack")
    # one micro-batch of 4 padded to input 3 and target 3: 12 slots a side, 7 real tokens each
    assert (pad.units, pad.input.token_slots, pad.input.real_tokens) == (1, 12, 7)
    assert pad.input.padding_fraction == pytest.approx(5 / 12)
    assert pad.target.padding_fraction == pytest.approx(5 / 12)
    assert pad.padding_fraction == pytest.approx(10 / 24)
    # two rows of 4 + 4: 8 slots a side, 7 real tokens each
    assert (pack.units, pack.input.token_slots, pack.target.token_slots) == (2, 8, 8)
    assert pack.input.padding_fraction == pytest.approx(1 / 8) and pack.target.padding_fraction == pytest.approx(1 / 8)
    # micro-batches of one pair are never padded
    one = analyze_pairs(TINY, batch_size=1, max_input=4, max_target=4).method("pad-random")
    assert (one.units, one.input.padding_fraction, one.target.padding_fraction) == (4, 0.0, 0.0)


def test_truncation_per_side_and_defaults():
    a = analyze_pairs(TINY, batch_size=4, max_input=2, max_target=4)
    assert (a.input.max_len, a.input.max_len_is_default, a.input.truncated) == (2, False, 1)
    assert a.input.truncated_token_fraction == pytest.approx(1 / 7)  # [3, 1] cut to [2, 1]
    assert a.target.truncated == 0
    # the padded micro-batch is now input 2 wide: 8 slots for 6 tokens
    assert a.method("pad-random").input.padding_fraction == pytest.approx(2 / 8)
    d = analyze_pairs([[100, 3], [5, 1000]])
    assert (d.input.max_len, d.target.max_len) == (128, 1024) and d.input.max_len_is_default
    with pytest.raises(ValueError, match="max_target must be at least 1"):
        analyze_pairs(TINY, max_target=0)


def test_padded_batches_keep_pairs_whole():
    pairs = np.stack([np.arange(1, 101), np.arange(1, 101)[::-1]], axis=1)
    a = analyze_pairs(pairs, batch_size=7, seed=5, max_input=128, max_target=128)
    m = a.method("pad-random")
    assert m.units == 15 and m.input.real_tokens == m.target.real_tokens == 5050
    assert "pad-random" in format_pair_analysis(a, "x") and json.dumps(a.to_dict())


# --- the tasks and the bundled distribution --------------------------------------------------

MAN_PAGE = """.TH LS 1
.SH NAME
ls \\- list directory contents
.SH SYNOPSIS
.B ls
[OPTION]...
.SH DESCRIPTION
List information about the FILEs.
.SS Sub
EINVAL
.SH "SEE ALSO"
dir(1)
"""

TOPIC = """The "pass" statement
********************

   pass_stmt ::= "pass"

A null operation.

Notes
=====

Nothing happens.
"""


def test_sections_of_man_pages_and_topics():
    sections = TK.man_sections(MAN_PAGE)
    assert sections["NAME"] == "ls - list directory contents"
    assert sections["DESCRIPTION"] == "List information about the FILEs.\nSub\nEINVAL"
    assert sections["SEE ALSO"] == "dir(1)"
    assert TK.topic_sections(TOPIC) == [
        ('The "pass" statement', 'pass_stmt ::= "pass"\n\nA null operation.'),
        ("Notes", "Nothing happens."),
    ]


SOURCE = '''def f(a,
      b=1):
    """Add things.

    More detail.
    """
    return a + b


class K:
    """A class."""


def bare(self):
    """Only a docstring."""
'''


def test_task_pools_cut_each_task():
    f = C.parse_source("pkg/mod.py", SOURCE)
    assert f.definitions[0].code == "def f(a,\n      b=1):\n    return a + b\n"
    pools = TK.task_pools([f], [TOPIC], [MAN_PAGE])
    assert set(pools) == set(TK.TASKS) == set(TK.TASK_WEIGHTS)
    # `bare` has no code beyond its def line, the class is no function: one function each
    assert pools["summarize"] == [("summarize: def f(a,\n      b=1):\n    return a + b\n", "Add things.")]
    assert pools["generate"] == [
        ("generate: def f(a,\n      b=1):\nAdd things.", "def f(a,\n      b=1):\n    return a + b\n")
    ]
    assert ("signature: A class.", "class K:") in pools["signature"] and len(pools["signature"]) == 3
    assert pools["explain"][0] == ("explain: What does pkg.mod.f do?", "Add things.")
    assert pools["describe"] == [
        ("describe: ls - list directory contents", "List information about the FILEs.\nSub\nEINVAL")
    ]
    assert pools["topic_qa"][1] == ("question: Notes", "Nothing happens.")


def test_sampling_follows_the_task_weights():
    pools = {task: [(f"{task}-in{i}", f"{task}-out{i}") for i in range(3000)] for task in TK.TASK_WEIGHTS}
    a = C.sample_mixture(pools, 3000, 1, TK.TASK_WEIGHTS)
    assert a == C.sample_mixture(pools, 3000, 1, TK.TASK_WEIGHTS)
    for task, weight in TK.TASK_WEIGHTS.items():
        assert abs(sum(t == task for t, _ in a) / 3000 - weight) < 0.03
    assert sum(TK.TASK_WEIGHTS.values()) == pytest.approx(1.0)


def test_bundled_tasks_loads_and_matches_manifest():
    pairs = P.load_pairs("tasks")
    assert pairs.dtype == np.int64 and pairs.shape == (TK.TASKS_SIZE, 2)
    entry = MANIFEST["pair_distributions"]["tasks"]
    assert P.summarize_pairs(pairs) == entry["summary"]
    assert entry["shape"] == [TK.TASKS_SIZE, 2] and entry["columns"] == ["input", "target"]
    assert sum(entry["sources"].values()) == TK.TASKS_SIZE and set(entry["sources"]) == set(TK.TASKS)
    assert MANIFEST["tasks"]["weights"] == TK.TASK_WEIGHTS and MANIFEST["tasks"]["seed"] == TK.TASKS_SEED
    assert (L.BUNDLED_DIR / "tasks.npy").stat().st_size < 100_000


def test_bundled_tasks_mix_short_to_long_and_long_to_short():
    pairs = P.load_pairs("tasks")
    x, y = pairs[:, 0], pairs[:, 1]
    assert (y >= 4 * x).mean() > 0.15  # generation, descriptions, topic answers
    assert (x >= 4 * y).mean() > 0.15  # summaries, signatures
    assert (y >= 1024).sum() >= 50 and (x >= 256).sum() >= 50  # long tails on both sides
    s = P.summarize_pairs(pairs)
    assert s["log_correlation"] < 0  # the two sides do not grow together
    assert 0.3 < s["target_longer"] < 0.7


def test_command_names_match():
    assert lengths_cmd.PAIR_NAMES == tuple(TK.PAIR_DISTRIBUTIONS)
    assert not set(TK.PAIR_DISTRIBUTIONS) & set(C.DISTRIBUTIONS)


@pytest.mark.slow
def test_bundled_tasks_regenerate_exactly():
    """Where the bundled copies were made (same Python, same tokenizer), the pairs recompute to the same array."""
    import platform

    from dyn_plugin.lengths.tokenizer import get_tokenizer, tokenizer_digest

    if (
        platform.python_version() != MANIFEST["python"]
        or tokenizer_digest(get_tokenizer()) != MANIFEST["tokenizer"]["sha256_16"]
    ):
        pytest.skip(f"bundled on Python {MANIFEST['python']}; this is {sys.version.split()[0]}")
    np.testing.assert_array_equal(P.compute_pairs("tasks", progress=False), P.load_pairs("tasks"))


# --- commands --------------------------------------------------------------------------------


def test_analyze_pairs_table_and_json(tmp_path, capsys, run_command):
    path = P.save_pairs(TINY, tmp_path / "p.npy")
    args = ["--pairs", str(path), "--batch-size", "4", "--max-input", "4", "--max-target", "4"]
    assert run_command(analyze_cmd, args) == 0
    out = capsys.readouterr().out
    assert "input pad" in out and "41.7%" in out and "12.5%" in out
    assert run_command(analyze_cmd, ["tasks", "--json"]) == 0  # a bundled pair name needs no --pairs
    result = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in result["methods"]] == ["pad-random", "pack"]
    assert result["name"] == "tasks" and result["summary"] == MANIFEST["pair_distributions"]["tasks"]["summary"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["analyze", "--pairs", "{t}/three.npy"], r"pairs file .*three.npy: pairs must have shape \[N, 2\]"),
        (["analyze", "--pairs", "{t}/zero.json"], r"zero.json: pairs\[1\]\[0\] \(input\) = 0: every sample"),
        (["analyze", "--pairs", "{t}/missing.npy"], r"pairs file .*missing.npy does not exist"),
        (["analyze", "--pairs", "tasks", "--dp", "4"], r"--dp apply to single lengths only"),
        (["analyze", "code", "--max-target", "64"], r"--max-target apply to \(input, target\) pairs only"),
        (["analyze", "code", "--pairs", "tasks"], r"give FILE or --pairs, not both"),
        (["analyze"], r"give a lengths FILE, or --pairs"),
        (["analyze", "{t}/two.npy"], r"1-D .* \(input/target pairs are read with --pairs\)"),
        (["lengths", "tasks", "--bundled", "--out", "{t}/x.csv"], r"must end in \.npy or \.json"),
    ],
)
def test_bad_pair_input_is_one_line(tmp_path, capsys, argv, message):
    np.save(tmp_path / "three.npy", np.ones((5, 3), dtype=np.int64))
    np.save(tmp_path / "two.npy", np.ones((5, 2), dtype=np.int64))
    (tmp_path / "zero.json").write_text('{"pairs": [[1, 2], [0, 3]]}')
    assert main([a.format(t=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_lengths_command_writes_pairs(tmp_path, capsys, run_command):
    out = tmp_path / "tasks.json"
    assert run_command(lengths_cmd, ["tasks", "--bundled", "--out", str(out)]) == 0
    np.testing.assert_array_equal(P.load_pairs(out), P.load_pairs("tasks"))
    text = capsys.readouterr().out
    assert "input" in text and "target" in text and "p99" in text
    assert run_command(lengths_cmd, ["tasks", "--bundled", "--out", str(tmp_path / "t.npy"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["count"] == TK.TASKS_SIZE and summary["input"]["count"] == TK.TASKS_SIZE


def test_a_distribution_of_the_other_kind_is_refused_saying_which_kind_it_is():
    from dyn_plugin.lengths.io import load_lengths
    from dyn_plugin.lengths.pairs import load_pairs

    with pytest.raises(ValueError, match="'tasks' is a bundled distribution of \\(input, target\\) pairs"):
        load_lengths("tasks")
    with pytest.raises(ValueError, match="'code' is a bundled distribution of single sequence lengths.*tasks"):
        load_pairs("code")
