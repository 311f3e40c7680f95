"""A pipeline stage's plan run instruction by instruction, its point-to-point transfers posted as
the plan batches them: one loop for every host's executor (DeepSpeed's ``PlanPipelineEngine``,
Megatron's ``plan_executor``), which differ only in what they post and compute.

A send or receive the plan batches with the instruction after it (``batch_next``) is posted with it
in one ``dist.batch_isend_irecv``, so nothing relies on a buffered send (NCCL has none;
``check_plans(rendezvous=True)`` proves the plans need none). A batch with a receive completes
before the next instruction that is not a W (a split backward's weight gradients run while the
transfers before them complete); a batch of sends only is waited for at the next exchange or the
step's end, so the forward or backward between runs beside it (on NCCL a wait makes the compute
stream wait for the transfer: waited at once, the next compute would queue behind the send). Each
posted operation's ``done`` runs once it completed: what was received is used, what was sent freed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.distributed as dist

from ..plan.steps.instructions import EXCHANGES, BackwardWeight, Instruction

# a posted operation, and what to do once it has completed
Post = tuple[dist.P2POp, Callable[[], None]]


class Transfers:
    """The batch of transfers last posted, and whether it holds a receive."""

    def __init__(self) -> None:
        self._pending: tuple[list, list[Callable[[], None]]] | None = None
        self.receiving = False

    def exchange(self, batch: list[Post]) -> None:
        """Finish the batch posted before, then post ``batch``: its tensors are held until it is finished."""
        self.finish()
        works = dist.batch_isend_irecv([op for op, _ in batch])
        self._pending = (works, [done for _, done in batch])
        self.receiving = any(op.op is not dist.isend for op, _ in batch)

    def finish(self) -> None:
        """Wait for the batch last posted, then run its operations' ``done``."""
        works, dones = self._pending or ((), ())
        self._pending, self.receiving = None, False
        for work in works:
            work.wait()
        for done in dones:
            done()


def run_instructions(
    instructions: Sequence[Instruction],
    post: Callable[[Instruction], list[Post]],
    compute: Callable[[Instruction], None],
) -> None:
    """Run a stage's ``instructions``: ``post(ins)`` gives an exchange's operations, ``compute(ins)``
    runs any other instruction; every transfer has completed when it returns."""
    transfers, batch = Transfers(), []
    for ins in instructions:
        if isinstance(ins, EXCHANGES):
            batch += post(ins)
            if not ins.batch_next:
                transfers.exchange(batch)
                batch = []
            continue
        if transfers.receiving and not isinstance(ins, BackwardWeight):
            transfers.finish()  # a W runs while the transfers before it complete; nothing else
        compute(ins)
    transfers.finish()
