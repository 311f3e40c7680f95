"""Bad input as a new user would type it, one row each: every ``dynplugin`` subcommand, the config
and the cheap public API entry points. Each must fail before any work starts, with one line that
names the flag, field or file (exit 2 for the CLI; the right exception for the API), and no traceback.

Rows run in-process (``dyn_plugin.cli.main``); an alarm fails a row that starts real work instead
of refusing (``2**63`` steps would otherwise loop for ever)."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from dyn_plugin.cli import main

BIG = str(2**63)  # beyond int64: would allocate or loop for ever if taken as a count
HUGE = str(2**40)
ROW_SECONDS = 10  # a refusal takes milliseconds; a row still running after this started real work

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 256}
GOOD_PLUGIN = {
    "cost_model": {"kind": "analytic", "model": SHAPE, "dtype": "fp32"},
    "microbatching": {"global_tokens": 4096, "max_seq_len": 2048, "truncate": True},
}


class TookTooLong(BaseException):
    """Not an Exception, so the CLI's own error handling cannot swallow it."""


@dataclass(frozen=True)
class Cli:
    argv: str  # split on spaces; {t} is the folder of prepared files
    needle: str  # what the one error line must name


@dataclass(frozen=True)
class Api:
    name: str
    call: Callable[[Path], object]
    error: type[BaseException]
    needle: str


def _config(tmp: Path, name: str, plugin: object = None, text: str | None = None, **deepspeed: object) -> None:
    body = text if text is not None else json.dumps({**deepspeed, "dyn_plugin": plugin or GOOD_PLUGIN})
    (tmp / name).write_text(body)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    t = tmp_path_factory.mktemp("bad")
    _config(t, "good.json")
    np.save(t / "good.npy", np.array([100, 200, 300, 50] * 8))
    np.save(t / "empty.npy", np.array([], dtype=np.int64))
    np.save(t / "2d.npy", np.ones((2, 2), dtype=np.int64))
    np.save(t / "nan.npy", np.array([1.0, np.nan]))
    np.save(t / "neg.npy", np.array([5, -3]))
    np.save(t / "int64max.npy", np.array([10, 2**62]))
    np.save(t / "uint64.npy", np.array([2**64 - 1], dtype=np.uint64))
    np.save(t / "str.npy", np.array(["a", "b"]))
    (t / "garbage.npy").write_bytes(b"not a numpy file at all")
    (t / "dir.npy").mkdir()
    (t / "dir.json").mkdir()
    (t / "adir").mkdir()
    (t / "afile").write_text("x")
    (t / "lengths.txt").write_text("1 2 3")
    (t / "zero.json").write_text("[0, 5]")
    (t / "strs.json").write_text('["a", 5]')
    (t / "bool.json").write_text("[true, 5]")
    (t / "beyond.json").write_text(f"[5, {2**64}]")
    (t / "int63.json").write_text(f"[5, {2**63}]")
    (t / "float.json").write_text("[5, 2.5]")
    (t / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    (t / "broken.json").write_text("[1, 2")
    (t / "empty.json").write_text("")
    (t / "latin1.json").write_bytes(b'{"lengths": [1, 2], "x": "\xe9"}')
    (t / "nokey.json").write_text('{"values": [1, 2]}')
    (t / "scalar.json").write_text("7")
    (t / "listlist.json").write_text("[[1, 2]]")
    # configs, one problem each
    _config(t, "cfg-broken.json", text='{"dyn_plugin": {')
    _config(t, "cfg-nested.json", text='{"dyn_plugin": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _config(t, "cfg-list.json", text="[1, 2]")
    _config(t, "cfg-empty.json", text="")
    (t / "cfg-latin1.json").write_bytes(b'{"x": "\xe9"}')
    _config(t, "cfg-zero-list.json", zero_optimization=[1])
    _config(t, "cfg-zero-stage-str.json", zero_optimization={"stage": "2"})
    _config(t, "cfg-zero-stage-7.json", zero_optimization={"stage": 7})
    _config(t, "cfg-section-list.json", text='{"dyn_plugin": [1]}')
    _config(t, "cfg-dup.json", text='{"a": 1, "a": 2}')
    plugin = lambda **kw: {**GOOD_PLUGIN, **kw}  # noqa: E731
    mb = GOOD_PLUGIN["microbatching"]
    cluster = lambda **kw: plugin(cluster=kw)  # noqa: E731
    device = lambda **kw: plugin(cluster={"device": kw})  # noqa: E731
    _config(t, "cfg-tokens-0.json", plugin(microbatching={**mb, "global_tokens": 0}))
    _config(t, "cfg-tokens-big.json", plugin(microbatching={**mb, "global_tokens": 2**63}))
    _config(t, "cfg-tokens-beyond.json", plugin(microbatching={**mb, "global_tokens": 2**70}))
    _config(t, "cfg-tokens-str.json", plugin(microbatching={**mb, "global_tokens": "4096"}))
    _config(t, "cfg-stages-neg.json", plugin(pipeline={"stages": -1}))
    _config(t, "cfg-devices-huge.json", cluster(devices_per_node=2**40))
    _config(t, "cfg-nodes-big.json", cluster(num_nodes=2**63))
    (t / "cfg-inf.json").write_text('{"dyn_plugin": {"cluster": {"device": {"peak_tflops": Infinity}}}}')
    (t / "cfg-nan.json").write_text('{"dyn_plugin": {"cluster": {"device": {"memory_mb": NaN}}}}')
    (t / "cfg-1e400.json").write_text('{"dyn_plugin": {"cluster": {"intra_node_gb_per_s": 1e400}}}')
    _config(t, "cfg-mem-neg.json", device(memory_mb=-5))
    _config(t, "cfg-unknown.json", plugin(microbatcing={}))
    _config(t, "cfg-profile-missing.json", {"cost_model": {"kind": "profile", "profile": str(t / "nope.json")}})
    _config(t, "cfg-profile-dir.json", {"cost_model": {"kind": "profile", "profile": str(t / "adir")}})
    _config(t, "cfg-profile-broken.json", {"cost_model": {"kind": "profile", "profile": str(t / "broken.json")}})
    # models and other JSON inputs
    (t / "model-list.json").write_text("[1]")
    (t / "model-notype.json").write_text('{"hidden_size": 8}')
    (t / "script.py").write_text("print('never run')\n")
    return t


CLI: list[Cli] = [
    # the command line itself
    Cli("", "COMMAND"),
    Cli("bogus", "bogus"),
    Cli("plan", "--config"),
    # analyze: the file
    Cli("analyze {t}/missing.npy", "missing.npy"),
    Cli("analyze {t}/dir.npy", "dir.npy"),
    Cli("analyze {t}/dir.json", "dir.json"),
    Cli("analyze {t}/adir", "adir"),
    Cli("analyze {t}/lengths.txt", "lengths.txt"),
    Cli("analyze {t}/empty.npy", "empty.npy"),
    Cli("analyze {t}/2d.npy", "2d.npy"),
    Cli("analyze {t}/nan.npy", "nan.npy"),
    Cli("analyze {t}/neg.npy", "neg.npy"),
    Cli("analyze {t}/int64max.npy", "int64max.npy"),
    Cli("analyze {t}/uint64.npy", "uint64.npy"),
    Cli("analyze {t}/str.npy", "str.npy"),
    Cli("analyze {t}/garbage.npy", "garbage.npy"),
    Cli("analyze {t}/zero.json", "zero.json"),
    Cli("analyze {t}/strs.json", "strs.json"),
    Cli("analyze {t}/bool.json", "bool.json"),
    Cli("analyze {t}/beyond.json", "beyond.json"),
    Cli("analyze {t}/int63.json", "int63.json"),
    Cli("analyze {t}/float.json", "float.json"),
    Cli("analyze {t}/nested.json", "nested.json"),
    Cli("analyze {t}/broken.json", "broken.json"),
    Cli("analyze {t}/empty.json", "empty.json"),
    Cli("analyze {t}/latin1.json", "latin1.json"),
    Cli("analyze {t}/nokey.json", "nokey.json"),
    Cli("analyze {t}/scalar.json", "scalar.json"),
    Cli("analyze {t}/listlist.json", "listlist.json"),
    # analyze: the counts
    Cli("analyze code --batch-size 0", "--batch-size"),
    Cli("analyze code --batch-size -1", "--batch-size"),
    Cli("analyze code --batch-size " + BIG, "--batch-size"),
    Cli("analyze code --token-budget 0", "--token-budget"),
    Cli("analyze code --token-budget -5", "--token-budget"),
    Cli("analyze code --token-budget " + BIG, "--token-budget"),
    Cli("analyze code --max-len 0", "--max-len"),
    Cli("analyze code --max-len " + BIG, "--max-len"),
    Cli("analyze code --hidden 0", "--hidden"),
    Cli("analyze code --hidden " + BIG, "--hidden"),
    Cli("analyze code --dp 0", "--dp"),
    Cli("analyze code --dp -1", "--dp"),
    Cli("analyze code --dp " + BIG, "--dp"),
    Cli("analyze code --seed -1", "--seed"),
    Cli("analyze code --seed " + str(2**64), "--seed"),
    Cli("analyze code --batch-size x", "--batch-size"),
    Cli("analyze code --plot {t}/nowhere/a.png", "--plot"),
    Cli("analyze code --plot {t}/adir", "--plot"),
    # lengths
    Cli("lengths", "NAME"),
    Cli("lengths code", "--out"),
    Cli("lengths code --out {t}/x.txt", "--out"),
    Cli("lengths code --bundled --out {t}/nowhere/x.npy", "--out"),
    Cli("lengths code --bundled --out {t}/dir.npy", "--out"),
    Cli("lengths bogus --out {t}/x.npy", "bogus"),
    # plan: flags
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --dp 0", "--dp"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --dp -2", "--dp"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --dp " + BIG, "--dp"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --global-tokens 0", "--global-tokens"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --global-tokens -1", "--global-tokens"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --global-tokens " + BIG, "--global-tokens"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --steps 0", "--steps"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --steps -1", "--steps"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --steps " + BIG, "--steps"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --seed -1", "--seed"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --trace {t}/nowhere/t.json", "--trace"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --plot {t}/nowhere/p.png", "--plot"),
    Cli("plan --config {t}/good.json --lengths {t}/good.npy --plans {t}/afile", "--plans"),
    Cli("plan --config {t}/good.json --lengths {t}/empty.npy", "empty.npy"),
    Cli("plan --config {t}/good.json --lengths {t}/nested.json", "nested.json"),
    Cli("plan --config {t}/good.json --lengths {t}/adir", "adir"),
    Cli("plan --config {t}/good.json --lengths bogus", "bogus"),
    # plan: the config
    Cli("plan --config {t}/missing.json --lengths code", "missing.json"),
    Cli("plan --config {t}/adir --lengths code", "adir"),
    Cli("plan --config {t}/cfg-broken.json --lengths code", "cfg-broken.json"),
    Cli("plan --config {t}/cfg-nested.json --lengths code", "cfg-nested.json"),
    Cli("plan --config {t}/cfg-list.json --lengths code", "cfg-list.json"),
    Cli("plan --config {t}/cfg-empty.json --lengths code", "cfg-empty.json"),
    Cli("plan --config {t}/cfg-latin1.json --lengths code", "cfg-latin1.json"),
    Cli("plan --config {t}/cfg-zero-list.json --lengths code", "zero_optimization"),
    Cli("plan --config {t}/cfg-zero-stage-str.json --lengths code", "zero_optimization.stage"),
    Cli("plan --config {t}/cfg-zero-stage-7.json --lengths code", "zero_optimization.stage"),
    Cli("plan --config {t}/cfg-section-list.json --lengths code", "cfg-section-list.json"),
    Cli("plan --config {t}/cfg-dup.json --lengths code", "duplicate"),
    Cli("plan --config {t}/cfg-tokens-0.json --lengths code", "global_tokens"),
    Cli("plan --config {t}/cfg-tokens-big.json --lengths code", "global_tokens"),
    Cli("plan --config {t}/cfg-tokens-beyond.json --lengths code", "global_tokens"),
    Cli("plan --config {t}/cfg-tokens-str.json --lengths code", "global_tokens"),
    Cli("plan --config {t}/cfg-stages-neg.json --lengths code", "pipeline.stages"),
    Cli("plan --config {t}/cfg-devices-huge.json --lengths code", "devices_per_node"),
    Cli("plan --config {t}/cfg-nodes-big.json --lengths code", "num_nodes"),
    Cli("plan --config {t}/cfg-inf.json --lengths code", "peak_tflops"),
    Cli("plan --config {t}/cfg-nan.json --lengths code", "memory_mb"),
    Cli("plan --config {t}/cfg-1e400.json --lengths code", "intra_node_gb_per_s"),
    Cli("plan --config {t}/cfg-mem-neg.json --lengths code", "memory_mb"),
    Cli("plan --config {t}/cfg-unknown.json --lengths code", "microbatcing"),
    Cli("plan --config {t}/cfg-profile-missing.json --lengths code", "nope.json"),
    Cli("plan --config {t}/cfg-profile-dir.json --lengths code", "adir"),
    Cli("plan --config {t}/cfg-profile-broken.json --lengths code", "broken.json"),
    # shard
    Cli("shard --model tiny-llama --config {t}/good.json --world 0 --out {t}/s.json", "--world"),
    Cli("shard --model tiny-llama --config {t}/good.json --world -2 --out {t}/s.json", "--world"),
    Cli("shard --model tiny-llama --config {t}/good.json --world " + HUGE + " --out {t}/s.json", "--world"),
    Cli("shard --model tiny-llama --config {t}/good.json --world " + BIG + " --out {t}/s.json", "--world"),
    Cli("shard --model bogus --config {t}/good.json --out {t}/s.json", "bogus"),
    Cli("shard --model {t}/adir --config {t}/good.json --out {t}/s.json", "adir"),
    Cli("shard --model {t}/broken.json --config {t}/good.json --out {t}/s.json", "broken.json"),
    Cli("shard --model {t}/model-list.json --config {t}/good.json --out {t}/s.json", "model-list.json"),
    Cli("shard --model {t}/model-notype.json --config {t}/good.json --out {t}/s.json", "model_type"),
    Cli("shard --model {t}/nested.json --config {t}/good.json --out {t}/s.json", "nested.json"),
    Cli("shard --model tiny-llama --config {t}/good.json --out {t}/nowhere/s.json", "--out"),
    Cli("shard --model tiny-llama --config {t}/good.json --out {t}/adir", "--out"),
    Cli("shard --model tiny-llama --config {t}/good.json --host bogus", "--host"),
    Cli("shard --model tiny-llama --config {t}/good.json --seed -1 --out {t}/s.json", "--seed"),
    Cli("shard --model tiny-llama --config {t}/good.json --lengths {t}/neg.npy --out {t}/s.json", "neg.npy"),
    Cli("shard --model tiny-llama --config {t}/cfg-zero-list.json --out {t}/s.json", "zero_optimization"),
    # strategy
    Cli("strategy code", "--model"),
    Cli("strategy code --model gpt-6.7b --config {t}/good.json", "--model"),
    Cli("strategy code --model gpt-6.7b --gpus 0 --out {t}/s.json", "--gpus"),
    Cli("strategy code --model gpt-6.7b --gpus -1 --out {t}/s.json", "--gpus"),
    Cli("strategy code --model gpt-6.7b --gpus " + BIG + " --out {t}/s.json", "--gpus"),
    Cli("strategy code --model gpt-6.7b --tokens 0 --out {t}/s.json", "--tokens"),
    Cli("strategy code --model gpt-6.7b --tokens -7 --out {t}/s.json", "--tokens"),
    Cli("strategy code --model gpt-6.7b --tokens " + BIG + " --out {t}/s.json", "--tokens"),
    Cli("strategy code --model gpt-6.7b --max-len 0 --out {t}/s.json", "--max-len"),
    Cli("strategy code --model gpt-6.7b --max-strategies 0 --out {t}/s.json", "--max-strategies"),
    Cli("strategy code --model gpt-6.7b --max-strategies -1 --out {t}/s.json", "--max-strategies"),
    Cli("strategy code --model gpt-6.7b --max-strategies " + BIG + " --out {t}/s.json", "--max-strategies"),
    Cli("strategy code --model bogus --out {t}/s.json", "bogus"),
    Cli("strategy code --model gpt-6.7b --out {t}/nowhere/s.json", "--out"),
    Cli("strategy code --model gpt-6.7b --out {t}/adir", "--out"),
    Cli("strategy code --model gpt-6.7b --cache {t}/afile --out {t}/s.json", "--cache"),
    Cli("strategy {t}/zero.json --model gpt-6.7b --out {t}/s.json", "zero.json"),
    Cli("strategy code --config {t}/cfg-zero-list.json --out {t}/s.json", "zero_optimization"),
    Cli("strategy code --config {t}/missing.json --out {t}/s.json", "missing.json"),
    # profile
    Cli("profile --out {t}/p.json --threads 0", "--threads"),
    Cli("profile --out {t}/p.json --threads -1", "--threads"),
    Cli("profile --out {t}/p.json --ranks 0", "--ranks"),
    Cli("profile --out {t}/p.json --ranks -1", "--ranks"),
    Cli("profile --out {t}/p.json --ranks " + BIG, "--ranks"),
    Cli("profile --out {t}/p.json --repeats 0", "--repeats"),
    Cli("profile --out {t}/p.json --validate -1", "--validate"),
    Cli("profile --out {t}/p.json --max-tokens 0", "--max-tokens"),
    Cli("profile --out {t}/p.json --seq-lens 0", "--seq-lens"),
    Cli("profile --out {t}/p.json --seq-lens " + BIG, "--seq-lens"),
    Cli("profile --out {t}/p.json --micro-batch-sizes -1", "--micro-batch-sizes"),
    Cli("profile --out {t}/p.json --device bogus", "--device"),
    Cli("profile --out {t}/p.json --device cuda:99", "--device"),
    Cli("profile --out {t}/p.json --recompute sometimes", "--recompute"),
    Cli("profile --out {t}/nowhere/p.json", "--out"),
    Cli("profile --out {t}/adir", "--out"),
    Cli("profile --out {t}/p.json --model bogus", "bogus"),
    Cli("profile --out {t}/p.json --model {t}/adir", "adir"),
    Cli("profile --out {t}/p.json --model {t}/broken.json", "broken.json"),
    Cli("profile --out {t}/p.json --model {t}/model-list.json", "model-list.json"),
    Cli("profile --out {t}/p.json stray", "stray"),
    Cli("profile import --out {t}/p.json", "FILE"),
    Cli("profile import {t}/missing.json --num-layers 2 --hidden-size 64 --out {t}/p.json", "missing.json"),
    Cli("profile import {t}/adir --num-layers 2 --hidden-size 64 --out {t}/p.json", "adir"),
    Cli("profile import {t}/broken.json --num-layers 2 --hidden-size 64 --out {t}/p.json", "broken.json"),
    Cli("profile import {t}/nested.json --num-layers 2 --hidden-size 64 --out {t}/p.json", "nested.json"),
    Cli("profile import {t}/scalar.json --num-layers 2 --hidden-size 64 --out {t}/p.json", "scalar.json"),
    Cli("profile import {t}/broken.json --num-layers 0 --hidden-size 64 --out {t}/p.json", "--num-layers"),
    Cli("profile import {t}/broken.json --num-layers 2 --hidden-size -64 --out {t}/p.json", "--hidden-size"),
    # bench
    Cli("bench", "WHAT"),
    Cli("bench cost --queries 0", "--queries"),
    Cli("bench cost --queries -1", "--queries"),
    Cli("bench cost --queries " + BIG, "--queries"),
    Cli("bench cost --seed -1", "--seed"),
    Cli("bench planner --batches 0", "--batches"),
    Cli("bench planner --python-batches -1", "--python-batches"),
    Cli("bench planner --global-tokens 0", "--global-tokens"),
    Cli("bench planner --global-tokens abc", "--global-tokens"),
    Cli("bench planner --parallel 3", "--parallel"),
    Cli("bench planner --parallel 0x1", "--parallel"),
    Cli("bench planner --distributions bogus", "--distributions"),
    Cli("bench sp --gpus 0", "--gpus"),
    Cli("bench sp --pp a", "--pp"),
    Cli("bench sp --sizes 3", "--sizes"),
    Cli("bench sp --max-len 0", "--max-len"),
    Cli("bench sp --batches 0", "--batches"),
    Cli("bench shard --gpus 0", "--gpus"),
    Cli("bench shard --budgets-mb -1", "--budgets-mb"),
    Cli("bench shard --tokens-per-gpu 0", "--tokens-per-gpu"),
    Cli("bench shard --max-len 0", "--max-len"),
    Cli("bench shard --models bogus", "--models"),
    Cli("bench shard --lengths {t}/neg.npy", "neg.npy"),
    Cli("bench shard --train --ranks 0", "--ranks"),
    Cli("bench shard --train --steps 0", "--steps"),
    Cli("bench shard --train --budget-mb -1", "--budget-mb"),
    Cli("bench shard --train --profile {t}/missing.json", "missing.json"),
    Cli("bench shard --train --out {t}/afile", "--out"),
    Cli("bench strategy --gpus 0", "--gpus"),
    Cli("bench strategy --models bogus", "--models"),
    Cli("bench strategy --tokens-per-gpu 0", "--tokens-per-gpu"),
    Cli("bench strategy --max-strategies 0", "--max-strategies"),
    Cli("bench strategy --batches " + BIG, "--batches"),
    Cli("bench strategy --plot-dir {t}/afile", "--plot-dir"),
    Cli("bench loader --steps 0", "--steps"),
    Cli("bench loader --planners 0", "--planners"),
    Cli("bench loader --prefetch -1", "--prefetch"),
    Cli("bench loader --step-ms abc", "--step-ms"),
    Cli("bench loader --step-ms -5", "--step-ms"),
    Cli("bench loader --samples 0", "--samples"),
    Cli("bench loader --samples " + BIG, "--samples"),
    Cli("bench loader --redis-url notaurl", "--redis-url"),
    Cli("bench loader --redis-url redis://127.0.0.1:1", "redis://127.0.0.1:1 unavailable"),
    Cli("bench train --ranks 0", "--ranks"),
    Cli("bench train --ranks -1", "--ranks"),
    Cli("bench train --steps 0", "--steps"),
    Cli("bench train --global-tokens 0", "--global-tokens"),
    Cli("bench train --max-len 0", "--max-len"),
    Cli("bench train --profile {t}/missing.json", "missing.json"),
    Cli("bench train --profile {t}/adir", "adir"),
    Cli("bench train --out {t}/afile", "--out"),
    Cli("bench train --host megatron --sp", "--sp"),
    Cli("bench train --host megatron-lm --megatron-lm {t}/missing", "--megatron-lm"),
    Cli("bench families --profile {t}/missing.json", "missing.json"),
    Cli("bench families --profile {t}/adir", "adir"),
    Cli("bench families --profile {t}/broken.json", "broken.json"),
    Cli("bench families --profile {t}/good.json --families bogus", "--families"),
    Cli("bench families --profile {t}/good.json --seq-len 0", "--seq-len"),
    Cli("bench families --profile {t}/good.json --micro-batch-size 0", "--micro-batch-size"),
    Cli("bench families --profile {t}/good.json --repeats 0", "--repeats"),
    Cli("bench families --profile {t}/good.json --warmup -1", "--warmup"),
    # megatron: refused before the child starts
    Cli("megatron --dyn-plugin-config {t}/good.json --nproc-per-node 0 {t}/script.py", "--nproc-per-node"),
    Cli("megatron --dyn-plugin-config {t}/good.json --nproc-per-node -1 {t}/script.py", "--nproc-per-node"),
    Cli("megatron --dyn-plugin-config {t}/good.json --nproc-per-node " + BIG + " {t}/script.py", "--nproc-per-node"),
    Cli("megatron --dyn-plugin-config {t}/missing.json {t}/script.py", "missing.json"),
    Cli("megatron --dyn-plugin-config {t}/adir {t}/script.py", "adir"),
    Cli("megatron --dyn-plugin-config {t}/cfg-zero-list.json {t}/script.py", "zero_optimization"),
    Cli("megatron --dyn-plugin-config {t}/cfg-tokens-0.json {t}/script.py", "global_tokens"),
    Cli("megatron --dyn-plugin-config {t}/cfg-broken.json {t}/script.py", "cfg-broken.json"),
    Cli("megatron --dyn-plugin-config {t}/good.json {t}/missing.py", "missing.py"),
    Cli("megatron --dyn-plugin-config {t}/good.json {t}/adir", "adir"),
]


def _layout(world: int = 2, tp: int = 1):
    from dyn_plugin.layout import RankLayout

    return RankLayout(world, tp=tp)


def _loader(t: Path, **kw: object):
    from dyn_plugin.config import load_config
    from dyn_plugin.cost.from_config import build_cost_model
    from dyn_plugin.runtime.loader import DynLoader

    plugin = load_config(t / "good.json").plugin
    args = {
        "lengths": [10, 20, 30],
        "config": plugin,
        "cost_model": build_cost_model(plugin.cost_model, plugin.cluster),
    }
    args.update(kw)
    return DynLoader(args.pop("dataset", [0, 1, 2]), **args)


def _spec(t: Path, **kw: object):
    from dyn_plugin.config import load_config
    from dyn_plugin.cost.from_config import build_cost_model
    from dyn_plugin.plan.steps.spec import planner_spec

    plugin = load_config(t / "good.json").plugin
    return planner_spec(build_cost_model(plugin.cost_model, plugin.cluster), plugin, **{"dp": 1, **kw})


def _validate(values: object):
    from dyn_plugin.lengths.io import validate_lengths

    return validate_lengths(values)


def _load_lengths(source: object):
    from dyn_plugin.lengths.io import load_lengths

    return load_lengths(source)


def _load_config(source: object):
    from dyn_plugin.config import load_config

    return load_config(source)


def _model(source: object):
    from dyn_plugin.models.hf import load_model_config

    return load_model_config(source)


def _profile(source: object):
    from dyn_plugin.cost.profile import load_profile

    return load_profile(source)


def _batches(**kw: object):
    from dyn_plugin.runtime.sampler import global_batches

    return global_batches(**{"lengths": [10, 20], "tokens": 64, "count": 1, "seed": 0, **kw})


V = ValueError
API: list[Api] = [
    Api("validate_lengths []", lambda t: _validate([]), V, "empty"),
    Api("validate_lengths [0]", lambda t: _validate([0]), V, "lengths[0]"),
    Api("validate_lengths [-1]", lambda t: _validate([5, -1]), V, "lengths[1]"),
    Api("validate_lengths 2**63", lambda t: _validate([5, 2**63]), V, "lengths[1]"),
    Api("validate_lengths 2**64", lambda t: _validate([2**64]), V, "lengths[0]"),
    Api("validate_lengths 2**62", lambda t: _validate([2**62]), V, "lengths[0]"),
    Api("validate_lengths uint64", lambda t: _validate(np.array([2**64 - 1], dtype=np.uint64)), V, "lengths[0]"),
    Api("validate_lengths str", lambda t: _validate(["a"]), V, "lengths[0]"),
    Api("validate_lengths None", lambda t: _validate([None]), V, "lengths[0]"),
    Api("validate_lengths bool", lambda t: _validate([True]), V, "lengths[0]"),
    Api("validate_lengths 1.5", lambda t: _validate([1.5]), V, "lengths[0]"),
    Api("validate_lengths nan", lambda t: _validate(np.array([np.nan])), V, "lengths[0]"),
    Api("validate_lengths inf", lambda t: _validate([float("inf")]), V, "lengths[0]"),
    Api("validate_lengths 2-D", lambda t: _validate([[1, 2]]), V, "1-D"),
    Api("validate_lengths scalar", lambda t: _validate(5), V, "1-D"),
    Api("load_lengths dir", lambda t: _load_lengths(t / "dir.npy"), V, "dir.npy"),
    Api("load_lengths missing", lambda t: _load_lengths(t / "missing.npy"), FileNotFoundError, "missing.npy"),
    Api("load_lengths suffix", lambda t: _load_lengths(t / "lengths.txt"), V, "lengths.txt"),
    Api("load_lengths nested", lambda t: _load_lengths(t / "nested.json"), V, "nested.json"),
    Api("load_lengths garbage", lambda t: _load_lengths(t / "garbage.npy"), V, "garbage.npy"),
    Api("load_lengths empty npy", lambda t: _load_lengths(t / "empty.npy"), V, "empty.npy"),
    Api("load_lengths not a path", lambda t: _load_lengths(7), V, "7"),
    Api("load_config dir", lambda t: _load_config(t / "adir"), V, "adir"),
    Api("load_config nested", lambda t: _load_config(t / "cfg-nested.json"), V, "cfg-nested.json"),
    Api("load_config zero list", lambda t: _load_config({"zero_optimization": [1]}), V, "zero_optimization"),
    Api("load_config zero str", lambda t: _load_config({"zero_optimization": "3"}), V, "zero_optimization"),
    Api("load_config stage -1", lambda t: _load_config({"zero_optimization": {"stage": -1}}), V, "stage"),
    Api("load_config stage true", lambda t: _load_config({"zero_optimization": {"stage": True}}), V, "stage"),
    Api(
        "load_config inf",
        lambda t: _load_config({"dyn_plugin": {"cluster": {"latency_us": float("inf")}}}),
        V,
        "latency_us",
    ),
    Api("load_config 2**70", lambda t: _load_config({"dyn_plugin": {"loader": {"planners": 2**70}}}), V, "planners"),
    Api("load_config not a mapping", lambda t: _load_config(42), V, "42"),
    Api("load_model_config dir", lambda t: _model(t / "adir"), V, "adir"),
    Api("load_model_config list", lambda t: _model(t / "model-list.json"), V, "model-list.json"),
    Api("load_model_config broken", lambda t: _model(t / "broken.json"), V, "broken.json"),
    Api("load_profile missing", lambda t: _profile(t / "nope.json"), FileNotFoundError, "nope.json"),
    Api("load_profile dir", lambda t: _profile(t / "adir"), V, "adir"),
    Api("load_profile broken", lambda t: _profile(t / "broken.json"), V, "broken.json"),
    Api("load_profile nested", lambda t: _profile(t / "nested.json"), V, "nested.json"),
    Api("global_batches tokens 0", lambda t: _batches(tokens=0), V, "tokens"),
    Api("global_batches count 2**63", lambda t: _batches(count=2**63), V, "count"),
    Api("planner_spec dp 0", lambda t: _spec(t, dp=0), V, "dp"),
    Api("planner_spec dp -1", lambda t: _spec(t, dp=-1), V, "dp"),
    Api("planner_spec dp 2**63", lambda t: _spec(t, dp=2**63), V, "dp"),
    Api("planner_spec tp 0", lambda t: _spec(t, tp=0), V, "tp"),
    Api("planner_spec zero 5", lambda t: _spec(t, zero_stage=5), V, "zero_stage"),
    Api("DynLoader stage -1", lambda t: _loader(t, stage=-1), V, "stage"),
    Api("DynLoader column 3", lambda t: _loader(t, column=3), V, "column"),
    Api("RankLayout tp 0", lambda t: _layout(tp=0), V, "tensor-parallel size of 0"),
    Api("RankLayout tp 3 of 4 ranks", lambda t: _layout(world=4, tp=3), V, "launch a multiple of 3 ranks"),
    Api("DynLoader replica -1", lambda t: _loader(t, replica=-1), V, "replica"),
    Api("DynLoader seed -1", lambda t: _loader(t, seed=-1), V, "seed"),
    Api("DynLoader zero_stage 9", lambda t: _loader(t, zero_stage=9), V, "zero_stage"),
    Api("DynLoader lengths []", lambda t: _loader(t, lengths=[]), V, "lengths"),
    Api("DynLoader lengths 2**64", lambda t: _loader(t, lengths=[1, 2, 2**64]), V, "lengths[2]"),
    Api("DynLoader dataset shorter", lambda t: _loader(t, dataset=[0]), V, "dataset"),
    Api("DynLoader bad config", lambda t: _loader(t, config={"zero_optimization": [1]}), V, "zero_optimization"),
    Api("DynLoader config dir", lambda t: _loader(t, config=t / "adir"), V, "adir"),
    Api("DynLoader state_bytes -1", lambda t: _loader(t, state_bytes=-1.0), V, "state_bytes"),
]


def _alarm(signum, frame):
    raise TookTooLong(f"still running after {ROW_SECONDS} s: the input was not refused before work started")


@pytest.fixture
def deadline():
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ROW_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _one_clear_line(text: str, needle: str) -> None:
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert needle.lower() in lines[0].lower(), f"{needle!r} not named in: {lines[0]}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.argv or "(nothing)") for c in CLI])
def test_cli_refuses_bad_input(case: Cli, files: Path, capsys, deadline) -> None:
    argv = [a.replace("{t}", str(files)) for a in case.argv.split()]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}\nstdout: {out}\nstderr: {err}"
    _one_clear_line(err, case.needle.replace("{t}", str(files)))
    assert "Traceback" not in out


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in API])
def test_api_refuses_bad_input(case: Api, files: Path, deadline) -> None:
    with pytest.raises(case.error) as info:
        case.call(files)
    _one_clear_line(str(info.value), case.needle)


def test_the_table_is_large_enough() -> None:
    assert len(CLI) + len(API) >= 150


def test_debug_shows_the_traceback(files: Path, capsys) -> None:
    assert main(["--debug", "analyze", str(files / "neg.npy")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "neg.npy" in err.splitlines()[-1]
