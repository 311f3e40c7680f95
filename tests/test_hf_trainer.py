"""The Hugging Face ``Trainer`` on the plugin's plans (``deepspeed_ext/hf_trainer.py``).

On 2 gloo ranks the plugin's ``Trainer`` (DeepSpeed ZeRO 1 and 3, fp32, SGD; and TRL's ``SFTTrainer``
with the plugin's mixin) trains a tiny Llama
on planned global batches of several micro-batches each; after every optimizer step its parameters
equal the single-process token-mean reference on the same global batch (tests/hf_trainer_worker.py)
and the stock ``Trainer`` trained on the same global batches (tests/hf_stock_worker.py),
and the ``Trainer`` logs that global batch's token-mean loss. What is not built is refused by name.
"""

import json

import pytest
import torch
from transformers import TrainingArguments

from deepspeed_ext.hf_trainer import LOADER_FILE, DynPluginTrainer, DynPluginTrainerMixin
from dyn_plugin.config import ConfigError
from dyn_plugin.models.hf import build_causal_lm
from ranks import run
from token_mean import MODEL, random_dataset

EXACT = 1e-6
FORWARDS = 30  # a kill point is drawn among the first this many forwards of a launch (about 40 in 6 steps)
STEPS = 4  # an epoch of this data is 3 global batches: the run crosses into the next epoch


# bf16 from the arguments: DeepSpeed keeps bf16 weights (fp32 master copies), whose rounding (2^-8 of
# a weight near 1, the norms') bounds how far they can be from the fp32 reference's
BF16 = 4e-3


@pytest.mark.parametrize(
    "zero, trainer, dtype", [(1, "trainer", "fp32"), (3, "trainer", "fp32"), (1, "sft", "fp32"), (3, "trainer", "bf16")]
)
def test_the_trainers_updates_are_the_token_mean_of_each_planned_global_batch(tmp_path, zero, trainer, dtype):
    """``trainer``: DynPluginTrainer, or TRL's SFTTrainer with DynPluginTrainerMixin first among its bases;
    ``dtype``: the precision TrainingArguments asks for (bf16=True), which DeepSpeed trains in and the
    plans are priced in."""
    out = tmp_path / "result.json"
    env = {"HF_TRAINER": trainer, "HF_TRAINER_DTYPE": dtype}
    codes, logs = run("hf_trainer_worker.py", out, zero, STEPS, world=2, timeout=400, env=env)
    assert codes == [0, 0], logs[0][-4000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert report["planned_dtype"] == dtype
    assert report["trained_dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    bound, rel = (EXACT, 1e-6) if dtype == "fp32" else (BF16, 1e-3)
    assert report["global_step"] == len(steps) == STEPS  # max_steps counts planned global batches
    for s in steps:
        assert s["max_abs_diff"] <= bound, s  # every parameter, after every optimizer step
        assert s["loss"] == pytest.approx(s["want"], rel=rel), s
        assert s["partitioned"] == (zero == 3), s  # ZeRO-3 really sharded the parameters
    assert report["logged"] == pytest.approx([s["loss"] for s in steps], rel=1e-6)  # the Trainer's logged loss
    assert report["padding"] == pytest.approx([s["padding"] for s in steps], abs=1e-4)  # logged per step
    # evaluation through planned batches (eval_on_start, then every 2 steps): the held-out set's token mean
    assert [e["step"] for e in report["evaluations"]] == [0, 2, 4]
    for e in report["evaluations"]:
        assert e["loss"] == pytest.approx(e["want"], rel=rel), e
    assert max(s["micro_batches"] for s in steps) > 1  # the plan cut global batches into several micro-batches
    epoch = [i for s in steps[:3] for i in s["ids"]]
    assert sorted(epoch) == list(range(40))  # the first epoch: every sample once
    # the Trainer's own token count (include_num_input_tokens_seen): the real tokens of the global batches
    assert report["tokens_seen"] == sum(report["lengths"][i] for s in steps for i in s["ids"])
    # the Trainer's FLOPs: 6 per parameter (the whole model's, also where ZeRO-3 shards it) and real token
    assert report["flos"] == 6 * report["parameters"] * report["tokens_seen"]


def test_the_stock_trainer_on_the_same_global_batches_updates_alike(tmp_path):
    """The stock ``Trainer`` (one process, no DeepSpeed) trains each of the plugin run's global batches
    as one padded batch, with its own ``num_items_in_batch`` token mean: after every step its
    parameters are the plugin's (2 ranks, ZeRO-1, several micro-batches a step) within 1e-6."""
    out = tmp_path / "plugin.json"
    codes, logs = run("hf_trainer_worker.py", out, 1, STEPS, world=2, timeout=400)
    assert codes == [0, 0], logs[0][-4000:]
    batches = [s["ids"] for s in json.loads(out.read_text())["steps"]]
    (tmp_path / "batches.json").write_text(json.dumps(batches))
    codes, logs = run("hf_stock_worker.py", tmp_path / "batches.json", tmp_path / "stock.pt", world=1, timeout=400)
    assert codes == [0], logs[0][-4000:]
    plugin, stock = torch.load(f"{out}.steps.pt"), torch.load(tmp_path / "stock.pt")
    assert len(plugin) == len(stock) == STEPS
    for mine, theirs in zip(plugin, stock):
        assert max(float((a - b).abs().max()) for a, b in zip(mine, theirs)) <= EXACT


def test_a_resume_from_a_trainer_checkpoint_is_the_uninterrupted_run(tmp_path):
    """Checkpoints every 2 steps; a second run resumed from checkpoint-2 trains the global batches the
    uninterrupted run trained after it (the loader's position restored, crossing the epoch's end
    alike) and ends with its parameters and its logged losses, bit for bit."""
    ckpt = tmp_path / "ckpt"
    codes, logs = run("hf_trainer_worker.py", tmp_path / "whole.json", 1, STEPS, ckpt, world=2, timeout=400)
    assert codes == [0, 0], logs[0][-4000:]
    assert (ckpt / "checkpoint-2" / LOADER_FILE).exists()
    codes, logs = run("hf_trainer_worker.py", tmp_path / "resumed.json", 1, STEPS, ckpt, "checkpoint-2", world=2)
    assert codes == [0, 0], logs[0][-4000:]
    whole, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "resumed"))
    assert [s["ids"] for s in resumed["steps"]] == [s["ids"] for s in whole["steps"]][2:]
    assert resumed["global_step"] == whole["global_step"] == STEPS
    assert resumed["logged"] == whole["logged"]
    final = [torch.load(tmp_path / f"{n}.json.pt") for n in ("whole", "resumed")]
    assert all(torch.equal(a, b) for a, b in zip(*final))


def test_a_run_killed_while_saving_resumes_from_the_newest_whole_checkpoint(tmp_path):
    """Every rank SIGKILLed inside the save of step 4's checkpoint (the Trainer's files written, the
    loader's position not): relaunched with ``resume_from_checkpoint=True`` it resumes from
    checkpoint-2, trains steps 3 to 6 as the uninterrupted run did, and ends with its parameters, bit
    for bit; nothing trained twice within an epoch, nothing skipped."""
    steps, ckpt, whole = 6, tmp_path / "ckpt", tmp_path / "whole"
    codes, logs = run("hf_trainer_worker.py", tmp_path / "whole.json", 1, steps, whole, world=2, timeout=400)
    assert codes == [0, 0], logs[0][-4000:]
    kill = {"KILL": "commit:2@all"}  # the second save (step 4's): the Trainer's files written, the loader's not
    codes, _ = run("hf_trainer_worker.py", tmp_path / "killed.json", 1, steps, ckpt, world=2, env=kill, timeout=400)
    assert codes == [-9, -9]
    assert (ckpt / "checkpoint-4").exists() and not (ckpt / "checkpoint-4" / LOADER_FILE).exists()
    codes, logs = run("hf_trainer_worker.py", tmp_path / "resumed.json", 1, steps, ckpt, "newest", world=2)
    assert codes == [0, 0], logs[0][-4000:]
    assert "checkpoint-4 was not saved whole" in logs[0]
    reference, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "resumed"))
    assert [s["ids"] for s in resumed["steps"]] == [s["ids"] for s in reference["steps"]][2:]
    final = [torch.load(tmp_path / f"{n}.json.pt") for n in ("whole", "resumed")]
    assert all(torch.equal(a, b) for a, b in zip(*final))


def test_a_checkpoint_without_the_loaders_position_is_refused(tmp_path):
    class Restoring:
        def _load_optimizer_and_scheduler(self, checkpoint):
            pass

    class Trainer(DynPluginTrainerMixin, Restoring):
        pass

    trainer = Trainer.__new__(Trainer)
    with pytest.raises(ConfigError, match=f"has no {LOADER_FILE}: the save was interrupted"):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


def test_a_model_with_frozen_weights_is_refused_before_planning():
    """PEFT/LoRA freeze the base weights: the cost model would price their gradients and states."""
    from types import SimpleNamespace

    _, data = random_dataset(0)
    model = build_causal_lm(MODEL)
    model.model.embed_tokens.weight.requires_grad_(False)
    trainer = DynPluginTrainerMixin.__new__(DynPluginTrainerMixin)
    trainer.accelerator, trainer.model = SimpleNamespace(unwrap_model=lambda m: m), model
    trainer.train_dataset, trainer._dyn_lengths, trainer._dyn_checked = data, None, None
    with pytest.raises(ConfigError, match=r"1 frozen parameters \(model.embed_tokens.weight, ...\).*PEFT/LoRA"):
        trainer._build_loader()


def test_an_encoder_decoder_is_refused_before_planning():
    """Its items are (input, target) pairs: planned as one sequence each, they would be planned wrong."""
    from types import SimpleNamespace

    from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm

    model = build_seq2seq_lm(PRESETS["tiny-t5"])
    trainer = DynPluginTrainerMixin.__new__(DynPluginTrainerMixin)
    trainer.accelerator, trainer.model = SimpleNamespace(unwrap_model=lambda m: m), model
    trainer.train_dataset, trainer._dyn_lengths = [{"input_ids": [1, 2], "labels": [3]}], None
    trainer._dyn_checked = None
    with pytest.raises(ConfigError, match="is an encoder-decoder: it trains on \\(input, target\\) pairs"):
        trainer._build_loader()


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", **kwargs)


def test_what_is_not_built_is_refused_by_name(tmp_path):
    _, data = random_dataset(0)
    model = build_causal_lm(MODEL)
    with pytest.raises(ConfigError, match=r"TrainingArguments\(deepspeed=\.\.\.\)"):
        DynPluginTrainer(model=model, args=_args(tmp_path), train_dataset=data)


def test_a_trainer_without_the_plugins_section_or_with_accumulation_is_refused():
    """The checks read the Trainer's processed DeepSpeed config; they run before any engine is built."""
    from types import SimpleNamespace

    def mixin(config: dict, accumulation: int = 1, metrics=None):
        trainer = DynPluginTrainerMixin.__new__(DynPluginTrainerMixin)
        trainer.compute_metrics = metrics
        trainer.args = SimpleNamespace(
            hf_deepspeed_config=SimpleNamespace(config=config), gradient_accumulation_steps=accumulation
        )
        return trainer

    with pytest.raises(ConfigError, match="has no 'dyn_plugin' section"):
        mixin({"zero_optimization": {"stage": 1}})._plugin_config()
    with pytest.raises(ConfigError, match="gradient_accumulation_steps = 4: .*set it to 1"):
        mixin({"dyn_plugin": {}}, accumulation=4)._plugin_config()
    with pytest.raises(ConfigError, match="pipeline.stages = 2 under the Trainer"):
        mixin({"dyn_plugin": {"pipeline": {"stages": 2}}})._plugin_config()
    with pytest.raises(ConfigError, match="compute_metrics: DynPluginTrainer evaluates through planned batches"):
        mixin({"dyn_plugin": {}}, metrics=lambda p: {})._plugin_config()
    with pytest.raises(ConfigError, match="sequence_parallel.enabled under the Trainer"):
        mixin({"dyn_plugin": {"sequence_parallel": {"enabled": True}}})._plugin_config()
    cfg = mixin({"zero_optimization": {"stage": 1}, "dyn_plugin": {}})._plugin_config()
    assert cfg.zero_stage == 1 and "dyn_plugin" not in cfg.deepspeed  # DeepSpeed's own keys, handed on


def test_evaluation_without_the_training_engine_or_with_predictions_is_refused():
    """The plugin evaluates the token-mean loss on the training engine: before ``train()`` there is none
    (``eval_on_start`` evaluates on it), and predictions are not kept."""
    from types import SimpleNamespace

    trainer = DynPluginTrainerMixin.__new__(DynPluginTrainerMixin)
    trainer.args, trainer.deepspeed = SimpleNamespace(prediction_loss_only=False), None
    with pytest.raises(ConfigError, match=r"Prediction: .*keeps no predictions; set prediction_loss_only=True"):
        trainer.evaluation_loop(None, "Prediction")
    with pytest.raises(ConfigError, match=r"evaluate\(\) before train\(\): .*eval_on_start=True"):
        trainer.evaluation_loop(None, "Evaluation", prediction_loss_only=True)


def test_random_kills_through_the_trainer_lose_and_repeat_nothing(tmp_path):
    """The Trainer killed by SIGKILL at random points (startup; during a training or an evaluation
    forward, or between two; inside a save with a file half written; between the Trainer's files and
    the loader's position; after a save) on a random rank or both, and relaunched with
    ``resume_from_checkpoint=True`` from its newest whole checkpoint until a launch finishes: two
    epochs' samples each trained once per epoch, the final parameters the uninterrupted run's, bit
    for bit. The long version is marked slow."""
    assert _kills(tmp_path, kills=2) >= 2


@pytest.mark.slow
def test_many_random_kills_through_the_trainer_lose_and_repeat_nothing(tmp_path):
    assert _kills(tmp_path, kills=12) >= 12


def _kills(tmp_path, kills: int) -> int:
    import shutil
    import time

    from kill_harness import check_exactly_once, train_with_kills
    from ranks import launch

    steps = 6  # two epochs of 3 global batches; a checkpoint every 2 steps
    codes, logs = run("hf_trainer_worker.py", tmp_path / "whole.json", 1, steps, tmp_path / "whole", world=2)
    assert codes == [0, 0], logs[0][-4000:]
    reference = torch.load(tmp_path / "whole.json.pt")
    result, ckpt = tmp_path / "killed.json", tmp_path / "ckpt"

    def fresh() -> None:
        shutil.rmtree(ckpt, ignore_errors=True)
        result.unlink(missing_ok=True)

    def check() -> None:
        check_exactly_once(json.loads(result.read_text())["consumed"], 40, epochs=2)
        final = torch.load(f"{result}.pt")
        assert all(torch.equal(a, b) for a, b in zip(final, reference))

    return train_with_kills(
        lambda env: launch("hf_trainer_worker.py", result, 1, steps, ckpt, "auto", env=env, capture=True),
        fresh=fresh,
        check=check,
        kills=kills,
        seed=time.time_ns() % 2**32,
        world=2,
        forwards=FORWARDS,
        saves=steps // 2,
    )
