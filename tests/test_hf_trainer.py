"""The Hugging Face ``Trainer`` on the plugin's plans (``deepspeed_ext/hf_trainer.py``).

On 2 gloo ranks the plugin's ``Trainer`` (DeepSpeed ZeRO 1 and 3, fp32, SGD) trains a tiny Llama
on planned global batches of several micro-batches each; after every optimizer step its parameters
equal the single-process token-mean reference on the same global batch (tests/hf_trainer_worker.py),
and the ``Trainer`` logs that global batch's token-mean loss. What is not built is refused by name.
"""

import json

import pytest
from transformers import TrainingArguments

from deepspeed_ext.hf_trainer import DynPluginTrainer
from dyn_plugin.config import ConfigError
from dyn_plugin.models.hf import build_causal_lm
from ranks import run
from token_mean import MODEL, random_dataset

EXACT = 1e-6
STEPS = 3


@pytest.mark.parametrize("zero", [1, 3])
def test_the_trainers_updates_are_the_token_mean_of_each_planned_global_batch(tmp_path, zero):
    out = tmp_path / "result.json"
    codes, logs = run("hf_trainer_worker.py", out, zero, STEPS, world=2, timeout=400)
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
    ids = [i for s in steps for i in s["ids"]]
    assert len(ids) == len(set(ids))  # each sample once


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

    from deepspeed_ext.hf_trainer import DynPluginTrainerMixin

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
    with pytest.raises(ConfigError, match="resume_from_checkpoint under DynPluginTrainer"):
        DynPluginTrainerMixin.train(mixin({"dyn_plugin": {}}), resume_from_checkpoint="checkpoint-2")
