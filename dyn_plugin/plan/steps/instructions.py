"""Per-rank instruction lists that a pipeline engine executes, and their JSON form.

Instruction names match DeepSpeed's ``PipeInstruction`` classes so a host engine can map each
to the handler it already has (``_INSTRUCTION_MAP``). Unlike DeepSpeed's, ours carry the
micro-batch, the tensor shapes and the peer rank: with variable micro-batches a receiver cannot
assume the previous shape, and shapes known in advance need no meta-data exchange. A transfer
may move several tensors: an encoder-decoder's decoder stages send their hidden states and the
encoder output (``link_shapes``).

Sends and receives rendezvous: NCCL does not buffer a send (one stream per peer pair, a large
message waits for its receiver), so a stage sending an activation while its neighbour sends a
gradient back would hang if each waited for its own send first. A send that the schedule
follows by a receive from the same peer is therefore marked ``batch_next``: the engine posts
both in one batch (``dist.batch_isend_irecv``), as Megatron's send_forward_recv_backward and
send_backward_recv_forward do. ``check_plans(..., rendezvous=True)`` replays the plans with
unbuffered sends and names the first instruction that would wait forever; it counts the
forward and backward of a sequence-parallel micro-batch as collectives of its group's ranks at
that stage (attention spans them), so the group's collectives and the pipeline's transfers are
proven not to wait on each other either.

A split backward (zero-bubble schedules) is ``BackwardInput`` (the gradient of the stage's input,
sent upstream as a whole backward's is) and, later, ``BackwardWeight`` (its weight gradients,
which no peer waits for). A ``BackwardWeight`` runs while the exchanges posted before it are in
flight: the engine waits on them at the first later instruction that is not a ``BackwardWeight``.
So the W's the schedule places in a stage's wait for a transfer come right after that transfer's
exchange is posted, and a send stays batched with the receive after it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Sequence

from ...cost.model import Layout, Recompute
from .types import MicroBatch, Op, Schedule

SCHEMA = "dyn_plugin.execution_plan"
# 2: batch_next (version 1 plans relied on buffered sends); 3: sp, group, checkpointed; 4: replica -> column;
# 5: split_rank (encoder-decoder pipelines); 6: BackwardInput, BackwardWeight (a version 5 plan reads as one
# without split backwards)
VERSION = 6
READS = (5, 6)


@dataclass(frozen=True)
class Instruction:
    stage: int
    mb: int | None = None  # index into ExecutionPlan.micro_batches
    buffer: int | None = None  # activation slot on this rank, 0 .. num_buffers - 1
    shapes: tuple[tuple[int, ...], ...] = ()  # tensors it moves or produces
    peer: int | None = None  # global rank at the other end of a send or receive
    batch_next: bool = False  # a send or receive posted in one batch with the instruction after it


class LoadMicroBatch(Instruction):
    """Build the micro-batch's tensors (inputs on the first stage, labels on the last)."""


class ForwardPass(Instruction):
    pass


class BackwardPass(Instruction):
    pass


class BackwardInput(Instruction):
    """The gradient of the stage's input (sent upstream next); what the weight gradients need is
    kept for the ``BackwardWeight`` of the same micro-batch."""


class BackwardWeight(Instruction):
    """The weight gradients of a micro-batch whose ``BackwardInput`` ran earlier on this stage."""


class SendActivation(Instruction):
    pass


class RecvActivation(Instruction):
    pass


class SendGrad(Instruction):
    pass


class RecvGrad(Instruction):
    pass


class ReduceGrads(Instruction):
    pass


class OptimizerStep(Instruction):
    pass


EXCHANGES = (SendActivation, RecvActivation, SendGrad, RecvGrad)  # point-to-point: they rendezvous with a peer

INSTRUCTIONS: dict[str, type[Instruction]] = {
    cls.__name__: cls
    for cls in (
        LoadMicroBatch,
        ForwardPass,
        BackwardPass,
        BackwardInput,
        BackwardWeight,
        SendActivation,
        RecvActivation,
        SendGrad,
        RecvGrad,
        ReduceGrads,
        OptimizerStep,
    )
}
BACKWARDS = (BackwardPass, BackwardInput)  # what sends a stage's input gradient upstream


@dataclass(frozen=True)
class PlannedMicroBatch:
    """One micro-batch as an execution plan hands it to the runtime: what the loader collates
    (``sample_ids``, ``seq_lens``, ``layout``, ``shape``) and how the host runs it (``recompute``
    on ``checkpointed[stage]`` layers of each stage, empty = all; ``sp`` ranks of the
    sequence-parallel group starting at data-parallel column ``group``). Typed, so a misspelled
    field fails where it is read, and frozen: every rank holds the same plan."""

    sample_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    layout: Layout
    recompute: Recompute
    shape: tuple[int, ...]
    checkpointed: tuple[int, ...]
    sp: int
    group: int

    def to_json(self) -> dict[str, Any]:
        """Its JSON object (plan_to_json)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PlannedMicroBatch:
        """Read one back (plan_from_json); a missing or unknown field is refused."""
        names = {f.name for f in fields(cls)}
        if set(doc) != names:
            raise ValueError(
                f"malformed micro-batch {dict(doc)}: unknown fields {sorted(set(doc) - names)}, "
                f"missing fields {sorted(names - set(doc))}"
            )
        return cls(
            sample_ids=tuple(doc["sample_ids"]),
            seq_lens=tuple(doc["seq_lens"]),
            layout=doc["layout"],
            recompute=doc["recompute"],
            shape=tuple(doc["shape"]),
            checkpointed=tuple(doc["checkpointed"]),
            sp=doc["sp"],
            group=doc["group"],
        )


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything one rank runs for one global batch.

    ``micro_batches[i]`` describes local micro-batch ``i`` (``PlannedMicroBatch``) so the loader
    builds exactly the tensors the plan expects; under sequence parallelism this rank holds shard
    ``column - group`` of every row, ``shape[1] / sp`` wide.
    """

    rank: int
    column: int  # the data-parallel column (DeepSpeed's data_parallel_id)
    stage: int
    num_stages: int
    num_buffers: int
    instructions: tuple[Instruction, ...]
    micro_batches: tuple[PlannedMicroBatch, ...]
    # an encoder-decoder's first decoder stage (Megatron's split rank; 0 with one stage), which loads
    # the targets its decoder embeds; None: a decoder-only model
    split_rank: int | None = None

    @property
    def loading_stages(self) -> tuple[int, ...]:
        """The stages that load micro-batches: the first (inputs), the last (labels) and an
        encoder-decoder's first decoder stage (the targets, shifted into the decoder's inputs)."""
        extra = () if self.split_rank is None else (self.split_rank,)
        return tuple(sorted({0, self.num_stages - 1, *extra}))

    @property
    def loads(self) -> list[int]:
        """The micro-batches this rank loads (first and last stages), in the order it loads them."""
        return [i.mb for i in self.instructions if isinstance(i, LoadMicroBatch)]


def build_execution_plans(
    micro_batches: Sequence[MicroBatch],
    schedule: Schedule,
    *,
    column: int,
    stage_ranks: Sequence[int],
    hidden_size: int,
    group: int | None = None,
    split_rank: int | None = None,
) -> list[ExecutionPlan]:
    """One plan per stage of data-parallel ``column``, in stage order; ``stage_ranks[s]``
    is stage s's global rank. ``group``: the first column of the sequence-parallel group the
    column belongs to (default: the column itself); each micro-batch's ``sp`` says how wide it is.
    ``split_rank``: the micro-batches are (input, target) pairs (``PairMicroBatch``) of an
    encoder-decoder whose decoder stages start there (``link_shapes``)."""
    group = column if group is None else group
    num_stages = len(schedule.stages)
    if len(stage_ranks) != num_stages:
        raise ValueError(f"stage_ranks needs {num_stages} entries (one per stage), got {len(stage_ranks)}")
    described = tuple(
        PlannedMicroBatch(
            sample_ids=tuple(mb.sample_ids),
            seq_lens=tuple(mb.seq_lens),
            layout=mb.layout,
            recompute=mb.recompute,
            shape=tuple(mb.shape),
            checkpointed=tuple(mb.checkpointed),
            sp=mb.sp,
            group=group,
        )
        for mb in micro_batches
    )
    if split_rank is not None and not 0 <= split_rank < num_stages:
        raise ValueError(f"split_rank {split_rank} names no stage of {num_stages}")
    return [
        _stage_plan(micro_batches, ops, stage, stage_ranks, column, hidden_size, described, split_rank)
        for stage, ops in enumerate(schedule.stages)
    ]


def link_shapes(
    mb: MicroBatch, link: int, hidden_size: int, split_rank: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """The tensors micro-batch ``mb`` sends from stage ``link`` to stage ``link + 1`` (its gradients
    come back in the same shapes). Decoder-only: the hidden states of this rank's share of the rows.
    Encoder-decoder (``split_rank``, ``mb`` a ``PairMicroBatch``), as Megatron's T5 pipeline sends
    them and ``EncoderDecoderCostModel.link_bytes`` prices them: an encoder stage its hidden states
    [n, Se, H] (the last one the encoder output), a decoder stage its hidden states [n, Sd, H] and
    the encoder output [n, Se, H] every later decoder layer's cross-attention reads."""
    if split_rank is None:
        rows, row_len = mb.local_shape
        return ((rows, row_len, hidden_size),)
    rows, inputs = mb.shape
    encoder = (rows, inputs, hidden_size)
    if link < split_rank:
        return (encoder,)
    return ((rows, mb.target_shape[1], hidden_size), encoder)


def _stage_plan(
    micro_batches: Sequence[MicroBatch],
    ops: Sequence[Op],
    stage: int,
    stage_ranks: Sequence[int],
    column: int,
    hidden_size: int,
    described: tuple[PlannedMicroBatch, ...],
    split_rank: int | None,
) -> ExecutionPlan:
    last = len(stage_ranks) - 1
    prev = stage_ranks[stage - 1] if stage > 0 else None
    nxt = stage_ranks[stage + 1] if stage < last else None
    plan = ExecutionPlan(
        rank=stage_ranks[stage],
        column=column,
        stage=stage,
        num_stages=len(stage_ranks),
        num_buffers=0,
        instructions=(),
        micro_batches=described,
        split_rank=split_rank,
    )
    slots: dict[int, int] = {}  # micro-batch -> buffer it occupies from its forward to its backward
    num_buffers = 0
    out: list[Instruction] = []
    weights: list[Instruction] = []  # W's placed before the next op: they follow its receive's posting
    for op in ops:
        mb = op.mb
        received = link_shapes(micro_batches[mb], stage - 1, hidden_size, split_rank) if prev is not None else ()
        sent = link_shapes(micro_batches[mb], stage, hidden_size, split_rank) if nxt is not None else ()
        if op.kind == "W":
            weights.append(BackwardWeight(stage, mb))
        elif op.kind == "F":
            buf = min(set(range(len(slots) + 1)) - set(slots.values()))
            slots[mb] = buf
            num_buffers = max(num_buffers, len(slots))
            if prev is not None:  # before the load: it may pair with the previous backward's SendGrad
                _exchange(out, RecvActivation(stage, mb, buf, received, prev))
            out += weights
            weights = []
            if stage in plan.loading_stages:
                out.append(LoadMicroBatch(stage, mb, buf, (_loaded_shape(micro_batches[mb], stage, split_rank),)))
            out.append(
                ForwardPass(stage, mb, buf, sent if nxt is not None else ((),))
            )  # the last stage yields the loss
            if nxt is not None:
                out.append(SendActivation(stage, mb, buf, sent, nxt))
        else:
            buf = slots.pop(mb)
            if nxt is not None:
                _exchange(out, RecvGrad(stage, mb, buf, sent, nxt))
            out += weights
            weights = []
            backward = BackwardInput if op.kind == "I" else BackwardPass
            out.append(backward(stage, mb, buf, received))  # stage 0's input needs no gradient
            if prev is not None:
                out.append(SendGrad(stage, mb, buf, received, prev))
    out += [*weights, ReduceGrads(stage), OptimizerStep(stage)]
    return replace(plan, num_buffers=num_buffers, instructions=tuple(out))


def _loaded_shape(mb: MicroBatch, stage: int, split_rank: int | None) -> tuple[int, int]:
    """The token tensor a stage loads: this rank's share of the rows; of pairs, the inputs on the
    first stage and the targets on a decoder stage after it."""
    if split_rank is None:
        return mb.local_shape
    return mb.target_shape if stage > 0 and stage >= split_rank else mb.shape


def _exchange(out: list[Instruction], recv: Instruction) -> None:
    """Append ``recv``, batched with the send just before it when that goes to the same peer:
    the peer then runs the mirror image (its send of ``recv``'s tensor, its receive of ours)
    and neither waits for the other's receive."""
    if out and isinstance(out[-1], (SendActivation, SendGrad)) and out[-1].peer == recv.peer:
        out[-1] = replace(out[-1], batch_next=True)
    out.append(recv)


def plan_to_json(plan: ExecutionPlan) -> str:
    """The plan as plain JSON (the store and planner processes move plans so)."""
    doc = {"schema": SCHEMA, "version": VERSION, **asdict(plan)}
    doc["instructions"] = [{"op": type(i).__name__, **asdict(i)} for i in plan.instructions]
    doc["micro_batches"] = [mb.to_json() for mb in plan.micro_batches]
    return json.dumps(doc)


def plan_from_json(text: str) -> ExecutionPlan:
    doc = json.loads(text)
    if doc.get("schema") != SCHEMA or doc.get("version") not in READS:
        raise ValueError(
            f"not a plan this code reads: schema {doc.get('schema')!r} version {doc.get('version')!r}; "
            f"expected schema {SCHEMA!r} version {' or '.join(map(str, READS))}"
        )
    instructions = []
    for entry in doc["instructions"]:
        entry = dict(entry)
        op = entry.pop("op")
        if op not in INSTRUCTIONS:
            raise ValueError(f"unknown instruction {op!r}; this code knows {sorted(INSTRUCTIONS)}")
        try:
            entry["shapes"] = tuple(tuple(shape) for shape in entry.get("shapes", ()))
            instructions.append(INSTRUCTIONS[op](**entry))
        except TypeError as e:
            raise ValueError(f"malformed {op} instruction {entry}: {e}") from None
    micro_batches = tuple(PlannedMicroBatch.from_json(mb) for mb in doc["micro_batches"])
    plan_fields = {f.name for f in fields(ExecutionPlan)} - {"instructions", "micro_batches"}
    return ExecutionPlan(
        **{k: doc[k] for k in plan_fields}, instructions=tuple(instructions), micro_batches=micro_batches
    )


def check_plans(plans: Sequence[ExecutionPlan], *, rendezvous: bool = False) -> None:
    """Raise ValueError unless the plans can run together.

    Every send needs a receive at its peer, in the same order per (pair, direction), with equal
    shapes; every stage runs each micro-batch's forward and backward once (forward first), and
    the first and last stages load it once. That much suffices if sends are buffered (gloo).
    ``rendezvous`` also replays the plans as NCCL runs them (``_replay_rendezvous``) and
    names the first instruction that would wait forever.
    """
    by_rank = {p.rank: p for p in plans}
    if len(by_rank) != len(plans):
        raise ValueError("two plans share a rank")
    for plan in plans:
        _check_one(plan)
    # What each (sender, receiver, kind) pair carries, in order, seen from both ends.
    sent: dict[tuple[int, int, str], list] = {}
    received: dict[tuple[int, int, str], list] = {}
    for plan in plans:
        for i in plan.instructions:
            if not isinstance(i, (SendActivation, SendGrad, RecvActivation, RecvGrad)):
                continue
            if i.peer not in by_rank:
                raise ValueError(
                    f"rank {plan.rank}: {type(i).__name__} of micro-batch {i.mb} names rank {i.peer}, which has no plan"
                )
            kind = "activation" if isinstance(i, (SendActivation, RecvActivation)) else "grad"
            if isinstance(i, (SendActivation, SendGrad)):
                sent.setdefault((plan.rank, i.peer, kind), []).append((i.mb, i.shapes))
            else:
                received.setdefault((i.peer, plan.rank, kind), []).append((i.mb, i.shapes))
    for key in sorted(set(sent) | set(received)):
        src, dst, kind = key
        out, into = sent.get(key, []), received.get(key, [])
        for n, (s, r) in enumerate(zip(out, into)):
            if s != r:
                raise ValueError(
                    f"{kind} {src} -> {dst}, message {n}: rank {src} sends micro-batch {s[0]} shapes {s[1]}, "
                    f"rank {dst} receives micro-batch {r[0]} shapes {r[1]}"
                )
        if len(out) != len(into):
            raise ValueError(f"{kind} {src} -> {dst}: {len(out)} sends but {len(into)} receives")
    if rendezvous:
        _replay_rendezvous(plans)


@dataclass(frozen=True)
class _Post:
    """One operation a rank posts and waits on: ``needs`` are the operations (of peers) that
    must be posted for it to complete."""

    index: int  # of the instruction in its plan
    own: tuple
    needs: tuple[tuple, ...]


def _waits(
    plan: ExecutionPlan, stage_ranks: dict[int, list[int]], column_ranks: dict[tuple[int, int], int]
) -> list[list[_Post]]:
    """The points where ``plan``'s rank blocks, in order: each a batch of operations posted together.

    NCCL matches point-to-point messages per (sender, receiver) pair in posting order, whatever
    they carry; ReduceGrads is a collective of the stage's data-parallel ranks; the forward and
    backward of a micro-batch with ``sp`` > 1 are collectives of its group's columns at the stage
    (``column_ranks``: (stage, column) -> rank)."""
    waits: list[list[_Post]] = []
    batch: list[_Post] = []
    sent: Counter = Counter()
    received: Counter = Counter()
    for n, ins in enumerate(plan.instructions):
        if isinstance(ins, (SendActivation, SendGrad)):
            key = (plan.rank, ins.peer, sent[ins.peer])
            sent[ins.peer] += 1
            batch.append(_Post(n, ("send", *key), (("recv", *key),)))
        elif isinstance(ins, (RecvActivation, RecvGrad)):
            key = (ins.peer, plan.rank, received[ins.peer])
            received[ins.peer] += 1
            batch.append(_Post(n, ("recv", *key), (("send", *key),)))
        elif isinstance(ins, ReduceGrads):
            waits.append([_Post(n, ("reduce", plan.rank), tuple(("reduce", r) for r in stage_ranks[plan.stage]))])
            continue
        elif isinstance(ins, (ForwardPass, *BACKWARDS)) and plan.micro_batches[ins.mb].sp > 1:
            desc = plan.micro_batches[ins.mb]
            key = (plan.stage, desc.group, ins.mb, type(ins).__name__)
            columns = range(desc.group, desc.group + desc.sp)
            if any((plan.stage, c) not in column_ranks for c in columns):
                raise ValueError(
                    f"rank {plan.rank}: micro-batch {ins.mb} runs on the sequence-parallel group of "
                    f"columns {list(columns)}, but some of them have no plan at stage {plan.stage}"
                )
            members = [column_ranks[(plan.stage, c)] for c in columns]
            waits.append([_Post(n, ("group", plan.rank, *key), tuple(("group", r, *key) for r in members))])
            continue
        else:
            continue
        if not ins.batch_next:
            waits.append(batch)
            batch = []
    return waits


def _replay_rendezvous(plans: Sequence[ExecutionPlan]) -> None:
    """Run every rank's instructions with unbuffered sends: an operation completes once its
    peer has posted the matching one, a batch once all of its operations have. Raise naming the
    first blocked instruction if some rank never finishes."""
    stage_ranks: dict[int, list[int]] = {}
    for plan in plans:
        stage_ranks.setdefault(plan.stage, []).append(plan.rank)
    column_ranks = {(p.stage, p.column): p.rank for p in plans}
    by_rank = {p.rank: p for p in plans}
    waits = {p.rank: _waits(p, stage_ranks, column_ranks) for p in plans}
    at = dict.fromkeys(by_rank, 0)  # the wait each rank is blocked in
    posted = {post.own for w in waits.values() if w for post in w[0]}
    queue = list(by_rank)
    while queue:
        rank = queue.pop()
        mine = waits[rank]
        while at[rank] < len(mine) and all(need in posted for post in mine[at[rank]] for need in post.needs):
            at[rank] += 1
            if at[rank] < len(mine):
                posted.update(post.own for post in mine[at[rank]])
                # the peers of what it now posts may be able to go on
                queue += [_rank_of(need) for post in mine[at[rank]] for need in post.needs]
    stuck = sorted(r for r in by_rank if at[r] < len(waits[r]))
    if not stuck:
        return
    rank = stuck[0]
    post = next(p for p in waits[rank][at[rank]] if not all(need in posted for need in p.needs))
    ins = by_rank[rank].instructions[post.index]
    peer = next(_rank_of(need) for need in post.needs if need not in posted)
    there = by_rank[peer].instructions[waits[peer][at[peer]][0].index] if at[peer] < len(waits[peer]) else None
    blocked = (
        f"its instruction {waits[peer][at[peer]][0].index} {type(there).__name__} of micro-batch {there.mb}"
        if there is not None
        else "the end of its plan"
    )
    raise ValueError(
        f"rendezvous deadlock: rank {rank} (stage {by_rank[rank].stage}) waits forever at instruction {post.index} "
        f"{type(ins).__name__} of micro-batch {ins.mb} with peer rank {peer}, which is blocked at {blocked}; "
        "without buffered sends (NCCL) a send must be posted in one batch with the receive its peer "
        "posts at the same time (batch_next)"
    )


def _rank_of(op: tuple) -> int:
    """The rank that posts ``op``: the sender of a send, the receiver of a receive, a collective's member."""
    kind = op[0]
    return op[1] if kind in ("send", "reduce", "group") else op[2]


def _check_one(plan: ExecutionPlan) -> None:
    where = f"rank {plan.rank} (stage {plan.stage})"
    expected = Counter(range(len(plan.micro_batches)))
    loads_expected = plan.stage in plan.loading_stages
    forwarded: set[int] = set()
    split: set[int] = set()  # micro-batches whose BackwardInput ran, their BackwardWeight not yet
    counts: dict[type, Counter] = {cls: Counter() for cls in (LoadMicroBatch, ForwardPass)}
    backwards: Counter = Counter()  # a BackwardPass, or a BackwardInput and its BackwardWeight, counted once
    for i in plan.instructions:
        if type(i) in counts:
            counts[type(i)][i.mb] += 1
        if isinstance(i, ForwardPass):
            forwarded.add(i.mb)
        elif isinstance(i, BACKWARDS):
            if i.mb not in forwarded:
                raise ValueError(f"{where}: {type(i).__name__} of micro-batch {i.mb} before its ForwardPass")
            backwards[i.mb] += 1
            if isinstance(i, BackwardInput):
                split.add(i.mb)
        elif isinstance(i, BackwardWeight):
            if i.mb not in split:
                raise ValueError(f"{where}: BackwardWeight of micro-batch {i.mb} without a BackwardInput before it")
            split.discard(i.mb)
    if split:
        raise ValueError(f"{where}: BackwardInput of micro-batches {sorted(split)} without their BackwardWeight")
    counts[BackwardPass] = backwards
    for cls, seen in counts.items():
        want = expected if cls is not LoadMicroBatch or loads_expected else Counter()
        if seen != want:
            wrong = sorted(set(seen) ^ set(want) | {mb for mb in seen if seen[mb] > 1}, key=str)
            raise ValueError(f"{where}: {cls.__name__} of micro-batches {wrong} missing, repeated or unexpected")
    for n, i in enumerate(plan.instructions):
        if i.batch_next and not (
            isinstance(i, EXCHANGES)
            and n + 1 < len(plan.instructions)
            and isinstance(plan.instructions[n + 1], EXCHANGES)
        ):
            raise ValueError(
                f"{where}: instruction {n} {type(i).__name__} of micro-batch {i.mb} is batched with the "
                "next, but only a send or receive followed by another can be"
            )
    tail = [type(i) for i in plan.instructions if isinstance(i, (ReduceGrads, OptimizerStep))]
    if tail != [ReduceGrads, OptimizerStep] or type(plan.instructions[-1]) is not OptimizerStep:
        raise ValueError(f"{where}: must end with one ReduceGrads then one OptimizerStep")
