"""The order of a save's syscalls, recorded (a SIGKILL keeps the page cache, so the kill tests
cannot show durability): every file the host wrote and every folder up to the save directory is
fsynced before the marker is renamed into place, the marker's own temporary file before its rename,
and its folder after it; a re-save takes the old marker away, durably, before anything else goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dyn_plugin.host import checkpoint


@pytest.fixture
def trace(monkeypatch) -> list[tuple[str, str]]:
    """(call, path) of every fsync, rename and unlink, in order; fsync's path read from the descriptor."""
    calls: list[tuple[str, str]] = []
    fsync, replace, unlink = os.fsync, os.replace, os.unlink

    def traced_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def traced_replace(src, dst, *a, **k):
        calls.append(("rename", os.fspath(dst)))
        return replace(src, dst, *a, **k)

    def traced_unlink(path, *a, **k):
        calls.append(("unlink", os.fspath(path)))
        return unlink(path, *a, **k)

    monkeypatch.setattr(os, "fsync", traced_fsync)
    monkeypatch.setattr(os, "replace", traced_replace)
    monkeypatch.setattr(os, "unlink", traced_unlink)
    return calls


def _save(root: Path, tag: str, trace: list) -> None:
    record = checkpoint.Record(1, {"epoch": 0, "step": 1}, {"world_size": 1})
    with checkpoint.saving(root, tag, record) as save:
        trace.append(("host", save.directory))
        directory = Path(save.directory)
        (directory / "model.pt").write_bytes(b"w" * 1000)
        (directory / "optim").mkdir()
        (directory / "optim" / "rank0.pt").write_bytes(b"o" * 500)


def test_every_file_and_folder_is_synced_before_the_marker_and_the_marker_after(tmp_path, trace):
    root = tmp_path / "ckpt"
    _save(root, "run1/step1", trace)
    directory = root / "run1" / "step1"
    marker = str(directory / checkpoint.MARKER)
    renamed = trace.index(("rename", marker))
    before, after = trace[:renamed], trace[renamed + 1 :]
    for path in (directory / "model.pt", directory / "optim" / "rank0.pt"):
        assert ("fsync", str(path)) in before, path
    for folder in (directory / "optim", directory, root / "run1", root):  # new entries, up to the save directory
        assert ("fsync", str(folder)) in before, folder
    temporary = [p for op, p in before if op == "fsync" and os.path.basename(p).startswith(f".{checkpoint.MARKER}.")]
    assert len(temporary) == 1  # the marker's own bytes, on disk before the name points at them
    assert ("fsync", str(directory)) in after  # the rename itself durable
    assert trace.index(("host", str(directory))) < trace.index(("fsync", str(directory / "model.pt")))


def test_a_resave_takes_the_old_marker_away_durably_first(tmp_path, trace):
    root = tmp_path / "ckpt"
    _save(root, "step1", trace)
    trace.clear()
    _save(root, "step1", trace)
    directory = root / "step1"
    marker = str(directory / checkpoint.MARKER)
    gone = trace.index(("unlink", marker))
    assert trace[gone + 1] == ("fsync", str(directory))  # the old checkpoint is no longer whole, on disk
    old_files = [i for i, (op, p) in enumerate(trace) if op == "unlink" and p != marker and str(directory) in p]
    assert old_files and min(old_files) > gone + 1  # its files go only after
    assert max(old_files) < trace.index(("host", str(directory)))
