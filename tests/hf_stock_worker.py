"""The stock ``Trainer`` (no plugin, no DeepSpeed, one process) trained on given global batches: the
reference of tests/test_hf_trainer.py. ``hf_stock_worker.py BATCHES OUT``: BATCHES a JSON list of
global batches (dataset indices of ``token_mean.random_dataset(0)``), each trained as one padded
batch by the stock loop (its ``num_items_in_batch`` token mean, SGD, a constant rate, no clipping);
OUT receives the parameters after each step (``torch.save``)."""

import json
import sys
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from dyn_plugin.models.hf import build_causal_lm
from token_mean import LR, MODEL, random_dataset


def padded(items: list[dict]) -> dict:
    """One item, one global batch: its documents right-padded, the padding not scored."""
    docs = items[0]["docs"]
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = torch.as_tensor(d)
        mask[i, : len(d)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Snapshots(TrainerCallback):
    def __init__(self, model) -> None:
        self.model, self.after = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append([p.detach().clone() for p in self.model.parameters()])


def main() -> None:
    batches, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    _, data = random_dataset(0)
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    steps = [{"docs": [data[i]["input_ids"] for i in batch]} for batch in batches]
    snapshots = Snapshots(model)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            use_cpu=True,
            max_steps=len(steps),
            per_device_train_batch_size=1,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            optim="sgd",
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            save_strategy="no",
            report_to=[],
        )
        Trainer(model=model, args=args, train_dataset=steps, data_collator=padded, callbacks=[snapshots]).train()
    torch.save(snapshots.after, out)


if __name__ == "__main__":
    main()
