"""DeepSpeed's ``PipelineEngine`` driven by the plugin's execution plans.

DeepSpeed runs a fixed ``TrainSchedule``: the same micro-batch count every step, shapes
exchanged before every transfer (``dynamic_shape``) or assumed constant. Here each step runs the
rank's plan (``dyn_plugin.plan.steps.instructions``): its own number, sizes, layouts and order of
micro-batches. Shapes travel in the instructions, so no meta-data is exchanged; the transfers are
posted and waited for as ``dyn_plugin.host.transfers`` does for every host (batched as the plan
says, nothing relying on a buffered send).
Gradient reduction, the optimizer step and the backward of the loss stay
DeepSpeed's own (``_exec_reduce_grads``, ``_exec_optimizer_step``, ``_exec_backward_pass``).

Encoder-decoder plans (``ExecutionPlan.split_rank``, the module ``seq2seq_pipe``): a link moves
every tensor its instruction's shapes name (``instructions.link_shapes``), each its own transfer in
one batch; a stage's input is ``(*received, *loaded token ids, input attention mask)`` (the first
stage loads the input ids, the first decoder stage the labels it shifts into the decoder's
inputs); the gradients of all received tensors go back, the encoder output's summed over the
cross-attentions of every decoder stage it passed.

The loss is exact: the last stage sums each micro-batch's token losses and scales by
dp / (scored tokens of the global batch), so after DeepSpeed averages over data-parallel ranks
the update is that of the token-mean loss, whatever the plan.

Sequence parallelism: a micro-batch whose plan says ``sp`` > 1 runs on the group of ``sp``
neighbouring columns starting at column ``group``, at every stage; each rank holds its
contiguous 1/sp of every row (activations, gradients and instruction shapes are local) and
attention spans the stage's group (``sharded``). Each shard's loss is its own tokens' summed loss
against labels shifted before the split, scaled as above with dp = every column: the group's
shard losses add up to the micro-batch's, and the gradients of each rank's parameters include
the other shards' through the attention collectives, so the update stays the exact token mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import MethodType
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_ext.pipe_module import summed_token_loss
from deepspeed_ext.sequence_parallel import sequence_runtime
from dyn_plugin.host.clock import PeakMemory, StepClock
from dyn_plugin.host.feed import DeviceFeed, copy_to
from dyn_plugin.host.recompute import recompute_switch
from dyn_plugin.host.transfers import Post, run_instructions
from dyn_plugin.layout import RankLayout
from dyn_plugin.models import varlen_attention
from dyn_plugin.models.recompute import planned_layers
from dyn_plugin.models.sequence_parallel import SequenceShard
from dyn_plugin.models.split_backward import split_backward
from dyn_plugin.plan.steps.instructions import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    ExecutionPlan,
    ForwardPass,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from dyn_plugin.runtime.collate import document_offsets, position_ids
from dyn_plugin.runtime.loader import Step


class PlanPipelineEngine(PipelineEngine):
    """Built by ``deepspeed_ext.initialize`` when ``dyn_plugin.pipeline.stages > 1``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._check_topology()
        self._losses: dict[int, torch.Tensor] = {}  # buffer -> scaled loss awaiting its backward
        self._tokens: dict[int, tuple[torch.Tensor, ...]] = {}  # buffer -> a pair stage's loaded ids and mask
        self._split: set[int] = set()  # this step's micro-batches whose backward is split here

    def _check_topology(self) -> None:
        """Plans, their peers and the sequence-parallel groups number ranks stage-major, global rank
        = stage * columns + column (plan.planner.execution_plans, runtime.sequence_groups), as
        DeepSpeed's PipeDataParallelTopology does; another order, or more axes (model parallelism),
        would pair ranks the plans did not."""
        topo, layout = self.grid.topology(), RankLayout.of(self.dp_world_size, self.num_stages)
        axes = topo.get_axis_names()
        if axes != ["pipe", "data"] or any(
            topo.get_rank(pipe=s, data=c) != layout.rank_of(s, c)
            for s in range(layout.stages)
            for c in range(layout.columns)
        ):
            raise ValueError(
                f"the pipeline's topology (axes {axes}) does not number ranks stage * columns + column, "
                "as the plugin's plans and sequence-parallel groups do: build the PipelineModule with "
                "num_stages (DeepSpeed then uses PipeDataParallelTopology), not a custom topology"
            )

    def train_batch(  # type: ignore[override]
        self, data_iter: Iterator[Step] | Step | None = None, *, timings: list | None = None
    ) -> float:
        """Run this rank's plan of one step and take the optimizer step; returns the global
        batch's token-mean loss. ``data_iter``: a loader ``Step``, or (as DeepSpeed users pass
        it) an iterator of them, of which the next is taken. ``timings``, if given, receives each
        compute instruction this rank ran as (name, start ms, end ms) from the step's start
        (``F3``, ``B3``, ``I3``, ``W3``, ``load3``, ``reduce``, ``step``; CUDA events on a GPU,
        read once after the step): the executed schedule, waits included, beside the planned one."""
        step = self._next_step(data_iter, "train_batch")
        self.module.train()
        self._run(step, step.plan.instructions, training=True, timings=timings)
        return self._global_loss(step.scored_tokens)

    def eval_batch(
        self, data_iter: Iterator[Step] | Step, return_logits: bool = False, compute_loss: bool = True, **_: object
    ) -> float:  # type: ignore[override]
        """Run the forwards of one step's plan, without gradients; returns the global batch's
        token-mean loss. The plan's backward half (receive gradient, backward, send gradient,
        reduction, optimizer step) is left out."""
        if return_logits or not compute_loss:
            raise ValueError(
                "eval_batch of the plugin's pipeline returns the token-mean loss only "
                "(return_logits=False, compute_loss=True): logits stay on the last stage"
            )
        step = self._next_step(data_iter, "eval_batch")
        forwards = tuple(
            replace(i, batch_next=False)
            for i in step.plan.instructions
            if isinstance(i, (LoadMicroBatch, RecvActivation, ForwardPass, SendActivation))
        )
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                self._run(step, forwards, training=False)
        finally:
            self.module.train(was_training)
        return self._global_loss(step.scored_tokens)

    def _next_step(self, data_iter: Iterator[Step] | Step | None, caller: str) -> Step:
        if data_iter is None:
            data_iter = self.data_iterator
        if data_iter is None:
            raise ValueError(
                f"{caller} needs a step of the plugin's loader: {caller}(step) or {caller}(data_iter=iter(loader))"
            )
        step = data_iter if isinstance(data_iter, Step) else next(data_iter)
        if not isinstance(step, Step):
            # DeepSpeed's fixed schedule would run on data the plan did not cut: refuse it
            raise TypeError(
                f"{caller} runs the plugin's plans: data_iter must yield the loader's Steps "
                f"(deepspeed_ext.initialize returns that loader), got {type(step).__name__}"
            )
        return step

    def _run(
        self, step: Step, instructions: tuple[Instruction, ...], *, training: bool, timings: list | None = None
    ) -> None:
        plan = step.plan
        self._check_plan(plan)
        self._step = step
        self._training = training
        # the micro-batches this rank loads, in plan.loads order: each copied while the one before computes
        self._feed = DeviceFeed(step.micro_batches, self.device, self._loaded_keys(plan))
        self._sequence = sequence_runtime(self, step)
        self._shards: dict[int, SequenceShard] = {}  # micro-batch -> its group's shard, built at first use
        self._offsets: dict[int, tuple[torch.Tensor, int]] = {}  # micro-batch -> its documents, at first use
        self._loss_scale = self.dp_world_size / step.scored_tokens
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._reserve_pipe_buffers(plan.num_buffers)
        # the micro-batches whose backward this stage splits (zero-bubble plans): their forwards and
        # I's defer the linear layers' weight gradients to their W's
        self._split = {i.mb for i in instructions if isinstance(i, BackwardInput)}
        if self._split:
            split_backward(self.module).clear()

        # the online calibration's (step.observe) measurements: each pass this stage ran, and its peak
        observe = step.observe if training else None
        clock = StepClock(self.device, timings is not None or observe is not None)
        peak = PeakMemory(self.device, observe is not None)
        marks: list[tuple[str, Any, Any]] = []
        start = clock.mark()

        def compute(ins: Instruction) -> None:
            before = clock.mark()
            with self._around_pass(ins):
                self._handler(ins)(ins)
            if clock.enabled:
                marks.append((_op_name(ins), before, clock.mark()))

        run_instructions(instructions, post=lambda ins: self._handler(ins)(ins), compute=compute)
        if clock.enabled:
            clock.wait()
            times = [(name, clock.ms(start, a), clock.ms(start, b)) for name, a, b in marks]
            if timings is not None:
                timings.extend(times)
            if observe is not None:  # every rank, after its passes: the calibration gathers them
                observe(_pass_times(times, len(plan.micro_batches)), peak.read())

    def _handler(self, ins: Instruction) -> Callable:
        handler = self._INSTRUCTION_MAP.get(type(ins))
        if handler is None:
            raise RuntimeError(f"{type(self).__name__} has no handler for {type(ins).__name__}")
        return MethodType(handler, self)

    @contextlib.contextmanager
    def _around_pass(self, ins: Instruction) -> Iterator[None]:
        """Around a micro-batch's forward and its backward: its sequence-parallel group for attention
        (recompute in backward re-runs attention with the group of its own forward, whatever ran in
        between) and a random stream seeded per group and micro-batch, so dropout draws the same
        on every rank of the group, again under recompute, and again after a resume; outside a
        group, its document boundaries for the attention kernel (``_documents``).

        NCCL: the attention collectives inside span the group's columns at this stage (their own
        communicator, ``SequenceGroups``). Every column of a group runs the same plan
        (execution_plans: the group's schedule, local shapes, its point-to-point peers the same
        column on the neighbouring stages), so the k columns run k copies of one instruction
        sequence: they reach each of the group's collectives at the same instruction, in the same
        order, after the same transfers, and the transfers pair within a copy as they do without
        groups (batch_next batches, untouched). A wait cycle would have to exist in one column's
        run already; check_plans(rendezvous=True), which PlanningContext.plan runs on every step,
        replays all ranks with unbuffered sends and these forwards and backwards as collectives.
        Everything is issued in instruction order on the engine's device (the shard's positions
        included), with no host synchronisation per micro-batch."""
        if not isinstance(ins, (ForwardPass, BackwardPass, BackwardInput)):
            yield
            return
        with contextlib.ExitStack() as around:
            if ins.mb in self._split and not isinstance(ins, BackwardPass):  # its forward and its I defer W
                around.enter_context(split_backward(self.module).deferring(ins.mb))
            if self._sequence is not None:
                around.enter_context(self._sequence.running(self._step, ins.mb, self.stage_id, self._shard(ins.mb)))
            if not self._pairs and self._step.plan.micro_batches[ins.mb].sp == 1:
                around.enter_context(varlen_attention.documents(self._documents(ins.mb)))
            yield

    def _documents(self, mb: int) -> tuple[torch.Tensor, int]:
        """Micro-batch ``mb``'s document boundaries (on the device) and longest document, from the
        plan, for the attention kernel of its forward and its backward's recompute: found from the
        positions instead, they would be read back from the device once per forward."""
        if mb not in self._offsets:
            desc = self._step.plan.micro_batches[mb]
            cu, longest = document_offsets(desc.seq_lens, desc.layout, desc.shape)
            self._offsets[mb] = (copy_to(cu, self.device), longest)
        return self._offsets[mb]

    def _shard(self, mb: int) -> SequenceShard | None:
        """Micro-batch ``mb``'s sequence-parallel shard (None on a group of one), built once per step."""
        if self._step.plan.micro_batches[mb].sp == 1:
            return None
        if mb not in self._shards:
            self._shards[mb] = self._sequence.planned_shard(self._step, mb, self.stage_id)
        return self._shards[mb]

    def _check_plan(self, plan: ExecutionPlan) -> None:
        want = (self.global_rank, self.stage_id, self.num_stages, self.grid.data_parallel_id)
        got = (plan.rank, plan.stage, plan.num_stages, plan.column)
        if got != want:
            raise ValueError(
                f"execution plan for rank {got[0]} (stage {got[1]} of {got[2]}, column {got[3]}) handed "
                f"to rank {want[0]} (stage {want[1]} of {want[2]}, column {want[3]}); build the loader "
                "with this engine's stage and data-parallel ranks"
            )

    def _peer(self, ins: Instruction, offset: int) -> int:
        expected = self.grid.stage_to_global(self.stage_id + offset)
        if ins.peer != expected:
            raise ValueError(
                f"{type(ins).__name__} of micro-batch {ins.mb} names rank {ins.peer}, but stage "
                f"{self.stage_id + offset} of this replica is rank {expected}"
            )
        return expected

    def _act_dtype(self) -> torch.dtype:
        """The precision DeepSpeed trains in (its config's bf16 / fp16 sections), which the
        stages' activations and gradients travel in."""
        if self.bfloat16_enabled():
            return torch.bfloat16
        return torch.float16 if self.fp16_enabled() else torch.float32

    def _positions(self, mb: int) -> torch.Tensor:
        """Position ids of this rank's part of micro-batch ``mb``, on the device: rotary embeddings
        turn each token by its own position, so a shard takes its columns of the whole rows'."""
        shard = self._shard(mb)
        if shard is None:
            desc = self._step.plan.micro_batches[mb]
            return copy_to(position_ids(desc.seq_lens, desc.layout, desc.shape), self.device)
        return shard.own_positions

    @property
    def _pairs(self) -> bool:
        """Whether this step's plan runs an encoder-decoder's (input, target) pairs."""
        return self._step.plan.split_rank is not None

    def _exec_load(self, ins: LoadMicroBatch) -> None:
        tensors = next(self._feed)  # on the device
        if self._pairs:
            embeds = self._embedded(self._step.plan)  # the last stage after the first decoder stage: none
            ids = (tensors[embeds],) if embeds else ()
            self._tokens[ins.buffer] = (*ids, tensors["attention_mask"])
            if self.is_first_stage():
                self.pipe_buffers["inputs"][ins.buffer] = ()
        elif self.is_first_stage():
            self.pipe_buffers["inputs"][ins.buffer] = (tensors["input_ids"], self._positions(ins.mb))
        if self.is_last_stage():  # a shard's labels were shifted before the split
            key = "shift_labels" if self._step.plan.micro_batches[ins.mb].sp > 1 else "labels"
            self.pipe_buffers["labels"][ins.buffer] = tensors[key]

    def _embedded(self, plan: ExecutionPlan) -> str | None:
        """The token ids a pair stage embeds: the first stage the inputs, the first decoder stage the
        targets (shifted into the decoder's inputs), other stages none."""
        return {0: "input_ids", plan.split_rank: "labels"}.get(self.stage_id)

    def _loaded_keys(self, plan: ExecutionPlan) -> set[str]:
        """The tensors of a micro-batch this stage loads (``_exec_load``)."""
        last = self.stage_id == self.num_stages - 1
        if plan.split_rank is not None:
            embeds = self._embedded(plan)
            return {"attention_mask", *([embeds] if embeds else []), *(["labels"] if last else [])}
        return {*(["input_ids"] if self.stage_id == 0 else []), *(["labels", "shift_labels"] if last else [])}

    def _input_mask(self, mb: int) -> torch.Tensor:
        """The input padding mask of pair micro-batch ``mb`` [rows, input width], from its plan, as
        ``runtime.collate_pairs`` builds it: 1 on each input's tokens, 0 on its padding."""
        desc = self._step.plan.micro_batches[mb]
        inputs = torch.tensor([n for n, _ in desc.seq_lens])
        return copy_to((torch.arange(desc.shape[1])[None, :] < inputs[:, None]).long(), self.device)

    def _exec_recv_activation(self, ins: RecvActivation) -> list[Post]:
        received = self._empty(ins.shapes)

        def done() -> None:
            for t in received:
                t.requires_grad_(self._training)
            inputs = tuple(received) if self._pairs else (received[0], self._positions(ins.mb))
            self.pipe_buffers["inputs"][ins.buffer] = inputs

        return self._transfers(dist.irecv, received, self._peer(ins, -1), done)

    def _empty(self, shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
        """Receive buffers of the instruction's shapes, in the training precision."""
        return [torch.empty(shape, dtype=self._act_dtype(), device=self.device) for shape in shapes]

    @staticmethod
    def _transfers(op: Callable, tensors: list[torch.Tensor], peer: int, done: Callable[[], None]) -> list[Post]:
        """One transfer per tensor, posted in one batch with the instruction's neighbours; ``done``
        once, after all of them."""
        ops = [dist.P2POp(op, t, peer) for t in tensors]
        return [(o, lambda: None) for o in ops[:-1]] + [(ops[-1], done)]

    def _set_recompute(self, mb: int) -> None:
        """The micro-batch's recompute mode on its count of this stage's layers. Set again for its
        backward: a recompute calls the layers' blocks as they are wrapped at that moment, which
        other micro-batches' forwards in between may have changed."""
        desc = self._step.plan.micro_batches[mb]
        recompute_switch(self.module).set(desc.recompute, planned_layers(desc, self.stage_id))

    def _exec_forward(self, ins: ForwardPass) -> None:
        self._set_recompute(ins.mb)
        inputs = self.pipe_buffers["inputs"][ins.buffer]
        if self._pairs:  # ids and mask where the stage loads them, else the mask from the plan
            loaded = self._tokens.pop(ins.buffer, None)
            inputs = (*inputs, *(loaded if loaded is not None else (self._input_mask(ins.mb),)))
        outputs = super(PipelineEngine, self).forward(inputs)
        if self.is_last_stage():
            loss = self._token_loss(ins.mb, outputs, self.pipe_buffers["labels"][ins.buffer])
            self._loss_sum += loss.detach().double()
            if self._training:
                self._losses[ins.buffer] = loss * self._loss_scale
            self.pipe_buffers["labels"][ins.buffer] = None
            return
        if self._pairs:  # everything the link carries (instructions.link_shapes)
            sent = outputs if isinstance(outputs, tuple) else (outputs,)
        else:
            sent = (outputs[0] if isinstance(outputs, tuple) else outputs,)
        got = [tuple(t.shape) for t in sent]
        if got != [tuple(shape) for shape in ins.shapes]:
            raise RuntimeError(
                f"stage {self.stage_id} produced {got} for micro-batch {ins.mb}, the plan expects "
                f"{[tuple(shape) for shape in ins.shapes]}: does the model's hidden size match the cost model's?"
            )
        self.pipe_buffers["outputs"][ins.buffer] = sent[0] if len(sent) == 1 else sent

    def _token_loss(self, mb: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The module's summed token loss; a shard's with its pre-shifted labels."""
        if self._step.plan.micro_batches[mb].sp == 1:
            return self.module.loss_fn(logits, labels)
        if self.module.loss_fn is not summed_token_loss:
            raise ValueError(
                f"micro-batch {mb} runs sequence-parallel, so the last stage holds a shard of each row "
                "with labels shifted before the split; the module's loss_fn "
                f"{getattr(self.module.loss_fn, '__name__', self.module.loss_fn)!r} shifts them again. "
                "Use deepspeed_ext.pipe_module.summed_token_loss (causal_lm_pipe does)"
            )
        return summed_token_loss(logits, labels, shifted=True)

    def _exec_send_activation(self, ins: SendActivation) -> list[Post]:
        outputs = self.pipe_buffers["outputs"][ins.buffer]
        sent = [t.detach().contiguous() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]

        def done() -> None:
            if not self._training:  # no backward will free it
                self.pipe_buffers["outputs"][ins.buffer] = None

        return self._transfers(dist.isend, sent, self._peer(ins, +1), done)

    def _exec_recv_grad(self, ins: RecvGrad) -> list[Post]:
        grads = self._empty(ins.shapes)

        def done() -> None:  # as DeepSpeed's backward takes them: one tensor, or one per output
            self.grad_layer = grads[0] if len(grads) == 1 else tuple(grads)

        return self._transfers(dist.irecv, grads, self._peer(ins, +1), done)

    def _exec_backward(self, ins: BackwardPass) -> None:
        self._set_recompute(ins.mb)
        if self.is_last_stage():
            self.loss = self._losses.pop(ins.buffer)
        # DeepSpeed's own backward: loss scaling, bf16 gradient bookkeeping, its hooks
        PipelineEngine._exec_backward_pass(self, ins.buffer)
        self.pipe_buffers["outputs"][ins.buffer] = None
        self.grad_layer = None
        if self.is_first_stage():
            self.pipe_buffers["inputs"][ins.buffer] = None

    def _exec_backward_weight(self, ins: BackwardWeight) -> None:
        # DeepSpeed's bf16 optimizer takes each backward's gradients into its fp32 buffers as the
        # backward ends (clearing the bf16 ones before the next): a W's, which come later, are taken
        # the same way, from gradients cleared of what the backwards before it already gave
        bf16 = self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update
        if bf16:
            self.optimizer.clear_lp_grads()
        split_backward(self.module).weights(ins.mb)
        if bf16:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_send_grad(self, ins: SendGrad) -> list[Post]:
        inputs = self.pipe_buffers["inputs"][ins.buffer]
        grads = [t.grad for t in (inputs if self._pairs else inputs[:1])]  # of every received tensor

        def done() -> None:
            self.pipe_buffers["inputs"][ins.buffer] = None

        return self._transfers(dist.isend, grads, self._peer(ins, -1), done)

    def _exec_reduce(self, ins: ReduceGrads) -> None:
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
            dist.broadcast(
                total, src=self.grid.stage_to_global(self.num_stages - 1), group=self.grid.get_pipe_parallel_group()
            )
        return float(total) / tokens

    _INSTRUCTION_MAP = {
        LoadMicroBatch: _exec_load,
        RecvActivation: _exec_recv_activation,
        ForwardPass: _exec_forward,
        SendActivation: _exec_send_activation,
        RecvGrad: _exec_recv_grad,
        BackwardPass: _exec_backward,
        BackwardInput: _exec_backward,  # within its deferring (_around_pass)
        BackwardWeight: _exec_backward_weight,
        SendGrad: _exec_send_grad,
        ReduceGrads: _exec_reduce,
        OptimizerStep: _exec_step,
    }


# a compute instruction's name in timings: the simulator's op names (plan/steps/simulator.py) for passes
_OP_NAMES = {ForwardPass: "F", BackwardPass: "B", BackwardInput: "I", BackwardWeight: "W", LoadMicroBatch: "load"}


def _pass_times(times: list[tuple[str, float, float]], count: int) -> list[tuple[float, float]]:
    """Per micro-batch of the plan, (forward ms, backward ms) from a stage's timed passes; a split
    backward's is its I and its W together, as the tables price a whole backward."""
    ms = {name: end - start for name, start, end in times}
    return [(ms[f"F{m}"], ms[f"B{m}"] if f"B{m}" in ms else ms[f"I{m}"] + ms[f"W{m}"]) for m in range(count)]


def _op_name(ins: Instruction) -> str:
    kind = _OP_NAMES.get(type(ins))
    return (
        f"{kind}{ins.mb}" if kind else {ReduceGrads: "reduce", OptimizerStep: "step"}.get(type(ins), type(ins).__name__)
    )
