"""A sequence-parallel size per micro-batch inside Megatron (DCP), pipelines included.

With ``sequence_parallel.enabled`` a plan may split a micro-batch's rows over an aligned group of
k data-parallel columns: every column of the group runs the same instruction list (the group's
schedule, its own shapes) and holds its contiguous 1/k of every row (``collate.shard``, labels
shifted before the split). Megatron sees plain data parallelism; inside its model three things
change while a split micro-batch runs, and nothing otherwise:

- the core attention spans the group: ``PackedDotProductAttention`` hands the shard's queries,
  keys and values to the plugin's Ulysses or ring attention (``models/sequence_parallel.py``),
  which finds the documents from the whole rows' positions (so packed rows go in as plain rows,
  without ``cu_seqlens``);
- RoPE at the shard's own positions: megatron-core's ``RotaryEmbedding`` gives a row of s tokens
  the positions 0 .. s-1, right only on the group's first rank; under a shard it gives every
  token its position in its document (packed rows restart per document, as Megatron's THD RoPE);
- the group is entered around each micro-batch's forward (the schedule's forward step) and
  around its backward (``backward_step``, patched here), so activation recompute in backward
  re-runs attention over its own forward's group. Megatron's schedules run the backwards of a
  stage in the order of its forwards (1F1B, and the loop without pipelining), so a backward
  belongs to the oldest forward still waiting for one.

Each shard's loss is its own tokens' summed loss; Megatron's per-token loss sums the losses and
the token counts over the data-parallel ranks, which is the global batch's token mean whatever
the grouping (the gradients of a group reach every member's parameters through the attention
collectives). The columns of a group run copies of one instruction list, so they reach their
group's collectives in the same order after the same transfers (as in DeepSpeed's pipeline engine);
``check_plans(rendezvous=True)`` replays every plan with unbuffered sends and those collectives.

What this cannot run exactly is refused before the first step (``check_model``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from dyn_plugin.host.sequence_parallel import SequenceRuntime
from dyn_plugin.models.sequence_parallel import SequenceShard, current
from dyn_plugin.runtime.loader import Step

from .registry import Patch

ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward"
BACKWARD = "megatron.core.pipeline_parallel.schedules.backward_step"


class GroupedMicroBatches:
    """One planned step on one rank: the group each micro-batch's forward and backward run over."""

    def __init__(self, sequence: SequenceRuntime, step: Step, stage: int) -> None:
        self._sequence, self._step, self._stage = sequence, step, stage
        self._waiting: collections.deque[tuple[int, SequenceShard | None]] = collections.deque()

    @contextlib.contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Around the forward of the plan's micro-batch ``mb``."""
        shard = self._sequence.planned_shard(self._step, mb, self._stage)
        self._waiting.append((mb, shard))
        with self._sequence.running(self._step, mb, self._stage, shard):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the next backward: the oldest forward's micro-batch."""
        if not self._waiting:
            raise RuntimeError("Megatron's schedule ran a backward with no forward waiting for it")
        mb, shard = self._waiting.popleft()
        with self._sequence.running(self._step, mb, self._stage, shard):
            yield


_ACTIVE: GroupedMicroBatches | None = None  # the planned step the schedule is running, if any


@contextlib.contextmanager
def grouped(groups: GroupedMicroBatches | None) -> Iterator[None]:
    """Make ``groups`` the step whose backwards ``backward_step`` enters, for the schedule's call."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, groups
    try:
        yield
    finally:
        _ACTIVE = previous


def _backward_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def backward_step(*args: Any, **kwargs: Any):
        if _ACTIVE is None:
            return original(*args, **kwargs)
        with _ACTIVE.backward():
            return original(*args, **kwargs)

    return backward_step


def _rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        shard = current()
        if shard is None:
            return original(self, max_seq_len, offset, packed_seq, cp_group)
        width = shard.position_ids.shape[1]
        if offset or packed_seq or max_seq_len * shard.size != width:
            raise ValueError(
                f"RoPE asked for {max_seq_len} positions (offset {offset}, packed {packed_seq}) inside a "
                f"sequence-parallel shard of {width // shard.size} of a row of {width} tokens: the plugin's "
                "shards are plain rows of 1/k of the micro-batch's width"
            )
        # every position a row can hold ([width, 1, 1, dim], cached by megatron-core), gathered at
        # each token's own: [s/k, rows, 1, dim], which RoPE's bshd path broadcasts over the heads
        table = original(self, width, 0, False, cp_group)
        return table[shard.own_positions.t()].squeeze(2)

    return forward


def check_model(chunk: Any, tp: int) -> None:
    """Refuse, before the first step, a model the group attention cannot run exactly (on every rank
    alike: the settings are the run's), naming the Megatron flag and the fix."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from .attention import PackedDotProductAttention

    c, refused = chunk.config, []
    if tp > 1:
        refused.append(
            f"--tensor-model-parallel-size {tp}: the groups are built over the data-parallel ranks of one "
            "tensor-parallel rank; use 1"
        )
    columns = ps.get_data_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    if dist.get_process_group_ranks(ps.get_data_parallel_group()) != [stage * columns + c for c in range(columns)]:
        refused.append(
            "Megatron's rank order: the groups take the data-parallel ranks of a stage as neighbouring ranks "
            "(megatron-core's default order tp-cp-ep-dp-pp); leave --use-tp-pp-dp-mapping out"
        )
    others = {type(m.core_attention).__name__ for m in chunk.modules() if hasattr(m, "core_attention")}
    others.discard(PackedDotProductAttention.__name__)
    if others:
        refused.append(
            f"core attention {', '.join(sorted(others))}: only Megatron's local attention is made to span a group; "
            "use --transformer-impl local"
        )
    kind = getattr(chunk, "position_embedding_type", None)
    if kind == "rope" and type(getattr(chunk, "rotary_pos_emb", None)) is not RotaryEmbedding:
        refused.append(
            f"{type(chunk.rotary_pos_emb).__name__}: shards take RoPE at their own positions from the plain "
            "RotaryEmbedding only; use --position-embedding-type rope without YaRN or multimodal RoPE"
        )
    if kind == "rope" and c.apply_rope_fusion:
        refused.append("fused RoPE takes one position per row index, not per token; pass --no-rope-fusion")
    if c.attention_dropout > 0:
        refused.append(f"--attention-dropout {c.attention_dropout}: the group attention has none; set it to 0")
    if c.window_size is not None or c.softmax_type != "vanilla":
        refused.append("sliding windows and softmax offsets: the group attention is plain causal softmax attention")
    if refused:
        raise ValueError(
            "dyn_plugin.sequence_parallel.enabled under Megatron cannot run this model exactly: "
            + "; ".join(refused)
            + " (or set sequence_parallel.enabled to false)"
        )


def sequence_parallel_patches() -> list[Patch]:
    """RoPE at a shard's positions, and a split micro-batch's group around its backward."""
    return [
        Patch("sequence_parallel.rotary", ROPE, _rotary),
        Patch("sequence_parallel.backward_step", BACKWARD, _backward_step),
    ]
