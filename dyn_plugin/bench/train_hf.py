"""Train a Llama with the Hugging Face ``Trainer`` under DeepSpeed, four ways side by side, on real code.

    torchrun --nproc_per_node=2 -m dyn_plugin.bench.train_hf --profile out/profile.json --out out/train-hf

(``dynplugin bench train --host hf-trainer`` launches it.) Modes, each the same model from the same
initial weights, DeepSpeed ZeRO-1, AdamW, on the Python standard library's source:

- padded: the stock ``Trainer``, ``train_sampling_strategy="group_by_length"`` (batches of similar
  lengths, padded to the longest), as many sequences a device as fit the maximum length in the
  global batch's tokens;
- trl_packing: TRL's ``SFTTrainer`` with ``packing=True`` (best-fit packing into rows of the
  maximum length, padding-free: what these users pick today), rows a device as above;

the baselines train the documents the plugin's plans trained in its steps, each once, in batches
of their own (``group_by_length`` would otherwise put the longest documents first: a few steps of
them measure no mix);
- dyn_plugin: the plugin through the ``Trainer`` (``deepspeed_ext.hf_trainer.DynPluginTrainer``);
- dyn_plugin_loop: the plugin's own loop (``deepspeed_ext.initialize`` and ``train_step``) on the
  same plans: what the ``Trainer`` costs.

Each optimizer step is timed from a barrier before it to a barrier after it (DeepSpeed steps inside
the ``Trainer``'s training step); effective tokens/s counts non-padding tokens. Rank 0 prints the
table and writes report.md, report.png and records.jsonl (``train_common.finish_batchings``).
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from ..device import rank_device
from ..models.hf import build_causal_lm, load_model_config
from .train_common import (
    add_model_argument,
    batchings_preamble,
    common_parser,
    cost_model_section,
    finish_batchings,
    step_record,
    synchronize,
    tokenized_corpus,
)
from .train_deepspeed import device_memory_mb, precision_section, run_mode, start_rank

MODES = ("padded", "trl_packing", "dyn_plugin", "dyn_plugin_loop")
BASELINES = ("padded", "trl_packing", "dyn_plugin_loop")
LR = 1e-3


class _Timed:
    """A ``Trainer`` whose optimizer steps are timed and counted (real tokens, token slots) over
    every rank, after ``warmup`` steps; ``counts(inputs)`` gives this rank's (real, slots)."""

    def __init__(self, *args, mode: str, warmup: int, counts, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode, self.warmup, self.counts, self.records = mode, warmup, counts, []
        self.trained: list[int] = []  # the plan's documents, every rank's (dyn_plugin)

    def training_step(self, model, inputs, num_items_in_batch=None):
        device = self.args.device
        counts = self.counts(inputs)
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        synchronize(device)
        dist.barrier()
        ms = (time.perf_counter() - t0) * 1e3
        # the stock Trainer returns each rank's share of the global token mean, scaled by the ranks
        # (DeepSpeed averages the gradients): their mean is the global batch's token-mean loss
        summed = torch.tensor([*counts, float(loss) / dist.get_world_size()], dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        n = self.state.global_step
        if self.mode == "dyn_plugin":
            mine = [i for ids in inputs.sample_ids for i in ids]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            self.trained += sorted({i for ids in every for i in ids})
        if n >= self.warmup:
            real, slots, mean = summed.tolist()
            step = inputs if self.mode == "dyn_plugin" else _NoPlan()
            self.records.append(step_record(self.mode, n, step, ms, real, slots, mean))
        return loss


class _NoPlan:
    """A step of a baseline: no plan, no prediction."""

    predicted_ms = None
    micro_batches = (None,)


def _padded_counts(inputs) -> tuple[float, float]:
    return float(inputs["attention_mask"].sum()), float(inputs["input_ids"].numel())


def _packed_counts(inputs) -> tuple[float, float]:
    tokens = float(inputs["input_ids"].numel())  # padding-free rows: every slot a token
    return tokens, tokens


def _plan_counts(step) -> tuple[float, float]:
    real = sum(sum(d.seq_lens) for d in step.loaded)
    return float(real), float(sum(m["input_ids"].numel() for m in step.micro_batches))


def _pad_collator(batch: list[dict]) -> dict:
    """The stock Trainer's batch: right-padded to the longest, labels -100 on the padding."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.as_tensor(b["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's ids (TRL wants one; the data is already token ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="0")), pad_token="0")


def run_trainer(mode: str, args, docs, lengths, dtype: str, out: str, subset: list[int]) -> tuple[list[dict], list]:
    """One of the Trainer modes: its timed records and (dyn_plugin) the documents its plans trained.
    The baselines train ``subset`` (those documents) once, in batches of their own making."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    rows = max(1, args.global_tokens // (dist.get_world_size() * args.max_len))
    config = {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        **precision_section(dtype),
    }
    if mode == "dyn_plugin":
        config["dyn_plugin"] = {
            "cost_model": cost_model_section(args.profile, dtype),
            "microbatching": {"global_tokens": args.global_tokens, "max_seq_len": args.max_len},
            "cluster": {
                "devices_per_node": dist.get_world_size(),
                "device": {"memory_mb": device_memory_mb(rank_device())},
            },
        }
    planned = mode == "dyn_plugin"
    data = [{"input_ids": [int(t) for t in docs[i]]} for i in (range(len(docs)) if planned else subset)]
    # a baseline covers the plan's documents once: as many steps as its rows a step take
    steps = args.warmup + args.steps if planned else -(-len(data) // (rows * dist.get_world_size()))
    if mode == "trl_packing":
        steps = -(-sum(len(d["input_ids"]) for d in data) // (rows * dist.get_world_size() * args.max_len))
    common = dict(
        output_dir=out,
        deepspeed=config,
        use_cpu=not torch.cuda.is_available(),
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        max_steps=steps,
        # as the plugin's own loop steps (train_deepspeed.run_mode: torch's AdamW, lr 1e-3, its default weight
        # decay, no clipping, a constant rate), so that only the loop around the steps differs
        learning_rate=LR,
        optim="adamw_torch",
        weight_decay=0.01,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        per_device_train_batch_size=rows,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=dist.get_rank() != 0,
        seed=args.seed,
    )
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config(args.model))
    timing = dict(mode=mode, warmup=args.warmup)
    if mode == "padded":

        class Padded(_Timed, Trainer):
            pass

        trainer = Padded(
            model=model,
            args=TrainingArguments(**common, train_sampling_strategy="group_by_length", remove_unused_columns=False),
            train_dataset=data,
            data_collator=_pad_collator,
            counts=_padded_counts,
            **timing,
        )
    elif mode == "trl_packing":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        class Packing(_Timed, SFTTrainer):
            pass

        trainer = Packing(
            model=model,
            args=SFTConfig(**common, packing=True, max_length=args.max_len),
            train_dataset=Dataset.from_list(data),
            processing_class=_tokenizer(model.config.vocab_size),
            counts=_packed_counts,
            **timing,
        )
    else:
        from deepspeed_ext.hf_trainer import DynPluginTrainer

        class Planned(_Timed, DynPluginTrainer):
            pass

        trainer = Planned(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            lengths=lengths,
            counts=_plan_counts,
            **timing,
        )
    trainer.train()
    trainer.accelerator.free_memory()
    trainer.model_wrapped.destroy()  # DeepSpeed's engine: its ZeRO hooks keep it alive otherwise
    AcceleratorState._reset_state(True)  # the next mode's Trainer builds its own DeepSpeed set-up
    return trainer.records, trainer.trained


def main() -> None:
    p = common_parser(__doc__, "out/train-hf", "profile JSON of the model on this machine (dynplugin profile)")
    add_model_argument(p)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    device, dtype = start_rank(args)
    args.stages, args.memory_mb = 1, None  # what train_deepspeed.run_mode reads for the plugin's own loop
    docs, lengths = tokenized_corpus(args.lengths, args.max_len, args.out)
    records, subset = [], None  # subset: the documents the plugin's plans train, which the baselines train
    with tempfile.TemporaryDirectory() as out:
        # the plugin first: the baselines then train the documents its plans trained
        for mode in sorted(args.modes.split(","), key=lambda m: m not in ("dyn_plugin", "dyn_plugin_loop")):
            if mode == "dyn_plugin_loop":
                records += [{**r, "mode": mode} for r in run_mode("dyn_plugin", args, docs, lengths, device, dtype)]
                continue
            if subset is None and mode != "dyn_plugin":  # its mode not run: plan them all the same
                subset = run_trainer("dyn_plugin", args, docs, lengths, dtype, out, [])[1]
            rows, trained = run_trainer(mode, args, docs, lengths, dtype, out, subset or [])
            records += rows
            if mode == "dyn_plugin":
                subset = trained
    if dist.get_rank() == 0:
        preamble = batchings_preamble(
            f"# The Hugging Face Trainer: {args.model}, DeepSpeed ZeRO-1, {dist.get_world_size()} {args.ranks_on}",
            args,
            "padded: the stock Trainer, group_by_length; trl_packing: TRL's SFTTrainer, packing=True (padding-free "
            "rows of the maximum length); dyn_plugin: the plugin through the Trainer; dyn_plugin_loop: the plugin's "
            "own loop on the same plans.",
        )
        finish_batchings(records, MODES, BASELINES, args.out, preamble, budget=args.global_tokens)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # DeepSpeed sometimes aborts in its exit handlers on CPU


if __name__ == "__main__":
    main()
