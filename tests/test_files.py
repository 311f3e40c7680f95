"""Files the plugin writes are whole or absent; files it reads back are refused (or, for caches, rebuilt)
with their path named when damaged, never a KeyError (issue 25, part 4)."""

from __future__ import annotations

import ast
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from dyn_plugin import atomic
from dyn_plugin.atomic import atomic_path, check_sha256, payload_sha256, with_sha256, write_atomic, write_json_atomic
from dyn_plugin.cost.profile import load_profile, save_profile
from dyn_plugin.host import checkpoint
from dyn_plugin.lengths.io import load_lengths, save_lengths
from dyn_plugin.plan.sharding.shard_plan import Choice, ShardPlan, UnitPlan
from dyn_plugin.plan.steps.trace import write_chrome_trace
from dyn_plugin.plan.strategies.schemes import Scheme
from dyn_plugin.plan.strategies.strategy import Proposal, Strategy, cached_proposal
from test_profile import make_profile, synthetic_samples

ROOT = Path(__file__).resolve().parents[1]


def _leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tmp" in n)


# -- the writer --------------------------------------------------------------------------------------------


def test_write_atomic_writes_whole_files_with_the_usual_mode(tmp_path):
    path = tmp_path / "a.json"
    assert write_atomic(path, "first") == str(path)
    assert path.read_text() == "first" and _leftovers(tmp_path) == []
    with open(tmp_path / "plain", "w"):
        pass  # what open() gives under this umask
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    os.chmod(path, 0o640)  # a replaced file keeps its mode
    write_json_atomic(path, {"x": 1}, indent=1)
    assert json.loads(path.read_text()) == {"x": 1} and stat.S_IMODE(path.stat().st_mode) == 0o640
    write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "a.json", "x")


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    path = tmp_path / "plan.json"
    write_atomic(path, "old content")

    def crash(*_a, **_k):
        raise OSError("disk full")

    if where == "write":  # fails midway through the payload: half of it may be in the temporary file
        real = os.fdopen

        class Half:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[: len(data) // 2])
                raise OSError("disk full")

        monkeypatch.setattr(atomic.os, "fdopen", lambda fd, mode: Half(real(fd, mode)))
    else:
        monkeypatch.setattr(atomic.os, where, crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new content, longer than the old one")
    monkeypatch.undo()
    assert path.read_text() == "old content"
    assert _leftovers(tmp_path) == []


def test_atomic_path_keeps_the_suffix_and_cleans_up_after_a_failure(tmp_path):
    path = tmp_path / "plot.png"
    with atomic_path(path) as tmp:
        assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path) and tmp != str(path)
        with atomic_path(path) as other:  # two writers of one target never share a temporary file
            assert other != tmp
            Path(other).write_bytes(b"other")
        Path(tmp).write_bytes(b"png")
    assert path.read_bytes() == b"png" and _leftovers(tmp_path) == []
    with pytest.raises(RuntimeError, match="plot failed"):
        with atomic_path(path) as tmp:
            Path(tmp).write_bytes(b"half a p")
            raise RuntimeError("plot failed")
    assert path.read_bytes() == b"png" and _leftovers(tmp_path) == []


def test_a_symbolic_link_is_written_through(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "p.json"
    write_atomic(target, "old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_checksums_survive_any_serialization_and_catch_edits():
    doc = {"b": [1.5, 1e-300, None, "é"], "a": {"z": 1, "y": True}}
    sealed = with_sha256(doc)
    assert sealed["sha256"] == payload_sha256(doc) == payload_sha256(sealed)
    again = json.loads(json.dumps(sealed, indent=3))
    assert check_sha256(again, "the file") == doc
    with pytest.raises(ValueError, match="the file is corrupt: its sha256 checksum"):
        check_sha256({**again, "b": [1.5]}, "the file")
    with pytest.raises(ValueError, match="the file has no sha256 checksum"):
        check_sha256(doc, "the file", required=True)
    assert check_sha256(doc, "the file") == doc  # files written by hand or by older versions have none


# -- every writer goes through it ---------------------------------------------------------------------------


def _shard_plan() -> ShardPlan:
    unit = UnitPlan("layers.0", 100, Choice("reshard", reshard_to=2), 4e6, 1.5, 0.5)
    return ShardPlan("tiny", 4, 4, "fp32", "fsdp2", 8e9, 2, 1e8, 2e6, 12.0, (unit,), ((10.0, 20.0),))


def _proposal(key: str = "k1") -> Proposal:
    strategy = Strategy((Scheme(1, 1, 2), Scheme(1, 1, 1), Scheme(1, 1, 1)), 8192, 12.5)
    return Proposal((strategy,), key, {"model": "tiny"})


@pytest.fixture
def published(monkeypatch):
    """The targets the atomic writer renames into place, in order."""
    seen: list[str] = []
    real = atomic._publish

    def record(tmp, target, directory, strict=False):
        seen.append(os.path.basename(target))
        real(tmp, target, directory, strict)

    monkeypatch.setattr(atomic, "_publish", record)
    return seen


def test_every_writer_goes_through_the_atomic_writer(tmp_path, published):
    save_profile(make_profile(synthetic_samples()), tmp_path / "profile.json")
    _shard_plan().save(tmp_path / "shard.json")
    _proposal().save(tmp_path / "strategy.json")
    cached_proposal("k2", tmp_path / "cache", lambda: _proposal("k2"))
    with checkpoint.saving(tmp_path, "ckpt", checkpoint.Record(2, {"epoch": 1, "step": 2}, {})):
        pass
    save_lengths([3, 4, 5], tmp_path / "lengths.npy")
    save_lengths([3, 4, 5], tmp_path / "lengths.json")
    write_chrome_trace(tmp_path / "trace.json", [])
    assert published == [
        "profile.json",
        "shard.json",
        "strategy.json",
        "strategy-k2.json",
        checkpoint.MARKER,
        "lengths.npy",
        "lengths.json",
        "trace.json",
    ]
    assert load_lengths(tmp_path / "lengths.npy").tolist() == [3, 4, 5]
    assert load_lengths(tmp_path / "lengths.json").tolist() == [3, 4, 5]
    assert _leftovers(tmp_path) == [] and _leftovers(tmp_path / "cache") == []


def test_plots_are_written_through_it(tmp_path, published):
    from dyn_plugin.commands.shard import plot_frontier

    plot_frontier(_shard_plan(), str(tmp_path / "frontier.png"))
    assert published == ["frontier.png"] and (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"


# The only files written without the atomic writer: private files in a fresh temporary directory before
# any reader starts, and logs appended to as they grow. A new writer goes through dyn_plugin.atomic.
NOT_ATOMIC = {
    "dyn_plugin/runtime/planner_pool.py": "the planners' context in a private mkdtemp, and their stderr",
    "dyn_plugin/store/redis_server.py": "redis.conf and redis.log in the server's private directory",
    "dyn_plugin/bench/megatron_lm_rank.py": "a rank's per-step log, appended to",
    "dyn_plugin/bench/train_megatron_lm.py": "the child's output log, written as it runs",
    "dyn_plugin/bench/checkpoint.py": "the benchmark's scratch checkpoint, in a temporary folder it removes, and "
    "/proc/sys/vm/drop_caches",
    "dyn_plugin/host/checkpoint.py": "the empty probe by which ranks learn who shares a disk, created exclusively "
    "and removed at once",
    "dyn_plugin/bench/strategy.py": "plot_strategies saves to the name it is given: commands/strategy.py gives "
    "it a temporary one (atomic_path)",
}
WRITES = ("savefig", "savez", "savez_compressed", "write_text", "write_bytes", "dump")


def _writes(path: Path) -> list[int]:
    """Lines of ``path`` that write a file other than through dyn_plugin.atomic (``atomic_path``'s
    temporary name is called ``tmp`` wherever it is used)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            mode = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            devnull = node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "devnull"
            if isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax") and not devnull:
                lines.append(node.lineno)
        elif isinstance(f, ast.Attribute) and (
            f.attr in WRITES or (f.attr == "save" and isinstance(f.value, ast.Name) and f.value.id in ("np", "torch"))
        ):
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Name) and first.id == "tmp"):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    "path",
    sorted(p for d in ("dyn_plugin", "deepspeed_ext", "megatron_patches") for p in (ROOT / d).rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_module_writes_a_file_but_through_the_atomic_writer(path):
    rel = str(path.relative_to(ROOT))
    if rel in NOT_ATOMIC or rel == "dyn_plugin/atomic.py":
        return
    assert _writes(path) == [], f"{rel} writes a file directly: use dyn_plugin.atomic (write_atomic, atomic_path)"


# -- damaged files: refused with their path, or rebuilt ---------------------------------------------------


def _damage(path: Path, how: str) -> None:
    doc = json.loads(path.read_text())
    if how == "truncated":
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif how == "version":
        path.write_text(json.dumps({**doc, "version": 99}))
    elif how == "checksum":  # still valid JSON of the right shape, one value changed
        key = next(k for k in ("world", "key", "pad_multiple") if k in doc)
        doc[key] = doc[key] * 2 if isinstance(doc[key], int) else doc[key] + "x"
        path.write_text(json.dumps(doc))
    elif how == "not an object":
        path.write_text("[1, 2]")
    elif how == "empty":
        path.write_text("")


HOW = {
    "truncated": "is not valid JSON",
    "version": "version",
    "checksum": "is corrupt: its sha256 checksum",
    "not an object": "not a",
    "empty": "is not valid JSON",
}


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("kind", ["profile", "shard plan", "proposal"])
def test_a_damaged_file_is_refused_by_its_path(tmp_path, kind, how):
    path = tmp_path / "file.json"
    if kind == "profile":
        save_profile(make_profile(synthetic_samples()), path)
        load = load_profile
    elif kind == "shard plan":
        _shard_plan().save(path)
        load = ShardPlan.load
    else:
        _proposal().save(path)
        load = Proposal.load
    _damage(path, how)
    with pytest.raises(ValueError, match=HOW[how]) as err:
        load(path)
    assert str(path) in str(err.value)


def _shard_doc(**changes) -> dict:
    return {**_shard_plan().to_dict(), **changes}


def _proposal_doc(**changes) -> dict:
    doc = {k: v for k, v in _proposal().to_dict().items() if k != "sha256"}
    return {**doc, **changes}


@pytest.mark.parametrize(
    "doc",
    [
        _shard_doc(units=[{"name": "layers.0"}]),
        _shard_doc(units=[{**_shard_doc()["units"][0], "extra": 1}]),
        _shard_doc(units=[{**_shard_doc()["units"][0], "choice": "sometimes"}]),
        _shard_doc(units=[{**_shard_doc()["units"][0], "choice": "reshard(x)"}]),
        _shard_doc(units=None),
        _shard_doc(units=[3]),
        _shard_doc(shard_size=0),
        _shard_doc(world=3),
        {k: v for k, v in _shard_doc().items() if k != "world"},
    ],
    ids=lambda d: "shard-plan",
)
def test_a_shard_plan_of_the_wrong_shape_is_a_value_error_naming_it(tmp_path, doc):
    path = tmp_path / "shard.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"sharding plan {path}"):
        ShardPlan.load(path)


@pytest.mark.parametrize(
    "doc",
    [
        _proposal_doc(strategies=[]),
        _proposal_doc(strategies=None),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": 1, "pp": 1}, 2]], "longest": 10}]),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": 1, "pp": 1, "sp": 0}, 2]], "longest": 10}]),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": 1, "pp": 1, "sp": 1}, -2]], "longest": 10}]),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": 1, "pp": 1, "sp": 1}]], "longest": 10}]),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": "x", "pp": 1, "sp": 1}, 1]], "longest": 10}]),
        _proposal_doc(strategies=[{"pipelines": [[{"tp": 1, "pp": 1, "sp": 1}, 1]]}]),
        _proposal_doc(strategies=["tp1"]),
        _proposal_doc(key=None),
        {k: v for k, v in _proposal_doc().items() if k != "key"},
    ],
    ids=lambda d: "proposal",
)
def test_a_proposal_of_the_wrong_shape_is_a_value_error_naming_it(tmp_path, doc):
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"strategy proposal {path}"):
        Proposal.load(path)


def test_a_profile_of_the_wrong_shape_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "p.json"
    save_profile(make_profile(synthetic_samples()), path)
    doc = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("sha256", "model")}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"{path} does not follow the profile schema"):
        load_profile(path)
    path.write_text(json.dumps({**doc, "samples": "many", "tables": None}))
    with pytest.raises(ValueError, match=f"{path}"):
        load_profile(path)


@pytest.mark.parametrize("how", ["truncated", "checksum", "version", "no checksum", "other key", "directory"])
def test_a_damaged_proposal_cache_is_rebuilt_with_a_warning(tmp_path, caplog, how):
    made = []

    def make():
        made.append(1)
        return _proposal("k1")

    path = tmp_path / "strategy-k1.json"
    if how == "directory":
        path.mkdir()
    elif how == "no checksum":
        path.write_text(json.dumps(_proposal_doc()))
    elif how == "other key":
        _proposal("k0").save(path)
    else:
        _proposal("k1").save(path)
        _damage(path, how)
    if how == "directory":
        with pytest.raises(IsADirectoryError):  # it cannot be replaced either: the rename says so
            cached_proposal("k1", tmp_path, make)
        return
    with caplog.at_level(logging.WARNING, logger="dyn_plugin.plan.strategies.strategy"):
        got = cached_proposal("k1", tmp_path, make)
    assert got == _proposal("k1") and made == [1]
    assert any(str(path) in r.getMessage() and "proposing again" in r.getMessage() for r in caplog.records)
    assert cached_proposal("k1", tmp_path, make) == got and made == [1]  # the rebuilt file is whole
    assert _leftovers(tmp_path) == []


def test_a_damaged_checkpoint_marker_names_its_file(tmp_path):
    with checkpoint.saving(tmp_path, "ckpt", checkpoint.Record(3, {"epoch": 0, "step": 3}, {})) as save:
        path = Path(checkpoint.marker_path(save.directory))
    tmp_path = tmp_path / "ckpt"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"checkpoint marker {path} is not valid JSON"):
        checkpoint.read(tmp_path)
    path.write_text("[0, 3]")
    with pytest.raises(ValueError, match=f"checkpoint marker {path} holds list"):
        checkpoint.read(tmp_path)
    path.write_text(text.replace('"step": 3', '"step": 4'))  # still parses: the checksum catches it
    with pytest.raises(ValueError, match=f"checkpoint marker {path} is corrupt"):
        checkpoint.read(tmp_path)
