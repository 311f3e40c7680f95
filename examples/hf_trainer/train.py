"""Fine-tune a tiny Llama with the Hugging Face ``Trainer`` on the plugin's micro-batches (CPU ranks, or one GPU each).

    torchrun --nproc_per_node=2 examples/hf_trainer/train.py --steps 20

A ``Trainer`` script as people write it (``TrainingArguments(deepspeed=...)``, ``trainer.train()``),
with two changes: the DeepSpeed config has a ``dyn_plugin`` section, and the class is
``DynPluginTrainer`` (for a subclass such as TRL's ``SFTTrainer``: ``class MyTrainer(DynPluginTrainerMixin,
SFTTrainer)``). Checkpoints carry the loader's position: ``--resume`` continues where the newest whole
one left off.
"""

import argparse
import os

import torch
from transformers import TrainingArguments

import deepspeed_ext
from deepspeed_ext.hf_trainer import DynPluginTrainer
from dyn_plugin.bench.train_common import tokenized_corpus
from dyn_plugin.models.hf import build_causal_lm, load_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="out/hf-trainer", help="the Trainer's output_dir (checkpoints every 10 steps)")
    p.add_argument("--data", default="out/example-data", help="folder where rank 0 caches the token ids")
    p.add_argument("--resume", action="store_true", help="resume from the newest whole checkpoint in --out")
    args = p.parse_args()
    deepspeed_ext.skip_cpu_shm_build()  # on CPU, gloo does the collectives: no shared-memory op to compile
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    # your model and your data: a tiny Llama (random weights), token ids of real code
    torch.manual_seed(0)
    model = build_causal_lm(load_model_config("tiny-llama"))
    os.makedirs(args.data, exist_ok=True)
    docs, lengths = tokenized_corpus("code", 4096, args.data)
    dataset = [{"input_ids": ids} for ids in docs]

    ds_config = {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "dyn_plugin": {  # the plugin's section: a global batch of 16,384 tokens, planned per step
            "microbatching": {"global_tokens": 16384, "max_seq_len": 4096},
            "cluster": {"device": {"memory_mb": 8000}},
        },
    }
    training = TrainingArguments(
        output_dir=args.out,
        deepspeed=ds_config,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=10,
        include_num_input_tokens_seen="non_padding",
        report_to=[],
    )
    trainer = DynPluginTrainer(model=model, args=training, train_dataset=dataset, lengths=lengths)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    torch.distributed.destroy_process_group()
    os._exit(0)  # DeepSpeed sometimes aborts in its exit handlers on CPU


if __name__ == "__main__":
    main()
