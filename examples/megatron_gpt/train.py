"""A short megatron-core training loop (GPTModel + get_forward_backward_func), as in megatron-core's
``examples/run_simple_mcore_train_loop.py``: Llama-style GPT (RMSNorm, grouped-query attention,
SwiGLU, RoPE), an indexed dataset built with Megatron's ``IndexedDatasetBuilder`` and split by
``BlendedMegatronDatasetBuilder``, DDP, Megatron's optimizer and its learning-rate schedule.

It knows nothing of the plugin. Run as it is, it trains on Megatron's fixed-length samples
(documents packed into rows of --seq-length). Run through the plugin's launcher flag and the same
script trains on the plugin's planned micro-batches:

    torchrun --nproc_per_node=2 examples/megatron_gpt/train.py --data out/megatron-data --steps 4
    dynplugin megatron --dyn-plugin-config examples/megatron_gpt/cfg.json --nproc-per-node 2 -- \\
        examples/megatron_gpt/train.py --data out/megatron-data --steps 4

(megatron-core's wheel has no ``megatron.training``, Megatron-LM's ``pretrain_gpt.py`` driver; where
Megatron-LM is installed, run ``pretrain_gpt.py`` through the flag in the same way.)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


class Tokenizer:
    """What ``GPTDataset`` reads of a tokenizer: the vocabulary size, the end-of-document and padding ids
    (distinct, as it checks) and an identity for its index caches."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, 0, vocab_size - 1
        self.unique_identifiers = {"class": "bpe-8192", "vocab_size": vocab_size}


def initialize(tp: int, pp: int, seed: int) -> torch.device:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    return device


def model_provider(args) -> GPTModel:
    config = TransformerConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        ffn_hidden_size=args.ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        recompute_granularity="full" if args.recompute else None,
        recompute_method="uniform" if args.recompute else None,
        recompute_num_layers=1 if args.recompute else None,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=args.vocab,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )


def write_documents(prefix: str, vocab: int, max_len: int) -> None:
    """Real code (the Python standard library, the plugin's bundled BPE) as a Megatron indexed dataset."""
    from dyn_plugin.lengths.corpus import iter_documents
    from dyn_plugin.lengths.tokenizer import get_tokenizer

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for enc in get_tokenizer().encode_batch(list(iter_documents("code"))):
        ids = np.asarray(enc.ids[:max_len], dtype=np.int32) % vocab
        if len(ids) > 1:
            builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(prefix + ".idx")


def datasets(args):
    prefix = os.path.join(args.data, "code")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=Tokenizer(args.vocab),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=os.path.join(args.data, "cache"),
    )
    samples = args.steps * args.micro_batches * dist.get_world_size()

    def build():
        return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()

    if dist.get_rank() == 0:  # rank 0 writes the documents and the index caches, the others read them
        os.makedirs(args.data, exist_ok=True)
        if not os.path.exists(prefix + ".idx"):
            write_documents(prefix, args.vocab, args.seq_length)
        train, _, _ = build()
    dist.barrier()
    if dist.get_rank() != 0:
        train, _, _ = build()
    return train


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device) if first else None
    labels = batch["labels"].to(device) if last else None
    loss_mask = batch["loss_mask"].to(device) if last else None
    packed = None
    if batch.get("cu_seqlens") is not None:  # packed documents (THD), as Megatron-LM's SFT batches carry them
        # Megatron-LM's shapes: cu_seqlens [1, n + 1] (micro-batch size 1), max_seqlen [1]; THD wants [n + 1]
        cu, m = batch["cu_seqlens"].reshape(-1).to(device), int(batch["max_seqlen"][0])
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)
    output = model(
        tokens, batch["position_ids"].to(device), batch.get("attention_mask"), labels=labels, packed_seq_params=packed
    )
    return output, partial(loss_func, loss_mask)


def loss_func(loss_mask, output_tensor):
    """Summed loss over the scored tokens and their count (Megatron's per-token loss)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.detach().float()])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="out/megatron-data", help="folder of the indexed dataset (written if absent)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per step (Megatron's own)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="checkpoint folder written after the last step")
    p.add_argument("--load", help="checkpoint folder to resume from")
    p.add_argument("--records", help="JSON lines: one record per step (rank 0)")
    args = p.parse_args()
    device = initialize(args.tp, args.pp, args.seed)
    torch.manual_seed(args.seed)
    model = model_provider(args).to(device)
    config = model.config
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr,
        max_lr=args.lr,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=10**9,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    train = datasets(args)
    start = 0
    if args.load:
        state = dist_checkpointing.load(model.module.sharded_state_dict(), args.load)
        model.module.load_state_dict(state)
        with open(os.path.join(args.load, "train_state.json")) as f:
            saved = json.load(f)
        start, scheduler.num_steps = saved["iteration"], saved["scheduler_steps"]
        optimizer.load_state_dict(torch.load(os.path.join(args.load, f"optim-{dist.get_rank()}.pt")))
    iterator = iter(torch.utils.data.DataLoader(train, batch_size=1, shuffle=False))
    forward_backward = get_forward_backward_func()
    log = open(args.records, "a") if args.records and dist.get_rank() == 0 else None
    for it in range(start, args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        t0 = time.perf_counter()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterator,
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=args.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        scheduler.step(increment=args.micro_batches * dist.get_world_size() // args.pp // args.tp)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for r in losses:
            total += r["lm loss"].double()
        dist.all_reduce(total)
        ms = (time.perf_counter() - t0) * 1e3
        if dist.get_rank() == 0:
            print(
                f" iteration {it + 1:>4}/{args.steps} | lm loss {float(total[0] / total[1]):.4f} | scored tokens "
                f"{int(total[1]):>6} | samples consumed {scheduler.num_steps:>6} | step {ms:8.1f} ms",
                flush=True,
            )
        if log:
            log.write(
                json.dumps(
                    {
                        "step": it,
                        "loss": float(total[0] / total[1]),
                        "tokens": int(total[1]),
                        "step_ms": ms,
                        "samples_seen": scheduler.num_steps,
                    }
                )
                + "\n"
            )
            log.flush()
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        # the optimizer and the counters before dist_checkpointing.save, which publishes the
        # checkpoint (under the plugin its marker is written last, inside it): a kill in between
        # must not leave a whole-looking checkpoint with old counters (megatron-core warns of the
        # folder being non-empty; the files are ours)
        torch.save(optimizer.state_dict(), os.path.join(args.save, f"optim-{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            with open(os.path.join(args.save, "train_state.json"), "w") as f:
                json.dump({"iteration": args.steps, "scheduler_steps": scheduler.num_steps}, f)
        dist.barrier()
        dist_checkpointing.save(model.module.sharded_state_dict(), args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
