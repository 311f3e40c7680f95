"""One rank of the pipeline engine's DeepSpeed entry points (pp=2): ``train_batch(data_iter=...)``,
``eval_batch`` forward-only, a refusal of data that is not the loader's, in the precision given
as argv[2] ("fp32" or "bf16")."""

import itertools
import sys

import torch
import torch.distributed as dist

import deepspeed_ext

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402

from ds_exact_worker import LR, MODEL, random_dataset  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from ranks import finish  # noqa: E402


def main():
    out, dtype = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    lengths, data = random_dataset(2)
    torch.manual_seed(0)
    model = build_causal_lm({**MODEL, "num_hidden_layers": 3})
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
        "dyn_plugin": {
            "microbatching": {"layout": "packed", "global_tokens": 1500, "max_seq_len": 256, "recompute": "none"},
            "pipeline": {"stages": 2},
            "cluster": {"device": {"memory_mb": 4, "memory_fraction": 1.0}},
            "cost_model": {"kind": "analytic"},  # its dtype follows DeepSpeed's
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        seed=5,
    )
    received = []
    batched = dist.batch_isend_irecv

    def recording(ops):  # the dtype of every tensor a stage receives
        received.extend(str(op.tensor.dtype) for op in ops if op.op is dist.irecv)
        return batched(ops)

    dist.batch_isend_irecv = recording
    steps = list(itertools.islice(loader, 2))
    before = [p.detach().clone() for p in engine.module.parameters()]
    eval_loss = engine.eval_batch(iter(steps[:1]))
    unchanged = all(torch.equal(p.detach(), q) for p, q in zip(engine.module.parameters(), before))
    train_loss = engine.train_batch(data_iter=iter(steps))  # DeepSpeed's way: the next step of an iterator
    moved = any(not torch.equal(p.detach(), q) for p, q in zip(engine.module.parameters(), before))
    second = engine.train_batch(steps[1])
    try:
        engine.train_batch(data_iter=iter([{"input_ids": torch.zeros(1, 8, dtype=torch.long)}]))
        refused = ""
    except TypeError as e:
        refused = str(e)
    flags = torch.tensor([float(unchanged), float(moved)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(set(received)))
    finish(
        {
            "eval_loss": eval_loss,
            "train_loss": train_loss,
            "second_loss": second,
            "eval_left_params": bool(flags[0]),
            "train_moved_params": bool(flags[1]),
            "refused": refused,
            "received_dtypes": gathered,
            "act_dtype": str(engine._act_dtype()),
            "micro_batches": len(steps[0].plan.micro_batches),
        },
        out,
    )


if __name__ == "__main__":
    main()
