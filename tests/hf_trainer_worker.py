"""One rank of the ``Trainer`` exactness test: ``DynPluginTrainer`` (DeepSpeed ZeRO ``argv[2]``, fp32,
SGD, a constant learning rate, no clipping; bf16 with ``$HF_TRAINER_DTYPE`` = bf16) trains a tiny Llama on planned global batches; after
every optimizer step its parameters are compared with the single-process token-mean reference
trained on the same global batch (run as a script: ``hf_trainer_worker.py OUT ZERO STEPS [SAVE_DIR
[RESUME]]``: with SAVE_DIR it saves a checkpoint every 2 steps there, with RESUME it resumes from that
checkpoint of SAVE_DIR, "newest": ``resume_from_checkpoint=True``; rank 0 writes the final
parameters beside OUT, and those after each step). ``$HF_TRAINER`` = sft: TRL's
``SFTTrainer`` with the plugin's mixin instead."""

import copy
import glob
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

from deepspeed_ext.hf_trainer import LOADER_FILE, DynPluginTrainerMixin  # noqa: E402
from dyn_plugin.atomic import write_json_atomic  # noqa: E402
from dyn_plugin.jsonfile import read_json  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from kill_harness import KillSwitch  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, MODEL, global_samples, random_dataset, reference  # noqa: E402


class Observing:
    """Around the plugin's Trainer (or a subclass with its mixin): each step compared with the
    reference as it ends."""

    def __init__(self, *args, ref, data, **kwargs):
        super().__init__(*args, **kwargs)
        self.ref, self.data, self.records = ref, data, []
        self.after: list[list[torch.Tensor]] = []  # the parameters after each step
        self.evaluations: list[dict] = []
        self.consumed: list = []  # (position, sample ids) of every step trained, carried by checkpoints

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Each evaluation's loss beside the reference's token mean over the evaluation set."""
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        samples = [item["input_ids"] for item in self.eval_dataset]
        with torch.no_grad():
            want = _token_mean(self.ref, samples)
        self.evaluations.append({"step": self.state.global_step, "loss": metrics["eval_loss"], "want": want})
        return metrics

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        ids = global_samples(inputs, dist.get_world_size())
        self.consumed.append([self.state.global_step, ids])  # before the Trainer counts this step
        samples = [self.data[i]["input_ids"] for i in ids]
        slots = torch.tensor(sum(int(m["input_ids"].numel()) for m in inputs.micro_batches))
        dist.all_reduce(slots)
        with torch.no_grad():
            want = _token_mean(self.ref, samples)
        reference(self.ref, samples, LR)
        mine = list(self.accelerator.unwrap_model(self.model).parameters())
        with deepspeed.zero.GatheredParameters(mine):  # ZeRO-3 holds a shard of each parameter
            diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(mine, self.ref.parameters()))
            self.after.append([p.detach().clone() for p in mine])
        self.records.append(
            {
                "ids": ids,
                "micro_batches": len(inputs.micro_batches),
                "padding": 1 - sum(len(x) for x in samples) / int(slots),
                "layouts": sorted({d.layout for d in inputs.loaded}),
                "loss": float(loss),
                "want": want,
                "max_abs_diff": diff,
                "partitioned": any(hasattr(p, "ds_id") for p in mine),  # ZeRO-3's parameters
            }
        )
        return loss


CONSUMED = "consumed.json"  # in each checkpoint folder: every step trained until it
SWITCH = KillSwitch(int(os.environ.get("RANK", "0")))


class Consumed(Trainer):
    """What every step trained (position, sample ids), kept inside each checkpoint with the Trainer's
    files (after them, before the loader's position: it comes below the plugin's mixin), so a resumed
    run carries the history of the steps its checkpoint holds; ``commit`` kills land after it."""

    consumed: list

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            write_json_atomic(os.path.join(self._checkpoint_folder(trial), CONSUMED), self.consumed)
        SWITCH.hit("commit")

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.consumed = read_json(os.path.join(checkpoint, CONSUMED), "the steps trained")

    def _checkpoint_folder(self, trial):
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")


class Killed:
    """``$KILL`` (kill_harness.py): SIGKILL at startup, in a forward, inside a save (a file half
    written), between the Trainer's files and the loader's position (``commit``), or after a save."""

    def _save_checkpoint(self, model, trial):
        with SWITCH.saving():
            super()._save_checkpoint(model, trial)


class Observed(Killed, Observing, DynPluginTrainerMixin, Consumed):
    """The plugin's Trainer (DynPluginTrainer's bases, with the consumed log below the mixin)."""


def sft_trainer(**kwargs):
    """TRL's SFTTrainer with the plugin's mixin, on the already tokenized dataset (TRL keeps its
    ``input_ids``), with a word-level tokenizer of the tiny model's vocabulary."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from deepspeed_ext.hf_trainer import DynPluginTrainerMixin

    class ObservedSFT(Observing, DynPluginTrainerMixin, SFTTrainer):
        pass

    vocab = {str(i): i for i in range(MODEL["vocab_size"])}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="0")), pad_token="0", eos_token="1"
    )
    args = SFTConfig(**kwargs.pop("args").to_dict() | {"max_length": None, "dataset_text_field": "text"})

    def tokenized(items):
        return Dataset.from_list([{"input_ids": [int(t) for t in item["input_ids"]]} for item in items])

    held_out = tokenized(kwargs.pop("eval_dataset"))
    return ObservedSFT(
        args=args, train_dataset=tokenized(kwargs["data"]), eval_dataset=held_out, processing_class=tokenizer, **kwargs
    )


def _token_mean(model, samples) -> float:
    total, loss = 0, 0.0
    for s in samples:
        ids = torch.as_tensor(s).unsqueeze(0)
        labels = ids.clone()
        labels[0, 0] = -100
        loss += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * (len(s) - 1)
        total += len(s) - 1
    return loss / total


def main():
    out, zero, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    save_dir = sys.argv[4] if len(sys.argv) > 4 else None
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    lengths, data = random_dataset(0)
    _, held_out = random_dataset(1)
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    ref = copy.deepcopy(model)
    config = {
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "dyn_plugin": {
            "microbatching": {"global_tokens": 1500, "max_seq_len": 256, "recompute": "none"},
            # a small device: the plan cuts each global batch into several micro-batches
            "cluster": {"device": {"memory_mb": 2, "memory_fraction": 1.0}},
            "cost_model": {"kind": "analytic"},
            # resumes compared bit for bit with the uninterrupted run: plans from the profile alone
            "calibration": {"enabled": save_dir is None},
        },
    }
    bf16 = os.environ.get("HF_TRAINER_DTYPE") == "bf16"
    if bf16:  # the precision from the arguments: DeepSpeed's "auto" filled by TrainingArguments(bf16=True)
        config["bf16"] = {"enabled": "auto"}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=save_dir or tmp,
            deepspeed=config,
            use_cpu=True,
            max_steps=steps,
            learning_rate=LR,
            optim="sgd",  # under DeepSpeed the Trainer builds its own optimizer (a passed one is dropped)
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            per_device_train_batch_size=1,
            logging_steps=1,
            save_strategy="steps" if save_dir else "no",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            eval_on_start=not resume,
            include_num_input_tokens_seen="non_padding",
            report_to=[],
            seed=0,
            bf16=bf16,
        )
        if os.environ.get("HF_TRAINER") == "sft":
            trainer = sft_trainer(model=model, args=args, ref=ref, data=data, eval_dataset=held_out)
        else:
            trainer = Observed(model=model, args=args, train_dataset=data, eval_dataset=held_out, ref=ref, data=data)
        if resume == "auto":  # the kill tests' relaunches: from the newest whole checkpoint, if one was saved
            resume = (
                "newest"
                if any(os.path.exists(f"{c}/{LOADER_FILE}") for c in glob.glob(f"{save_dir}/checkpoint-*"))
                else None
            )
        SWITCH.arm_model(model)
        SWITCH.arm_saves()
        SWITCH.hit("startup")
        result = trainer.train(resume_from_checkpoint=True if resume == "newest" else resume and f"{save_dir}/{resume}")
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if dist.get_rank() == 0:
            torch.save([p.detach() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()], f"{out}.pt")
            torch.save(trainer.after, f"{out}.steps.pt")
    report = {"steps": trainer.records, "global_step": result.global_step, "logged": logged}
    report |= {
        "evaluations": trainer.evaluations,
        "consumed": trainer.consumed,
        "padding": [h["padding"] for h in trainer.state.log_history if "loss" in h],
    }
    report |= {"tokens_seen": trainer.state.num_input_tokens_seen, "lengths": [int(n) for n in lengths]}
    report |= {"flos": trainer.state.total_flos, "parameters": sum(p.numel() for p in ref.parameters())}
    # the precision DeepSpeed trained in, and the one the plans were priced in
    report |= {"trained_dtype": str(next(trainer.model_wrapped.module.parameters()).dtype)}
    report |= {"planned_dtype": trainer.get_train_dataloader().context.cost.dtype}
    finish(report, out)


if __name__ == "__main__":
    main()
