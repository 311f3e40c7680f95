"""The user scripts in examples/ run as a user would launch them: 2 CPU ranks, a few steps,
the loss logged per step (slow: rank 0 tokenizes the standard library's source first)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def launch(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """The token ids, tokenized by the first example and read by the other."""
    return str(tmp_path_factory.mktemp("data"))


@pytest.mark.slow
def test_the_deepspeed_example_trains_logs_the_loss_and_saves(tmp_path, data):
    # DeepSpeed's own launcher (it adds --local_rank), and a checkpoint of the engine and the loader's position
    out = launch(
        [
            os.path.join(BIN, "deepspeed"),
            "--num_gpus",
            "2",
            "examples/deepspeed_llama/train.py",
            "--steps",
            "2",
            "--data",
            data,
            "--save",
            str(tmp_path / "ckpt"),
        ]
    )
    assert "step 0:" in out and "step 1:" in out and "loss" in out
    assert (tmp_path / "ckpt" / "step2" / "dyn_plugin_checkpoint.json").exists()


@pytest.mark.slow
def test_the_fsdp_example_trains_logs_the_loss_and_saves(tmp_path, data):
    # torchrun, and a checkpoint of the sharded model and optimizer and the loader's position
    out = launch(
        [
            os.path.join(BIN, "torchrun"),
            "--nproc_per_node=2",
            "examples/fsdp_llama/train.py",
            "--steps",
            "2",
            "--data",
            data,
            "--save",
            str(tmp_path / "ckpt"),
        ]
    )
    assert "plan:" in out and "step 1:" in out
    assert (tmp_path / "ckpt" / "step2" / "dyn_plugin_checkpoint.json").exists()
    assert (tmp_path / "ckpt" / "step2" / ".metadata").exists()


@pytest.mark.slow
def test_the_trainer_example_trains_saves_and_resumes(tmp_path, data):
    # torchrun, the Hugging Face Trainer's loop: 10 steps with a checkpoint at 10, then 2 more resumed from it
    run = [os.path.join(BIN, "torchrun"), "--nproc_per_node=2", "examples/hf_trainer/train.py", "--data", data]
    out = launch(run + ["--steps", "10", "--out", str(tmp_path / "out")])
    assert out.count("'loss'") == 10 and "num_input_tokens_seen" in out  # the Trainer's log, a line a step
    assert (tmp_path / "out" / "checkpoint-10" / "dyn_plugin_loader.json").exists()
    resumed = launch(run + ["--steps", "12", "--out", str(tmp_path / "out"), "--resume"])
    assert resumed.count("'loss'") == 2  # steps 11 and 12 only: it went on from the checkpoint
