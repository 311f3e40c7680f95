"""One rank of the ``Trainer`` exactness test: ``DynPluginTrainer`` (DeepSpeed ZeRO ``argv[2]``, fp32,
SGD, a constant learning rate, no clipping) trains a tiny Llama on planned global batches; after
every optimizer step its parameters are compared with the single-process token-mean reference
trained on the same global batch (run as a script: ``hf_trainer_worker.py OUT ZERO STEPS [SAVE_DIR
[RESUME]]``: with SAVE_DIR it saves a checkpoint every 2 steps there, with RESUME it resumes from that
checkpoint of SAVE_DIR, "newest": ``resume_from_checkpoint=True``; rank 0 writes the final
parameters beside OUT, and those after each step). ``$HF_TRAINER`` = sft: TRL's
``SFTTrainer`` with the plugin's mixin instead."""

import copy
import os
import signal
import sys
import tempfile

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from deepspeed_ext.hf_trainer import DynPluginTrainer  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from ranks import finish  # noqa: E402
from token_mean import LR, MODEL, global_samples, random_dataset, reference  # noqa: E402


class Observing:
    """Around the plugin's Trainer (or a subclass with its mixin): each step compared with the
    reference as it ends."""

    def __init__(self, *args, ref, data, **kwargs):
        super().__init__(*args, **kwargs)
        self.ref, self.data, self.records = ref, data, []
        self.after: list[list[torch.Tensor]] = []  # the parameters after each step

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        ids = global_samples(inputs, dist.get_world_size())
        samples = [self.data[i]["input_ids"] for i in ids]
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
                "layouts": sorted({d.layout for d in inputs.loaded}),
                "loss": float(loss),
                "want": want,
                "max_abs_diff": diff,
                "partitioned": any(hasattr(p, "ds_id") for p in mine),  # ZeRO-3's parameters
            }
        )
        return loss


class Killed:
    """With ``$HF_TRAINER_KILL`` = N, every rank SIGKILLs itself inside the save of step N's checkpoint,
    once the Trainer has written its files and before the loader's position: a save cut short."""

    def _save_checkpoint(self, model, trial):
        if self.state.global_step != int(os.environ.get("HF_TRAINER_KILL", "0")):
            return super()._save_checkpoint(model, trial)
        Trainer._save_checkpoint(self, model, trial)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


class Observed(Killed, Observing, DynPluginTrainer):
    """The plugin's Trainer."""


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
    train = Dataset.from_list([{"input_ids": [int(t) for t in item["input_ids"]]} for item in kwargs["data"]])
    return ObservedSFT(args=args, train_dataset=train, processing_class=tokenizer, **kwargs)


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
        },
    }
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
            include_num_input_tokens_seen="non_padding",
            report_to=[],
            seed=0,
        )
        if os.environ.get("HF_TRAINER") == "sft":
            trainer = sft_trainer(model=model, args=args, ref=ref, data=data)
        else:
            trainer = Observed(model=model, args=args, train_dataset=data, ref=ref, data=data)
        result = trainer.train(resume_from_checkpoint=True if resume == "newest" else resume and f"{save_dir}/{resume}")
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if dist.get_rank() == 0:
            torch.save([p.detach() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()], f"{out}.pt")
            torch.save(trainer.after, f"{out}.steps.pt")
    report = {"steps": trainer.records, "global_step": result.global_step, "logged": logged}
    report |= {"tokens_seen": trainer.state.num_input_tokens_seen, "lengths": [int(n) for n in lengths]}
    report |= {"flos": trainer.state.total_flos, "parameters": sum(p.numel() for p in ref.parameters())}
    finish(report, out)


if __name__ == "__main__":
    main()
