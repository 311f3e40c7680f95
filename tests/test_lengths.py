import json

import numpy as np
import pytest

from dyn_plugin.commands import lengths as lengths_cmd
from dyn_plugin.lengths import corpus as C
from dyn_plugin.lengths import io as L
from dyn_plugin.lengths import tokenizer as T

MANIFEST = json.loads((L.BUNDLED_DIR / "manifest.json").read_text())


# --- bundled distributions -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(L.DISTRIBUTIONS))
def test_bundled_loads_and_matches_manifest(name):
    lengths = L.load_lengths(name)
    assert lengths.dtype == np.int64 and lengths.ndim == 1
    assert (lengths > 0).all()
    assert L.summarize(lengths) == MANIFEST["distributions"][name]["summary"]


def test_bundled_files_are_small():
    for name in L.DISTRIBUTIONS:
        assert (L.BUNDLED_DIR / f"{name}.npy").stat().st_size < 100_000


def test_code_stats_are_plausible():
    s = L.summarize(L.load_lengths("code"))
    assert s["count"] > 500
    assert 100 <= s["mean"] <= 10_000
    assert s["max"] > 20 * s["p50"]  # long tail


def test_prose_is_skewed():
    s = L.summarize(L.load_lengths("prose"))
    assert s["p50"] < s["mean"] < s["p99"]


def test_mixture_has_short_and_long():
    lengths = L.load_lengths("mixture")
    assert len(lengths) == C.MIXTURE_SIZE
    assert (lengths <= 64).mean() > 0.3
    assert (lengths >= 4096).sum() >= 50


def test_load_is_deterministic():
    np.testing.assert_array_equal(L.load_lengths("code"), L.load_lengths("code"))


def test_commands_name_list_matches():
    assert lengths_cmd.NAMES == tuple(L.DISTRIBUTIONS)


def test_code_documents_are_the_nonempty_files_in_order(tmp_path, monkeypatch):
    """On a stdlib this test writes (the machine's own differs between Python builds): one
    document per non-empty ``*.py`` file, in sorted path order."""
    files = {
        "b.py": "y = 2\n",
        "a.py": "x = 1\n",
        "pkg/__init__.py": "",
        "pkg/m.py": "def f():\n    pass\n",
        "test/t.py": "z = 3\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(C, "stdlib_dir", lambda: tmp_path)
    assert list(C.iter_documents("code")) == [files["a.py"], files["b.py"], files["pkg/m.py"]]


# --- tokenizing, on a tiny corpus so no real training happens here --------------------------

TINY = ["def f(x):\n    return x + 1\n", "The quick brown fox.", "import os\nprint(os.getcwd())\n"] * 3


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return T.train_tokenizer(TINY, vocab_size=300, min_frequency=1)


def test_training_is_deterministic(tiny_tokenizer):
    again = T.train_tokenizer(TINY, vocab_size=300, min_frequency=1)
    assert T.tokenizer_digest(again) == T.tokenizer_digest(tiny_tokenizer)


def test_token_lengths(tiny_tokenizer):
    texts = ["hello world", "def f(x):\n    return x\n", "é ☃ unseen bytes"]
    got = T.token_lengths(texts, tiny_tokenizer)
    assert got.dtype == np.int64
    assert (got > 0).all()
    assert got.tolist() == [len(tiny_tokenizer.encode(t).ids) for t in texts]
    np.testing.assert_array_equal(got, T.token_lengths(texts, tiny_tokenizer))
    # Byte-level: every text round-trips, nothing maps to an unknown token.
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(texts[2]).ids) == texts[2]


# --- sources ---------------------------------------------------------------------------------


def test_code_paths_skip_tests_and_site_packages(tmp_path):
    for rel in [
        "b.py",
        "a.py",
        "pkg/__init__.py",
        "test/t.py",
        "pkg/tests/t.py",
        "idlelib/idle_test/t.py",
        "site-packages/x.py",
        "notes.txt",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    got = [p.relative_to(tmp_path).as_posix() for p in C.code_paths(tmp_path)]
    assert got == ["a.py", "b.py", "pkg/__init__.py"]


def test_parse_source():
    src = '''"""Module doc."""

@decorator
def f(a,
      b=1):
    """Add things.

    More detail.
    """
    return a + b


class C:
    def g(self): return 1
'''
    f = C.parse_source("pkg/mod.py", src)
    assert f.module_docstring == "Module doc."
    names = [d.name for d in f.definitions]
    assert names == ["pkg.mod.f", "pkg.mod.C", "pkg.mod.C.g"]
    fn = f.definitions[0]
    assert fn.header == "def f(a,\n      b=1):\n"
    assert fn.docstring.startswith("Add things.")
    assert f.definitions[2].header.strip() == "def g(self): return 1"
    assert C.docstrings([f]) == ["Module doc.", fn.docstring]
    pools = C.mixture_pools([f], ["a topic"], [])
    assert pools["qa"] == ["Q: What does pkg.mod.f do?\nA: Add things."]
    assert pools["document"] == [src, "a topic"]


def test_parse_source_survives_syntax_errors():
    f = C.parse_source("bad.py", "def (:\n")
    assert f.definitions == () and f.text == "def (:\n"


def test_man_to_text():
    page = (
        '.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.de XX\nhidden\n..\n.sp\n.B bold\n'
    )
    assert C.man_to_text(page) == "LS 1\nNAME\nls - list directory contents\nbold"
    assert C.man_to_text(".so man1/other.1\n") is None


def test_sample_mixture_is_deterministic_and_weighted():
    pools = {task: [f"{task}{i}" for i in range(5000)] for task in C.MIXTURE_WEIGHTS}
    a = C.sample_mixture(pools, size=4000, seed=1)
    assert a == C.sample_mixture(pools, size=4000, seed=1)
    for task, weight in C.MIXTURE_WEIGHTS.items():
        picked = [text for t, text in a if t == task]
        assert abs(len(picked) / 4000 - weight) < 0.03
        assert len(set(picked)) == len(picked)  # no repeats while the pool is large enough


# --- load / save / validate -----------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    lengths = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64)
    path = L.save_lengths(lengths, tmp_path / f"x{suffix}")
    got = L.load_lengths(path)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, lengths)
    np.testing.assert_array_equal(L.load_lengths(str(path)), lengths)


def test_load_plain_json_list(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[7, 8, 9]")
    assert L.load_lengths(path).tolist() == [7, 8, 9]


@pytest.mark.parametrize(
    "values, message",
    [
        ([5, 3, 0], r"lengths\[2\] = 0: every sample needs at least one token"),
        ([5, -2, 3], r"lengths\[1\] = -2: every sample needs at least one token"),
        ([4, 1.5], r"lengths\[1\] = 1.5: lengths must be integers"),
        ([4, "7"], r"lengths\[1\] = '7': lengths must be integers"),
        ([4, None], r"lengths\[1\] = None: lengths must be integers"),
        ([[1, 2], [3, 4]], r"1-D .* shape \(2, 2\)"),
        ([], r"lengths is empty"),
    ],
)
def test_bad_lengths(tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        L.validate_lengths(values)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match=message):
        L.load_lengths(path)


def test_bad_npy(tmp_path):
    np.save(tmp_path / "z.npy", np.array([2, 0, 1]))
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        L.load_lengths(tmp_path / "z.npy")
    np.save(tmp_path / "f.npy", np.array([2.0, 2.5]))
    with pytest.raises(ValueError, match=r"lengths\[1\] = 2.5: lengths must be integers"):
        L.load_lengths(tmp_path / "f.npy")


def test_integral_floats_are_accepted():
    assert L.validate_lengths(np.array([2.0, 3.0])).tolist() == [2, 3]


def test_unknown_name_lists_valid_names():
    with pytest.raises(
        ValueError,
        match=r"'nope' is neither a bundled distribution \(code, prose, mixture\) "
        r"nor a path ending in \.npy or \.json",
    ):
        L.load_lengths("nope")


def test_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.npy or \.json"):
        L.save_lengths([1, 2], tmp_path / "x.csv")
    with pytest.raises(ValueError, match=r"nor a path ending in \.npy or \.json"):
        L.load_lengths(tmp_path / "x.csv")


def test_json_object_without_lengths(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"lens": [1]}')
    with pytest.raises(ValueError, match=r'needs a "lengths" list'):
        L.load_lengths(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        L.load_lengths(tmp_path / "missing.npy")


def test_summarize():
    s = L.summarize([1, 2, 3, 4, 100])
    assert (s["count"], s["total_tokens"], s["min"], s["max"]) == (5, 110, 1, 100)
    assert s["mean"] == 22.0 and s["p50"] == 3.0
    assert s["p90"] == pytest.approx(61.6) and s["p99"] == pytest.approx(96.16)


# --- command ---------------------------------------------------------------------------------


def test_command_bundled(tmp_path, capsys, run_command):
    out = tmp_path / "code.json"
    assert run_command(lengths_cmd, ["code", "--bundled", "--out", str(out)]) == 0
    np.testing.assert_array_equal(L.load_lengths(out), L.load_lengths("code"))
    text = capsys.readouterr().out
    assert "p99" in text and "code" in text

    assert run_command(lengths_cmd, ["code", "--bundled", "--out", str(tmp_path / "c.npy"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["count"] == len(L.load_lengths("code"))


def test_command_rejects_bad_out(tmp_path, capsys, run_command):
    from dyn_plugin.cli import main

    assert main(["lengths", "code", "--bundled", "--out", str(tmp_path / "x.csv")]) == 2
    assert "must end in .npy or .json" in capsys.readouterr().err
