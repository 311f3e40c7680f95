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
STEPS = 4  # an epoch of this data is 3 global batches: the run crosses into the next epoch


@pytest.mark.parametrize("zero, trainer", [(1, "trainer"), (3, "trainer"), (1, "sft")])
def test_the_trainers_updates_are_the_token_mean_of_each_planned_global_batch(tmp_path, zero, trainer):
    """``trainer``: DynPluginTrainer, or TRL's SFTTrainer with DynPluginTrainerMixin first among its bases."""
    out = tmp_path / "result.json"
    codes, logs = run("hf_trainer_worker.py", out, zero, STEPS, world=2, timeout=400, env={"HF_TRAINER": trainer})
    assert codes == [0, 0], logs[0][-4000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert report["global_step"] == len(steps) == STEPS  # max_steps counts planned global batches
    for s in steps:
        assert s["max_abs_diff"] <= EXACT, s  # every parameter, after every optimizer step
        assert s["loss"] == pytest.approx(s["want"], rel=1e-6), s
        assert s["partitioned"] == (zero == 3), s  # ZeRO-3 really sharded the parameters
    assert report["logged"] == pytest.approx([s["loss"] for s in steps], rel=1e-6)  # the Trainer's logged loss
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
    kill = {"HF_TRAINER_KILL": "4"}
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
    trainer.train_dataset, trainer._dyn_lengths = data, None
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

    def mixin(config: dict, accumulation: int = 1):
        trainer = DynPluginTrainerMixin.__new__(DynPluginTrainerMixin)
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
    cfg = mixin({"zero_optimization": {"stage": 1}, "dyn_plugin": {}})._plugin_config()
    assert cfg.zero_stage == 1 and "dyn_plugin" not in cfg.deepspeed  # DeepSpeed's own keys, handed on
