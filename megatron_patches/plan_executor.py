"""The plugin's own pipeline executor as Megatron's forward-backward function: a step's plan, run
in the plan's order, split backwards included (``pipeline.schedule 'zero_bubble'``).

Megatron's schedules run every micro-batch's backward whole, in 1F1B's order. A zero-bubble plan
runs some backwards as I (the gradient of the stage's input, sent upstream at once) and, later, W
(the weight gradients, placed in the step's waits). Here the plan's instructions run one by one
on Megatron's own pieces, so the loss, its scaling and the gradients stay Megatron's:

- ``schedules.forward_step`` runs each forward (the input tensor set on the chunk, the forward
  step function of the script, the loss function with ``--calculate-per-token-loss`` summed and
  counted); ``schedules.backward_step`` each backward and each I (the loss scaled by
  ``grad_scale_func`` on the last stage, outputs pseudo-freed after their send as Megatron does);
  during a split micro-batch's forward and its I, the chunk's linear layers defer their weight
  gradients (``split_linear``) and its W accumulates them through autograd, so Megatron DDP's
  hooks collect them;
- gradients are not reduced per micro-batch (``no_sync_func`` entered for the whole step, as
  Megatron's schedules do until their last backward); at the end ``grad_sync_func`` starts the
  reduction and ``finalize_model_grads_func`` finishes it with the step's token count: the update
  of the whole global batch's token mean;
- transfers go point to point with the shapes the plan names (no shape exchange, so
  ``variable_seq_lengths``'s handshake is not needed), ``[s, b, h]`` as Megatron's stages pass
  them, in the pipeline's dtype, posted in the plan's batches and waited for as for every host
  (``dyn_plugin.host.transfers``: a receive completes before the next instruction that is not a
  W, a send by the next exchange; no buffered send relied on).

The TP ranks of one (stage, column) cell run the same plan, so the collectives inside a forward,
an I or a W (tensor parallelism) meet in the same order on each. What the executor cannot run as
planned is refused before the first step (``check_model``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from dyn_plugin.config import ConfigError
from dyn_plugin.host.transfers import Post, run_instructions
from dyn_plugin.plan.steps.instructions import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    ForwardPass,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
)

from .batches import device
from .split_linear import megatron_split

logger = logging.getLogger(__name__)


def runs_plans(run: Any) -> bool:
    """Whether the plugin's executor (not Megatron's schedule) runs this run's training steps."""
    pipeline = run.config.plugin.pipeline
    return pipeline.stages > 1 and pipeline.schedule == "zero_bubble"


def check_model(chunk: Any) -> None:
    """Refuse, before the first step, what a split backward cannot run as planned inside megatron-core:
    weight-bearing layers whose weight gradients it cannot defer (they would stay in I, priced in W)
    and settings that compute or hold weight gradients on their own."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    config = chunk.config
    refused = []
    if getattr(config, "gradient_accumulation_fusion", False):
        refused.append(
            "--gradient-accumulation-fusion writes weight gradients into main_grad inside the backward, before a "
            "split backward's W; pass --no-gradient-accumulation-fusion"
        )
    if getattr(config, "defer_embedding_wgrad_compute", False):
        refused.append("--defer-embedding-wgrad-compute defers the output layer's weight gradient on its own; drop it")
    if getattr(config, "sequence_parallel", False):
        refused.append("--sequence-parallel: the deferred layers do not gather their inputs for W; leave it out")
    # the layers a split defers, and those whose gradients stay in I by design (embeddings, norms: 1-D)
    known = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, torch.nn.Linear, torch.nn.Embedding)
    others = sorted(
        {
            type(m).__name__
            for m in chunk.modules()
            if not isinstance(m, known) and any(p.requires_grad and p.dim() >= 2 for p in m.parameters(recurse=False))
        }
    )
    if others:
        refused.append(
            f"{', '.join(others)} compute their weight gradients inside the backward (a split cannot defer them); "
            "use megatron-core's local layers (--transformer-impl local)"
        )
    if refused:
        raise ConfigError(
            "dyn_plugin.pipeline.schedule 'zero_bubble' under Megatron: "
            + "; ".join(refused)
            + " (or set pipeline.schedule to 'auto')"
        )


class _Executor:
    """One planned step on one rank."""

    def __init__(
        self,
        step: Any,
        forward_step_func: Callable,
        data_iterator: Iterator,
        model: Any,
        chunk: torch.nn.Module,
        force_all_reduce: bool,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config, get_model_type

        self.step, self.plan = step, step.plan
        self.forward_step_func, self.data_iterator, self.model = forward_step_func, data_iterator, model
        self.force_all_reduce = force_all_reduce
        self.config = get_model_config(model)
        self.model_type = get_model_type(model)
        self.group = ps.get_pipeline_model_parallel_group()
        # the plan names its peers by (stage, column) cell; Megatron's neighbours are the same cells'
        # ranks of this TP rank, so the plan must be this cell's
        want = (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
        want += (ps.get_data_parallel_rank(),)
        got = (self.plan.stage, self.plan.num_stages, self.plan.column)
        if got != want:
            raise ValueError(
                f"execution plan for stage {got[0]} of {got[1]}, column {got[2]} handed to Megatron's stage {want[0]} "
                f"of {want[1]}, data-parallel rank {want[2]}; the loader was built for another rank layout"
            )
        self.peers = {-1: ps.get_pipeline_model_parallel_prev_rank(), 1: ps.get_pipeline_model_parallel_next_rank()}
        self.first = self.plan.stage == 0
        self.last = self.plan.stage == self.plan.num_stages - 1
        self.inputs: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, torch.Tensor | None] = {}
        self.input_grads: dict[int, torch.Tensor | None] = {}
        self.forward_data_store: list = []
        self.tokens = torch.zeros([], dtype=torch.int, device=device())
        self.forwards = 0
        self.split = {i.mb for i in self.plan.instructions if isinstance(i, BackwardInput)}
        self.splitter = megatron_split(chunk) if self.split else None
        if self.splitter is not None:
            self.splitter.clear()

    # -- transfers -----------------------------------------------------------------------------
    def _shape(self, ins: Instruction) -> tuple[int, int, int]:
        (rows, row_len, hidden) = ins.shapes[0]  # the plan's [b, s, h]; Megatron's stages pass [s, b, h]
        return (row_len, rows, hidden)

    def _recv(self, ins: Instruction, offset: int, into: dict) -> list[Post]:
        buffer = torch.empty(self._shape(ins), dtype=self.config.pipeline_dtype, device=device())

        def done() -> None:
            into[ins.mb] = buffer.requires_grad_() if into is self.inputs else buffer

        return [(dist.P2POp(dist.irecv, buffer, self.peers[offset], self.group), done)]

    def _send(self, ins: Instruction, offset: int, tensor: torch.Tensor, after: Callable[[], None]) -> list[Post]:
        return [(dist.P2POp(dist.isend, tensor.contiguous(), self.peers[offset], self.group), after)]

    def post(self, ins: Instruction) -> list[Post]:
        from megatron.core.pipeline_parallel import schedules

        if isinstance(ins, RecvActivation):
            return self._recv(ins, -1, self.inputs)
        if isinstance(ins, RecvGrad):
            return self._recv(ins, 1, self.grads)
        if isinstance(ins, SendActivation):
            out = self.outputs[ins.mb]

            def sent() -> None:  # as Megatron's schedules free an output once it is sent
                schedules.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)

            return self._send(ins, 1, out, sent)
        grad = self.input_grads.pop(ins.mb)
        return self._send(ins, -1, grad, lambda: None)

    # -- passes ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _deferring(self, ins: Instruction) -> Iterator[None]:
        if self.splitter is not None and ins.mb in self.split:
            with self.splitter.deferring(ins.mb):
                yield
        else:
            yield

    def forward(self, ins: ForwardPass) -> None:
        from megatron.core.pipeline_parallel import schedules

        with self._deferring(ins):
            output, tokens = schedules.forward_step(
                self.forward_step_func,
                self.data_iterator,
                self.model,
                len(self.plan.micro_batches),
                self.inputs.get(ins.mb),
                self.forward_data_store,
                self.config,
                cp_group_size=1,
                is_first_microbatch=self.forwards == 0,
                current_microbatch=self.forwards,
                is_last_stage=self.last,
            )
        self.forwards += 1
        self.tokens += tokens
        self.outputs[ins.mb] = output

    def backward(self, ins: BackwardPass | BackwardInput) -> None:
        from megatron.core.pipeline_parallel import schedules

        with self._deferring(ins):
            grad = schedules.backward_step(
                self.inputs.pop(ins.mb, None),
                self.outputs.pop(ins.mb),
                self.grads.pop(ins.mb, None),
                self.model_type,
                self.config,
            )
        if not self.first:
            self.input_grads[ins.mb] = grad

    def compute(self, ins: Instruction) -> None:
        if isinstance(ins, ForwardPass):
            self.forward(ins)
        elif isinstance(ins, (BackwardPass, BackwardInput)):
            self.backward(ins)
        elif isinstance(ins, BackwardWeight):
            self.splitter.weights(ins.mb)
        elif not isinstance(ins, (LoadMicroBatch, ReduceGrads, OptimizerStep)):
            raise RuntimeError(f"the Megatron executor has no handler for {type(ins).__name__}")
        # loads come through the data iterator in forward order; Megatron's train_step reduces the
        # gradients (run() ends with that) and steps the optimizer after the executor returns

    def run(self) -> list:
        no_sync = (self.config.no_sync_func or contextlib.nullcontext)()
        no_sync.__enter__()
        try:
            run_instructions(self.plan.instructions, post=self.post, compute=self.compute)
        finally:
            no_sync.__exit__(None, None, None)
        if self.config.grad_sync_func is not None:
            self.config.grad_sync_func(self.model.parameters())
        if self.config.finalize_model_grads_func is not None:
            self.config.finalize_model_grads_func(
                [self.model],
                self.tokens if self.config.calculate_per_token_loss else None,
                force_all_reduce=self.force_all_reduce,
            )
        if self.split and self.plan.column == 0:
            logger.info(
                "step %d, stage %d: the plan's own order, %d of %d backwards split (W deferred)",
                self.step.index,
                self.plan.stage,
                len(self.split),
                len(self.plan.micro_batches),
            )
        return self.forward_data_store


def run_plan(
    step: Any,
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: Any,
    chunk: torch.nn.Module,
    force_all_reduce: bool = False,
) -> list:
    """Run ``step``'s plan on this rank (Megatron's forward-backward contract: the last stage's
    loss reports, gradients finalized); ``chunk``: ``model`` without its wrappers."""
    if isinstance(model, (list, tuple)):
        (model,) = model
    return _Executor(step, forward_step_func, data_iterator, model, chunk, bool(force_all_reduce)).run()
