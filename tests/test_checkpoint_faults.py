"""Checkpoints under the faults real clusters give (issue 36), on 2 gloo ranks: an I/O error on one
rank (a failed fsync, write or rename: EIO, ENOSPC, EDQUOT), a marker one node cannot read,
damage after the save (truncated, a flipped byte, a file added), a re-save into a used directory,
a re-save that fails (DeepSpeed's ``latest``, DeepSpeed's own load), nested tags, a resume from an
older tag, a second writer, a plan from the store that fails its check on one rank.

Each worker (tests/ckpt_fault_worker.py) meets the other after each scenario at a barrier of its
own with a timeout: a rank left inside a collective by one that raised alone is reported hung,
while the rank that raised stays alive (nothing rescues the waiting one). Every scenario must end
with the same error on both ranks, within seconds.
"""

from __future__ import annotations

import json

import pytest

from ranks import free_port, run

STRERROR = {"EIO": "Input/output error", "ENOSPC": "No space left on device", "EDQUOT": "Disk quota exceeded"}
QUICK_S = 10  # an error reaches every rank within this (the process group's timeout is 600 s)


def outcomes(tmp_path, host: str, env: dict | None = None) -> list[dict]:
    codes, logs = run("ckpt_fault_worker.py", host, tmp_path, free_port(), env=env, timeout=400)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    hung = {
        r: res for r, res in enumerate(results) for res in res.values() if isinstance(res, dict) and "peer_hung" in res
    }
    assert not hung, f"a rank was left waiting: {hung}"
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return results


def same_everywhere(results: list[dict], name: str) -> dict:
    """The scenario's outcome, the same on both ranks (its error, value and check), and quick."""
    first, second = results[0][name], results[1][name]
    assert {k: v for k, v in first.items() if k != "s"} == {k: v for k, v in second.items() if k != "s"}, (
        first,
        second,
    )
    assert first["s"] < QUICK_S and second["s"] < QUICK_S, (first["s"], second["s"])
    return first


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[dict]:
    return outcomes(tmp_path_factory.mktemp("files"), "files", env={"STORE_PORT": str(free_port())})


@pytest.mark.parametrize(
    "fault", ["fsync-file:EIO@1", "fsync-file:ENOSPC@0", "fsync-dir:EDQUOT@0", "write:ENOSPC@1", "replace-marker:EIO@0"]
)
def test_an_io_error_on_one_rank_fails_the_save_on_every_rank(files, fault):
    """The error names the rank, the file and the error; no marker is written; the previous
    checkpoint stays the one resumed, and DeepSpeed's ``latest`` still names it."""
    outcome = same_everywhere(files, f"io-{fault}")
    what, rest = fault.split(":")
    code, rank = rest.split("@")
    error = outcome["error"]
    assert error.startswith("CheckpointError: checkpoint ") and "step2 was not saved" in error, error
    assert f"rank {rank}: " in error and STRERROR[code] in error, error
    assert "step2" in error.split(STRERROR[code])[1], error  # the path the kernel named
    assert outcome["check"] == {"newest": "step1", "latest": "step1", "marker": False}


def test_a_marker_one_node_cannot_read_is_skipped_or_refused_on_every_rank(files):
    assert same_everywhere(files, "unreadable-auto")["value"] == "step1"
    error = same_everywhere(files, "unreadable-named")["error"]
    assert "step2 is not whole: rank 1: reading" in error and "Permission denied" in error, error


@pytest.mark.parametrize("damage", ["truncated", "flipped", "added"])
def test_a_checkpoint_damaged_after_its_save_is_refused_by_name_and_skipped_by_the_resume(files, damage):
    outcome = same_everywhere(files, f"damaged-{damage}")
    said = {
        "truncated": "rank1.pt has 1",  # its size, against what its save wrote
        "flipped": "rank1.pt does not hash to what its save wrote",
        "added": "zero_pp_rank_5_mp_rank_00_optim_states.pt was not written by its save",
    }[damage]
    assert outcome["error"].startswith("CheckpointError") and said in outcome["error"], outcome["error"]
    assert outcome["check"]["auto"] == "step1"
    # checkpoint.verify 'sizes' skips the hashes (a documented trade): only same-size damage passes it
    if damage == "flipped":
        assert outcome["check"]["sizes_only"] == "step2"
    else:
        assert outcome["check"]["sizes_only"].startswith("CheckpointError")


def test_a_resave_keeps_nothing_of_the_old_save(files):
    outcome = same_everywhere(files, "resave")
    assert outcome["value"] == {
        "files": ["dyn_plugin_checkpoint.json", "model.pt", "rank0.pt", "rank1.pt"],
        "loaded": "step1",
    }


def test_a_failed_resave_moves_deepspeeds_latest_off_it(files):
    outcome = same_everywhere(files, "resave-fails")
    assert "step2 was not saved: rank 1: writing the files" in outcome["error"]
    assert outcome["check"] == {"newest": "step1", "latest": "step1", "marker": False}


def test_nested_tags_are_saved_named_resumed_and_bad_ones_refused(files):
    assert same_everywhere(files, "nested")["value"] == {
        "named": "run1/step2",
        "auto": "run1/step2",
        "latest": "run1/step2",
    }
    assert "has the part '..'" in same_everywhere(files, "bad-tag")["error"]


def test_the_latest_save_wins_after_a_resume_from_an_older_tag(files):
    """Saves a, b, c; a resume from a on purpose; a save d: d is resumed after a crash, though c
    holds a later data position, and d descends from a."""
    value = same_everywhere(files, "branch")["value"]
    assert value["auto"] == "d" and value["parent"] == "a"
    assert value["positions"]["d"] < value["positions"]["c"]
    assert value["sequences"] == {"a": 1, "b": 2, "c": 3, "d": 4}


def test_a_second_writer_of_a_directory_is_refused(files):
    outcome = same_everywhere(files, "two-writers")
    assert "is being saved by pid" in outcome["error"] and "two writers of one checkpoint" in outcome["error"]
    assert outcome["check"] == {"newest": "step1", "latest": "step1", "marker": False}


def test_a_plan_failing_its_check_on_one_rank_stops_every_rank_at_the_same_step(files):
    outcome = same_everywhere(files, "plan-rejected")
    assert (
        outcome["error"].startswith("PayloadError: rank(s) [1] read a plan") and "failed its check" in outcome["error"]
    )
    steps = {**files[0]["plan-rejected-steps"], **files[1]["plan-rejected-steps"]}
    assert steps["0"] == steps["1"] == 2  # the rank that rejected planned its step itself; both stopped two later


@pytest.mark.parametrize("where", ["other-build", "other-build-store"])
def test_ranks_running_different_planning_code_are_refused_by_name(files, where):
    """Without a store at the first plan check; with one before any plan is shared (the loader's start)."""
    error = same_everywhere(files, where)["error"]
    assert error.startswith("PlanMismatch: the ranks run different planning code"), error
    assert "rank 1: dyn-plugin 9.9.9 without its C++ extension" in error and "rank 0: dyn-plugin 0.1.0" in error


@pytest.fixture(scope="module")
def deepspeed_host(tmp_path_factory) -> list[dict]:
    return outcomes(tmp_path_factory.mktemp("deepspeed"), "deepspeed")


def test_deepspeed_a_failed_write_on_one_rank_fails_the_save_everywhere(deepspeed_host):
    outcome = same_everywhere(deepspeed_host, "ds-write")
    assert "rank 1: writing the files: No space left on device" in outcome["error"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in outcome["error"]
    assert outcome["check"] == {"latest": "step1", "marker": False}


def test_deepspeeds_own_load_after_a_failed_resave_reads_the_previous_whole_checkpoint(deepspeed_host):
    outcome = same_everywhere(deepspeed_host, "ds-resave-fails")
    assert outcome["check"]["latest"] == "step1" and outcome["check"]["loaded"].startswith("step1/")
    assert outcome["check"]["weights"] == deepspeed_host[0]["ds-step1-weights"]


def test_deepspeed_nested_tags_damage_and_resaves(deepspeed_host):
    nested = same_everywhere(deepspeed_host, "ds-nested")["value"]
    assert nested["loaded"].startswith("run1/step1/") and nested["latest"] == "run1/step1" and nested["same"]
    damaged = same_everywhere(deepspeed_host, "ds-damaged")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt does not hash" in damaged["error"]
    assert damaged["check"].startswith("step1/")
    assert "zero_pp_rank_3_mp_rank_00_optim_states.pt" not in same_everywhere(deepspeed_host, "ds-resave")["value"]


@pytest.fixture(scope="module")
def fsdp_host(tmp_path_factory) -> list[dict]:
    return outcomes(tmp_path_factory.mktemp("fsdp"), "fsdp")


def test_fsdp_a_failed_fsync_inside_dcp_fails_the_save_everywhere_and_damage_is_refused(fsdp_host):
    failed = same_everywhere(fsdp_host, "fsdp-fsync")
    # DCP gathers every rank's write errors itself: each rank hands in rank 1's
    assert "rank 1: Input/output error (errno 5): " in failed["error"], failed["error"]
    assert "step2/__1_0.distcp" in failed["error"], failed["error"]
    assert failed["check"] == {"newest": "step1", "marker": False}
    damaged = same_everywhere(fsdp_host, "fsdp-damaged")
    assert "__1_0.distcp does not hash" in damaged["error"] and damaged["check"] == "step1"
    assert same_everywhere(fsdp_host, "fsdp-resave")["value"] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "dyn_plugin_checkpoint.json",
    ]
