"""DeepSpeed's ``PipelineEngine`` driven by the plugin's execution plans.

DeepSpeed runs a fixed ``TrainSchedule``: the same micro-batch count every step, shapes
exchanged before every transfer (``dynamic_shape``) or assumed constant. Here each step runs the
rank's plan (``dyn_plugin.plan.instructions``): its own number, sizes, layouts and order of
micro-batches. Shapes travel in the instructions, so no meta-data is exchanged; sends are
asynchronous (the plans are ordered for that) and complete before the gradient reduction;
receives block. Gradient reduction, the optimizer step and the backward of the loss stay
DeepSpeed's own (``_exec_reduce_grads``, ``_exec_optimizer_step``, ``_exec_backward_pass``).

The loss is exact: the last stage sums each micro-batch's token losses and scales by
dp / (scored tokens of the global batch), so after DeepSpeed averages over data-parallel ranks
the update is that of the token-mean loss, whatever the plan.
"""
from __future__ import annotations

from types import MethodType

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from dyn_plugin.models.recompute import RecomputeSwitch
from dyn_plugin.plan.instructions import (BackwardPass, ExecutionPlan, ForwardPass, Instruction, LoadMicroBatch,
                                          OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, SendActivation,
                                          SendGrad)
from dyn_plugin.runtime.collate import position_ids
from dyn_plugin.runtime.loader import Step


class PlanPipelineEngine(PipelineEngine):
    """Built by ``deepspeed_ext.initialize`` when ``dyn_plugin.pipeline.stages > 1``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # in flight until ReduceGrads
        self._losses: dict[int, torch.Tensor] = {}  # buffer -> scaled loss awaiting its backward
        self._recompute = RecomputeSwitch(self.module)  # the plan's recompute mode, per micro-batch

    def train_batch(self, step: Step) -> float:  # type: ignore[override]
        """Run this rank's plan of ``step``; returns the global batch's token-mean loss."""
        plan = step.plan
        self._check_plan(plan)
        self.module.train()
        self._step = step
        self._tensors = dict(zip(plan.loads, step.micro_batches))
        self._loss_scale = self.dp_world_size / step.scored_tokens
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._reserve_pipe_buffers(plan.num_buffers)
        for ins in plan.instructions:
            handler = self._INSTRUCTION_MAP.get(type(ins))
            if handler is None:
                raise RuntimeError(f"{type(self).__name__} has no handler for {type(ins).__name__}")
            MethodType(handler, self)(ins)
        return self._global_loss(step.scored_tokens)

    def _check_plan(self, plan: ExecutionPlan) -> None:
        want = (self.global_rank, self.stage_id, self.num_stages, self.grid.data_parallel_id)
        got = (plan.rank, plan.stage, plan.num_stages, plan.replica)
        if got != want:
            raise ValueError(f"execution plan for rank {got[0]} (stage {got[1]} of {got[2]}, replica {got[3]}) handed "
                             f"to rank {want[0]} (stage {want[1]} of {want[2]}, replica {want[3]}); build the loader "
                             "with this engine's stage and data-parallel ranks")

    def _peer(self, ins: Instruction, offset: int) -> int:
        expected = self.grid.stage_to_global(self.stage_id + offset)
        if ins.peer != expected:
            raise ValueError(f"{type(ins).__name__} of micro-batch {ins.mb} names rank {ins.peer}, but stage "
                             f"{self.stage_id + offset} of this replica is rank {expected}")
        return expected

    def _act_dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def _positions(self, mb: int) -> torch.Tensor:
        desc = self._step.plan.micro_batches[mb]
        return position_ids(desc["seq_lens"], desc["layout"], desc["shape"]).to(self.device)

    def _exec_load(self, ins: LoadMicroBatch) -> None:
        tensors = self._tensors[ins.mb]
        if self.is_first_stage():
            self.pipe_buffers["inputs"][ins.buffer] = (tensors["input_ids"].to(self.device), self._positions(ins.mb))
        if self.is_last_stage():
            self.pipe_buffers["labels"][ins.buffer] = tensors["labels"].to(self.device)

    def _exec_recv_activation(self, ins: RecvActivation) -> None:
        hidden = torch.empty(ins.shapes[0], dtype=self._act_dtype(), device=self.device)
        dist.irecv(hidden, src=self._peer(ins, -1)).wait()
        hidden.requires_grad_()
        self.pipe_buffers["inputs"][ins.buffer] = (hidden, self._positions(ins.mb))

    def _exec_forward(self, ins: ForwardPass) -> None:
        self._recompute.set(self._step.plan.micro_batches[ins.mb]["recompute"])
        outputs = super(PipelineEngine, self).forward(self.pipe_buffers["inputs"][ins.buffer])
        if self.is_last_stage():
            loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][ins.buffer])
            self._loss_sum += loss.detach().double()
            self._losses[ins.buffer] = loss * self._loss_scale
            self.pipe_buffers["labels"][ins.buffer] = None
            return
        hidden = outputs[0] if isinstance(outputs, tuple) else outputs
        if tuple(hidden.shape) != tuple(ins.shapes[0]):
            raise RuntimeError(f"stage {self.stage_id} produced {tuple(hidden.shape)} for micro-batch {ins.mb}, the plan "
                               f"expects {tuple(ins.shapes[0])}: does the model's hidden size match the cost model's?")
        self.pipe_buffers["outputs"][ins.buffer] = hidden

    def _exec_send_activation(self, ins: SendActivation) -> None:
        hidden = self.pipe_buffers["outputs"][ins.buffer].detach().contiguous()
        self._sends.append((dist.isend(hidden, dst=self._peer(ins, +1)), hidden))

    def _exec_recv_grad(self, ins: RecvGrad) -> None:
        grad = torch.empty(ins.shapes[0], dtype=self._act_dtype(), device=self.device)
        dist.irecv(grad, src=self._peer(ins, +1)).wait()
        self.grad_layer = grad

    def _exec_backward(self, ins: BackwardPass) -> None:
        if self.is_last_stage():
            self.loss = self._losses.pop(ins.buffer)
        # DeepSpeed's own backward: loss scaling, bf16 gradient bookkeeping, its hooks
        PipelineEngine._exec_backward_pass(self, ins.buffer)
        self.pipe_buffers["outputs"][ins.buffer] = None
        self.grad_layer = None
        if self.is_first_stage():
            self.pipe_buffers["inputs"][ins.buffer] = None

    def _exec_send_grad(self, ins: SendGrad) -> None:
        grad = self.pipe_buffers["inputs"][ins.buffer][0].grad
        self._sends.append((dist.isend(grad, dst=self._peer(ins, -1)), grad))
        self.pipe_buffers["inputs"][ins.buffer] = None

    def _exec_reduce(self, ins: ReduceGrads) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()

    def _exec_step(self, ins: OptimizerStep) -> None:
        self._exec_optimizer_step()

    def _global_loss(self, tokens: int) -> float:
        """Sum over replicas on the last stage, then broadcast down this replica's pipeline."""
        total = self._loss_sum.clone()
        if self.is_last_stage() and self.is_data_parallel:
            dist.all_reduce(total, group=self.grid.get_data_parallel_group())
        if self.is_pipe_parallel:
            dist.broadcast(total, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())
        return float(total) / tokens

    _INSTRUCTION_MAP = {
        LoadMicroBatch: _exec_load,
        RecvActivation: _exec_recv_activation,
        ForwardPass: _exec_forward,
        SendActivation: _exec_send_activation,
        RecvGrad: _exec_recv_grad,
        BackwardPass: _exec_backward,
        SendGrad: _exec_send_grad,
        ReduceGrads: _exec_reduce,
        OptimizerStep: _exec_step,
    }
