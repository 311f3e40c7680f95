"""Megatron-LM's own ``pretrain_gpt.py`` through the plugin's launcher, on gloo CPU ranks.

The script is Megatron-LM's, unmodified (``shared_data.megatron_lm()``: a user's checkout named by
``$MEGATRON_LM``, else ``../shared/third_party/megatron-lm``; skipped where neither is);
``tests/megatron_lm_worker.py`` runs it as ``__main__`` and records what the core attention
computed, the documents each iteration trained and the parameters. A tiny
Llama-style GPT (4 layers, hidden 128, 4 heads in 2 query groups, SwiGLU, RMSNorm, RoPE) trains 4
iterations of Megatron's mock data with the plugin's padded and packed micro-batches at TP 1-2 x
PP 1-2, SGD with warm-up and linear decay. Each run must:

- exit cleanly on every rank with a finite, falling loss, attention non-zero on every token
  (packed rows attend per document: a dropped attention gives zeros);
- end with the parameters of Megatron-LM's own run, without the plugin, of the same documents
  from the same initial parameters (one document per micro-batch, its per-token loss), within
  1e-6: the plugin changes how the documents are cut and placed, never the update; the
  learning rate per iteration included (Megatron-LM counts ``--global-batch-size`` samples an
  iteration in both runs);
- count ``consumed samples`` in Megatron-LM's units (``--global-batch-size`` per iteration).

What Megatron-LM needs on a CPU-only machine is in ``megatron_patches.cpu`` (applied only without
CUDA); ``six``, which Megatron-LM's tokenizer module imports, is in the test extra.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import free_port
from shared_data import megatron_lm

pytest.importorskip("megatron.core")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEQ, ITERATIONS, GLOBAL_BATCH, LAYERS = 256, 4, 8, 4
BOUND = 1e-6
# the minimal Megatron-LM command line for the tiny GPT on CPU ranks (see README, "Megatron-LM's pretrain_gpt.py")
MODEL = (
    f"--num-layers {LAYERS} --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0"
).split()
TRAINING = (
    f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 1 --global-batch-size {GLOBAL_BATCH} "
    f"--train-iters {ITERATIONS} --optimizer sgd --lr 0.05 --min-lr 0.01 --lr-decay-style linear "
    "--lr-warmup-iters 1 --lr-decay-iters 4 --clip-grad 0 --eval-iters 0 --eval-interval 1000 "
    "--log-interval 1 --mock-data --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 1024 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm"
).split()
# name: (ranks, tensor-parallel size, pipeline stages, microbatching.layout of the plugin's plans,
# store.backend: "tcp" plans ahead in planner processes, each TP rank reading its own copy)
CASES = {
    "dp2-padded": (2, 1, 1, "padded", "none"),
    "dp2-packed": (2, 1, 1, "packed", "none"),
    "tp2-packed": (2, 2, 1, "packed", "tcp"),
    "pp2-packed": (2, 1, 2, "packed", "none"),
    "tp2-pp2-padded": (4, 2, 2, "padded", "none"),
    "tp2-pp2-packed": (4, 2, 2, "packed", "tcp"),
    "pp2-dp2-sp-packed": (4, 1, 2, "packed", "none"),
    "dp2-sp-padded": (2, 1, 1, "padded", "none"),
    "pp2-packed-zero-bubble": (2, 1, 2, "packed", "none"),
    "tp2-pp2-packed-zero-bubble": (4, 2, 2, "packed", "none"),
}
# cases planned with pipeline.schedule 'zero_bubble': the plugin's executor runs each step's plan in
# its own order, backwards split into I and W where the plan says (tests/test_megatron_executor.py
# checks the executor itself)
ZERO_BUBBLE = {"pp2-packed-zero-bubble", "tp2-pp2-packed-zero-bubble"}
# cases whose plans split micro-batches over sequence-parallel groups: (groupings, attention): global
# batch s groups the two data-parallel columns as groupings[s % len] (one group of 2: every row split
# over both columns and attending across them; two groups of 1: unsplit), where the planner would
# choose its own; the group attends by Ulysses (heads split) or the ring (key/value blocks passed on)
GROUPED = {"pp2-dp2-sp-packed": ([[2], [1, 1]], "ulysses"), "dp2-sp-padded": ([[1, 1], [2]], "ring")}


def environment(out: Path, **extra: str) -> dict:
    mlm = megatron_lm()
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(mlm), os.environ.get("PYTHONPATH", "")]),
        "PET_MASTER_PORT": str(free_port()),  # torchrun's --master-port
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron-LM requires it with tensor parallelism (before Blackwell)
        "MEGATRON_LM_OUT": str(out),
        "MEGATRON_LM_SCRIPT": str(mlm / "pretrain_gpt.py"),
        **extra,
    }


def run_pretrain_gpt(
    out: Path,
    layout: str,
    args: list[str] = (),
    *,
    ranks: int = 2,
    tp: int = 1,
    pp: int = 1,
    store: str = "none",
    seq: int = SEQ,
    timeout: int = 300,
    env: dict | None = None,
    grouped: tuple[list[list[int]], str] | None = None,
    schedule: str = "auto",
) -> tuple[int, str, list[dict]]:
    """(return code, output, per-rank attention stats) of pretrain_gpt.py through the launcher."""
    cfg = out / "cfg.json"
    plugin = {
        "cost_model": {"kind": "analytic"},
        "microbatching": {"layout": layout, "max_seq_len": seq, "truncate": True},
        "pipeline": {"stages": pp, "schedule": schedule},
        "store": {"backend": store},
        "cluster": {"devices_per_node": ranks, "device": {"memory_mb": 8000}},
    }
    if grouped:
        groupings, attention = grouped
        sizes = sorted({k for g in groupings for k in g})
        # pyramid checkpointing: the first layer of each stage recomputed in backward, which re-runs
        # its attention over the group of its forward
        plugin["sequence_parallel"] = {"enabled": True, "sizes": sizes, "pyramid": True, "attention": attention}
        env = {**(env or {}), "MEGATRON_LM_GROUPINGS": json.dumps(groupings), "MEGATRON_LM_CHECKPOINTED": "1"}
    cfg.write_text(json.dumps({"dyn_plugin": plugin}))
    parallel = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    cmd = [sys.executable, "-m", "dyn_plugin", "megatron", "--dyn-plugin-config", str(cfg)]
    cmd += ["--nproc-per-node", str(ranks), "--", str(HERE / "megatron_lm_worker.py"), *MODEL, *TRAINING]
    cmd += [*parallel, *args]
    code, output = run_to_end(cmd, env=environment(out, **(env or {})), cwd=out, timeout=timeout)
    stats = [json.loads(p.read_text()) for p in sorted(out.glob("attention-*.json"))]
    return code, output, stats


def run_to_end(cmd: list[str], *, env: dict, cwd: Path, timeout: int) -> tuple[int, str]:
    """(return code, output) of ``cmd``, every process it started killed when it ends: a rank killed
    by SIGKILL leaves the processes Megatron-LM's checkpoint writer spawned (its queue manager and
    multiprocessing's resource tracker) orphaned, outside the launcher's process group (torchrun
    starts each rank in a session of its own), still holding the output open; they are found by
    the output folder in their environment."""
    log = cwd / "output.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            marker = f"MEGATRON_LM_OUT={env['MEGATRON_LM_OUT']}".encode()
            for environ in Path("/proc").glob("[0-9]*/environ"):
                try:
                    if marker in environ.read_bytes().split(b"\0"):
                        os.kill(int(environ.parent.name), signal.SIGKILL)
                except (OSError, ValueError):
                    pass  # gone meanwhile, or not ours to read
    return code, log.read_text()


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", output)]


def merged(out: Path, when: str) -> dict[str, torch.Tensor]:
    """The whole model's parameters (``initial`` or ``final``) from a run's per-rank files: TP shards
    concatenated along their partition dimension; data-parallel replicas must agree."""
    shards: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    replicas: dict[tuple[str, int], torch.Tensor] = {}
    for path in sorted(out.glob("params-*.pt")):
        saved = torch.load(path)
        tp = saved["place"]["tp"]
        for name, (tensor, dim) in saved[when].items():
            seen = replicas.setdefault((name, tp), tensor)
            assert torch.equal(seen, tensor), f"{name}: data-parallel replicas differ"
            shards.setdefault(name, {})[tp] = (tensor, dim)
    whole = {}
    for name, by_tp in shards.items():
        parts = [by_tp[r] for r in sorted(by_tp)]
        dim, tensors = parts[0][1], [t for t, _ in parts]
        if dim is None:
            whole[name] = tensors[0]
        elif name.endswith("mlp.linear_fc1.weight"):
            # SwiGLU: each TP rank holds [its gate rows; its up rows]; the whole is [gate; up]
            halves = [t.chunk(2, dim) for t in tensors]
            whole[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
        else:
            whole[name] = torch.cat(tensors, dim)
    return whole


def documents_by_iteration(out: Path) -> list[list[list[int]]]:
    """Per iteration, the documents the run trained (over its data-parallel columns)."""
    steps: dict[tuple[int, int], list] = {}
    for path in sorted(out.glob("documents-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            steps.setdefault((r["epoch"], r["step"]), []).extend(r["documents"])
    return [steps[k] for k in sorted(steps)]


def run_reference(plugin_run: Path, out: Path, tp: int, timeout: int = 240) -> tuple[int, str]:
    """Megatron-LM's own run (one rank, no plugin) of the plugin run's documents from its initial
    parameters (the vocabulary padded as at ``tp`` ranks: to a multiple of 128 x tp)."""
    iterations = documents_by_iteration(plugin_run)
    (plugin_run / "iterations.json").write_text(json.dumps(iterations))
    torch.save(merged(plugin_run, "initial"), plugin_run / "merged-initial.pt")
    per_iteration = max(len(docs) for docs in iterations)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(HERE / "megatron_lm_worker.py")]
    cmd += [*MODEL, *TRAINING, "--global-batch-size", str(per_iteration), "--calculate-per-token-loss"]
    cmd += ["--make-vocab-size-divisible-by", str(128 * tp)]
    env = environment(out, MEGATRON_LM_REFERENCE=str(plugin_run))
    return run_to_end(cmd, env=env, cwd=out, timeout=timeout)


_RUNS: dict[str, dict] = {}  # case -> its runs, shared by the tests (each case runs once per session)


def case_run(name: str, tmp_path_factory) -> dict:
    """One case's plugin run and Megatron-LM's reference run of the same documents."""
    if name not in _RUNS:
        ranks, tp, pp, layout, store = CASES[name]
        out, ref = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-reference")
        code, output, stats = run_pretrain_gpt(
            out,
            layout,
            ranks=ranks,
            tp=tp,
            pp=pp,
            store=store,
            grouped=GROUPED.get(name),
            schedule="zero_bubble" if name in ZERO_BUBBLE else "auto",
        )
        assert code == 0, output[-8000:]
        ref_code, ref_output = run_reference(out, ref, tp)
        assert ref_code == 0, ref_output[-8000:]
        _RUNS[name] = {"out": out, "ref": ref, "output": output, "stats": stats, "ref_output": ref_output}
    return _RUNS[name]


# within the suite's time: the padded twins of packed cases run with the slow tests (their packed
# cases cover the same layouts of ranks; dp2-sp-padded keeps padded rows in the suite), and so do
# tensor and pipeline parallelism alone (tp2-pp2-packed runs both, pp2-dp2-sp-packed pipelines again)
# and plain data parallelism (pp2-dp2-sp-packed runs two data-parallel columns of packed rows)
SLOW_CASES = {"dp2-padded", "tp2-pp2-padded", "tp2-packed", "pp2-packed", "dp2-packed"}


@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES]
)
def trained(request, tmp_path_factory) -> tuple[str, dict]:
    return request.param, case_run(request.param, tmp_path_factory)


def test_pretrain_gpt_trains_on_planned_micro_batches(trained):
    name, run = trained
    ranks, tp, pp, layout, store = CASES[name]
    output, stats = run["output"], run["stats"]
    assert "dyn_plugin plans the" in output  # the plugin's documents, not Megatron's fixed-length samples
    if store == "tcp":
        assert output.count("planner processes (pids") == 1, output[-4000:]  # one host rank, whatever the TP size
    loss = losses(output)
    assert len(loss) == ITERATIONS, output[-4000:]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
    assert len(stats) == ranks and all(s["calls"] > 0 for s in stats), stats
    # attention computed something for every token of every call (a silently dropped attention gives zeros)
    assert all(s["min_nonzero_fraction"] == 1.0 for s in stats), stats
    if name in GROUPED:
        # split rows attend over their group (as plain rows: the group finds the documents from the
        # positions); the unsplit ones as the layout says
        assert all(0 < s["grouped"] < s["calls"] for s in stats), stats
        # each micro-batch: the stage's layers forward, the first again in backward (pyramid: 1 checkpointed)
        assert all((LAYERS // pp + 1) * s["recomputed"] == s["calls"] for s in stats), stats
    else:
        assert all(s["grouped"] == 0 for s in stats), stats
    split = [int(x) for x in re.findall(r"(\d+) of \d+ backwards split \(W deferred\)", output)]
    if name in ZERO_BUBBLE:
        assert sum(split) > 0, output[-4000:]  # the plans split backwards, and the executor ran them
    else:
        assert not split, split
    if layout == "packed":
        assert all(s["packed"] + s["grouped"] == s["calls"] for s in stats), stats
        assert max(s["most_documents"] for s in stats) > 1, stats  # rows really held several documents
    else:
        assert all(s["packed"] == 0 for s in stats), stats


def test_each_iteration_is_megatron_lms_update_of_its_documents(trained):
    """The parameters after 4 iterations equal Megatron-LM's own run of the same documents, one per
    micro-batch, from the same start (fp32, bound 1e-6; the weights move by ~1e-2); so do the
    logged losses and learning rates, iteration by iteration."""
    name, run = trained
    mine, reference = merged(run["out"], "final"), merged(run["ref"], "final")
    start = merged(run["out"], "initial")
    assert mine.keys() == reference.keys()
    moved = max(float((mine[k] - start[k]).abs().max()) for k in mine)
    diff = max(float((mine[k] - reference[k]).abs().max()) for k in mine)
    print(f"{name}: max |param - Megatron-LM's| = {diff:.3g} (weights moved up to {moved:.3g})")
    assert moved > 1e-3 and diff < BOUND, (diff, moved)
    ours, theirs = losses(run["output"]), losses(run["ref_output"])
    assert len(ours) == len(theirs) == ITERATIONS and all(
        math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, theirs)
    ), (ours, theirs)
    rates = [re.findall(r"learning rate: ([0-9.eE+-]+)", o) for o in (run["output"], run["ref_output"])]
    assert rates[0] == rates[1] and len(set(rates[0])) > 2, rates  # warm-up then decay, in step


def test_consumed_samples_are_megatron_lms(trained):
    """An iteration consumes --global-batch-size samples (of --seq-length tokens), as without the
    plugin: the plan's global batch is their tokens; each document is trained at most once."""
    name, run = trained
    consumed = [int(x) for x in re.findall(r"consumed samples:\s+(\d+)", run["output"])]
    assert consumed == [GLOBAL_BATCH * (i + 1) for i in range(ITERATIONS)], consumed
    assert f"global_tokens = {GLOBAL_BATCH * SEQ}" in run["output"]
    iterations = documents_by_iteration(run["out"])
    assert len(iterations) == ITERATIONS
    assert all(sum(map(len, docs)) <= GLOBAL_BATCH * SEQ for docs in iterations)


def test_a_plan_longer_than_seq_length_is_refused_at_start_naming_the_flag(tmp_path):
    """Rows of up to microbatching.max_seq_len tokens in a model built for --seq-length positions:
    refused when the arguments are validated, naming --seq-length. Before, such rows reached the
    model (issue 22: an IndexError deep inside it; with this RoPE model they silently trained on
    rows longer than --seq-length)."""
    code, output, stats = run_pretrain_gpt(tmp_path, "packed", seq=2 * SEQ, timeout=120)
    assert code != 0
    assert f"max_seq_len = {2 * SEQ} exceeds Megatron's --seq-length {SEQ}" in output, output[-4000:]
    assert "IndexError" not in output and all(s["calls"] == 0 for s in stats), stats  # refused before training


@pytest.mark.slow  # within the suite's time: test_megatron_kills resumes pretrain_gpt.py after kills, checked the same way
def test_a_run_killed_after_a_checkpoint_resumes_as_if_never_stopped(tmp_path):
    """SIGKILL on every rank right after the checkpoint of iteration 2, then the same command with
    --load: the resumed run trains exactly the documents the uninterrupted run trained in
    iterations 3 and 4 (none again, none skipped) and ends with its parameters, bit for bit;
    Megatron-LM's counters continue from the checkpoint. Adam: megatron-core 0.16 cannot load SGD's
    state from a distributed checkpoint (its SGD has no ``init_state_fn``)."""
    adam = ["--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-4"]
    whole, first, second = tmp_path / "whole", tmp_path / "first", tmp_path / "second"
    for d in (whole, first, second):
        d.mkdir()
    code, output, _ = run_pretrain_gpt(whole, "packed", adam)
    assert code == 0, output[-8000:]
    ckpt = tmp_path / "ckpt"
    save = [*adam, "--save", str(ckpt), "--save-interval", "2"]
    code, output, _ = run_pretrain_gpt(first, "packed", save, env={"MEGATRON_LM_KILL_AT": "2"})
    assert code != 0 and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2", output[-4000:]
    assert "iteration        3/" not in output  # killed before training on
    code, output, _ = run_pretrain_gpt(second, "packed", [*save, "--load", str(ckpt)])
    assert code == 0, output[-8000:]
    resumed = documents_by_iteration(first) + documents_by_iteration(second)
    assert resumed == documents_by_iteration(whole)
    consumed = [int(x) for x in re.findall(r"consumed samples:\s+(\d+)", output)]
    assert consumed == [GLOBAL_BATCH * 3, GLOBAL_BATCH * 4], consumed
    mine, reference = merged(second, "final"), merged(whole, "final")
    diff = max(float((mine[k] - reference[k]).abs().max()) for k in mine)
    assert diff == 0.0, diff
