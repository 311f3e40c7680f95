"""Megatron-LM's own ``pretrain_gpt.py`` through the plugin's launcher, on two gloo CPU ranks.

The script is Megatron-LM's, unmodified (``shared/third_party/megatron-lm``, or a user's checkout
named by ``$MEGATRON_LM``); ``tests/megatron_lm_worker.py`` runs it as ``__main__`` and records what
the core attention computed. A tiny Llama-style GPT (4 layers, hidden 128, 4 heads in 2 query groups,
SwiGLU, RMSNorm, RoPE) trains a few iterations on Megatron's mock data with the plugin's padded,
then packed, micro-batches: every rank exits cleanly, the loss is finite and falls, and the
attention output is non-zero on every token (packed rows attend per document, never zeros).

What Megatron-LM needs on a CPU-only machine is in ``megatron_patches.cpu`` (applied only without
CUDA); ``six``, which Megatron-LM's tokenizer module imports, is in the test extra.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import free_port
from shared_data import shared_path

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEQ = 256
# the minimal Megatron-LM command line for the tiny GPT on CPU ranks (see README, "Megatron-LM's pretrain_gpt.py")
MODEL = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0"
).split()
TRAINING = (
    f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 1 --global-batch-size 8 "
    "--train-iters 4 --lr 1e-3 --lr-decay-style constant --clip-grad 0 --eval-iters 0 --eval-interval 1000 "
    "--log-interval 1 --mock-data --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 1024 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm"
).split()


def megatron_lm() -> Path:
    """Megatron-LM's scripts: ``$MEGATRON_LM`` (a user's checkout) or the shared third-party copy."""
    named = os.environ.get("MEGATRON_LM")
    path = Path(named) if named else shared_path("third_party", "megatron-lm")
    if not (path / "pretrain_gpt.py").is_file():
        pytest.fail(f"{path} has no pretrain_gpt.py ($MEGATRON_LM must name a Megatron-LM checkout)")
    return path


def run_pretrain_gpt(tmp_path: Path, method: str, args: list[str] = (), seq: int = SEQ, timeout: int = 240):
    """(return code, output, per-rank attention stats) of pretrain_gpt.py on 2 ranks through the launcher."""
    mlm = megatron_lm()
    cfg = tmp_path / "cfg.json"
    plugin = {
        "cost_model": {"kind": "analytic"},
        "microbatching": {"method": method, "global_tokens": 2048, "max_seq_len": seq, "truncate": True},
        "cluster": {"devices_per_node": 2, "device": {"memory_mb": 8000}},
    }
    cfg.write_text(json.dumps({"dyn_plugin": plugin}))
    paths = [str(ROOT), str(mlm)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
        "PET_MASTER_PORT": str(free_port()),  # torchrun's --master-port
        "OMP_NUM_THREADS": "1",
        "MEGATRON_LM_OUT": str(tmp_path),
        "MEGATRON_LM_SCRIPT": str(mlm / "pretrain_gpt.py"),
    }
    cmd = [
        sys.executable,
        "-m",
        "dyn_plugin",
        "megatron",
        "--dyn-plugin-config",
        str(cfg),
        "--nproc-per-node",
        "2",
        "--",
        str(HERE / "megatron_lm_worker.py"),
        *MODEL,
        *TRAINING,
        *args,
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    stats = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("attention-*.json"))]
    return proc.returncode, output, stats


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", output)]


LAYOUTS = {"padded": "fixed_padding", "packed": "dynapipe"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """layout -> (return code, output, attention stats) of one run each, shared by the tests below."""
    return {layout: run_pretrain_gpt(tmp_path_factory.mktemp(layout), method) for layout, method in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_gpt_trains_on_planned_micro_batches(trained, layout):
    code, output, stats = trained[layout]
    assert code == 0, output[-6000:]
    assert "dyn_plugin plans the" in output  # the plugin's documents, not Megatron's fixed-length samples
    loss = losses(output)
    assert len(loss) == 4, output[-4000:]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
    assert len(stats) == 2 and all(s["calls"] > 0 for s in stats), stats
    # attention computed something for every token of every call (a silently dropped attention gives zeros)
    assert all(s["min_nonzero_fraction"] == 1.0 for s in stats), stats
    if layout == "packed":
        assert all(s["packed"] == s["calls"] for s in stats), stats
        assert max(s["most_documents"] for s in stats) > 1, stats  # rows really held several documents
    else:
        assert all(s["packed"] == 0 for s in stats), stats


def test_packed_rows_train_as_the_padded_documents(trained):
    """Same documents per global batch, same token-mean loss: packing changes the layout, not the
    training (attention per document; a packed row attending across documents, or not at all, would
    change the losses)."""
    padded, packed = (losses(trained[layout][1]) for layout in LAYOUTS)
    assert len(padded) == len(packed) == 4
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(padded, packed)), (padded, packed)


def test_a_plan_longer_than_seq_length_is_refused_at_start_naming_the_flag(tmp_path):
    """Rows of up to microbatching.max_seq_len tokens in a model built for --seq-length positions:
    refused when the arguments are validated, naming --seq-length. Before, such rows reached the
    model (issue 22: an IndexError deep inside it; with this RoPE model they silently trained on
    rows longer than --seq-length)."""
    code, output, stats = run_pretrain_gpt(tmp_path, "dynapipe", seq=2 * SEQ, timeout=120)
    assert code != 0
    assert f"max_seq_len = {2 * SEQ} exceeds Megatron's --seq-length {SEQ}" in output, output[-4000:]
    assert "IndexError" not in output and all(s["calls"] == 0 for s in stats), stats  # refused before training
